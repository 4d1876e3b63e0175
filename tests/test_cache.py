"""relpos.cache: decoding with a K/V cache equals the full model on the growing sequence (float64, <= 1e-10) for every
position method -- prompts shorter and longer than max_cache_len, left-padded rows, a document reset, several tokens at
once -- and refuses bad input with a clear error that leaves the cache unchanged."""
import pytest
import torch
from relpos.models import DecoderLM, POSITIONS, POSITION_BUILDERS, SequenceFirstAttention
from relpos.cache import KVCache, full_logits, supports_cache
from relpos.rotary import RotaryMultiHeadAttention

V = 13
TOL = 1e-10


def small(position, **kw):
    "A float64 model with every parameter perturbed (XL's zero-initialised tables would make equality vacuous)."
    torch.manual_seed(0)
    lm = DecoderLM(V, position=position, **dict(dict(d_model=16, heads=2, n_layers=2, max_len=64), **kw)).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return lm


def tokens(b, n, seed):
    return torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))


def err(a, b): return (a - b).abs().max().item()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("prompt_len, window", [(5, None), (3, 6), (9, 4), (1, 1)])
def test_decode_equals_full_model(position, prompt_len, window):
    "A prompt in one pass, then one token at a time: the logits of the full model (with the same window mask)."
    lm, seq = small(position), tokens(3, 14, 2)
    with torch.no_grad():
        want = full_logits(lm, seq, max_cache_len=window)
        cache = lm.new_cache(3, window or 14)
        got = [lm(seq[:, :prompt_len], cache=cache)[0]]
        got += [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(prompt_len, 14)]
    assert err(torch.cat(got, 1), want) <= TOL
    assert len(cache) == min(14, window or 14) and cache.seen == 14


@pytest.mark.parametrize("position", POSITIONS)
def test_full_logits_is_forward(position):
    "Without padding and window the reference is the model's own forward."
    lm, seq = small(position), tokens(2, 9, 1)
    with torch.no_grad(): assert err(full_logits(lm, seq), lm(seq)[0]) <= TOL


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("lens, window", [((3, 7), None), ((2, 9), 5), ((4, 4, 1), 3)])
def test_left_padding_equals_each_row_alone(position, lens, window):
    lm, new = small(position), 6
    b, n = len(lens), max(lens)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, V, (l + new,), generator=g) for l in lens]
    prompt, mask = torch.zeros(b, n, dtype=torch.long), torch.zeros(b, n, dtype=torch.long)
    for r, l in enumerate(lens): prompt[r, n - l:], mask[r, n - l:] = rows[r][:l], 1
    with torch.no_grad():
        cache = lm.new_cache(b, window or n + new)
        got = [lm(prompt, cache=cache, attention_mask=mask)[0][:, -1:]]
        got += [lm(torch.stack([rows[r][lens[r] + t] for r in range(b)])[:, None], cache=cache)[0] for t in range(new - 1)]
        got = torch.cat(got, 1)
        for r, l in enumerate(lens):
            assert err(got[r], full_logits(lm, rows[r][None, :l + new - 1], max_cache_len=window)[0, l - 1:]) <= TOL
        # the padded batch through the reference gives the same numbers
        whole = torch.cat([prompt, torch.stack([rows[r][lens[r]:lens[r] + new - 1] for r in range(b)])], 1)
        whole_mask = torch.cat([mask, torch.ones(b, new - 1, dtype=torch.long)], 1)
        assert err(got, full_logits(lm, whole, whole_mask, max_cache_len=window)[:, n - 1:]) <= TOL


@pytest.mark.parametrize("position", POSITIONS)
def test_generate_left_padded_equals_rows_alone(position):
    "Greedy `generate` of a left-padded batch: each row's tokens are those of the row generated alone."
    lm = small(position)
    a, b = tokens(1, 3, 7)[0], tokens(1, 6, 8)[0]
    prompt = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    mask = torch.stack([torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, dtype=torch.long)])
    out = lm.generate(prompt, 7, temperature=0, attention_mask=mask)
    assert torch.equal(out[0, 6:], lm.generate(a[None], 7, temperature=0)[0, 3:])
    assert torch.equal(out[1], lm.generate(b[None], 7, temperature=0)[0])


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("window", [None, 4])
def test_document_reset_mid_generation(position, window):
    "Row 1's document ends after 6 tokens: from then on it equals the full model on its new document alone; row 0 goes on."
    lm, seq, before, after = small(position), tokens(2, 13, 4), 6, 7
    with torch.no_grad():
        cache = lm.new_cache(2, window or 13)
        got = [lm(seq[:, :3], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(3, before)]
        cache.reset(torch.tensor([False, True]))
        got += [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(before, before + after)]
        got = torch.cat(got, 1)
        assert err(got[0], full_logits(lm, seq[:1], max_cache_len=window)[0]) <= TOL
        assert err(got[1, before:], full_logits(lm, seq[1:, before:], max_cache_len=window)[0]) <= TOL
    assert cache.next_position.tolist() == [13, 7]


@pytest.mark.parametrize("position", POSITIONS)
def test_doc_start_resets_the_cache(position):
    lm, seq = small(position), tokens(2, 8, 9)
    with torch.no_grad():
        cache = lm.new_cache(2, 8)
        lm(seq[:, :4], cache=cache)
        got = lm(seq[:, 4:], cache=cache, doc_start=torch.tensor([True, False]))[0]
        assert err(got[0], full_logits(lm, seq[:1, 4:])[0]) <= TOL
        assert err(got[1], full_logits(lm, seq[1:])[0, 4:]) <= TOL


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("window", [None, 4, 7])
def test_several_tokens_after_a_cache(position, window):
    "Chunks into free slots (attended in place: no window, and 7 up to the 7th token), then chunks that wrap the ring (4, 7)."
    lm, seq, chunks = small(position), tokens(2, 15, 3), (4, 3, 1, 5, 2)
    with torch.no_grad():
        cache, got, i = lm.new_cache(2, window or 15), [], 0
        for c in chunks: got.append(lm(seq[:, i:i + c], cache=cache)[0]); i += c
        assert err(torch.cat(got, 1), full_logits(lm, seq, max_cache_len=window)) <= TOL


@pytest.mark.parametrize("position", POSITIONS)
def test_padding_token_in_a_decode_step(position):
    "Row 0 gets a padding token at step 7 (attention_mask 0): its other tokens equal the row without it (not seen, no position)."
    lm, seq, pad_at = small(position), tokens(2, 11, 11), 7
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[0, pad_at] = 0
    with torch.no_grad():
        cache = lm.new_cache(2, 11)
        got = [lm(seq[:, :5], cache=cache)[0]]
        got += [lm(seq[:, t:t + 1], cache=cache, attention_mask=mask[:, t:t + 1])[0] for t in range(5, 11)]
        got, keep = torch.cat(got, 1), mask[0].bool()
        assert err(got[0, keep], full_logits(lm, seq[:1, keep])[0]) <= TOL
        assert err(got[1], full_logits(lm, seq[1:])[0]) <= TOL
    assert cache.next_position.tolist() == [10, 11]


@pytest.mark.parametrize("position", POSITIONS)
def test_generate_cached_equals_uncached_and_full(position):
    lm, prompt = small(position), tokens(2, 5, 6)
    out = lm.generate(prompt, 9, temperature=0)
    assert torch.equal(out, lm.generate(prompt, 9, temperature=0, use_cache=False))
    with torch.no_grad():
        for t in range(5, 14): assert torch.equal(full_logits(lm, out[:, :t])[:, -1].argmax(-1), out[:, t])


@pytest.mark.parametrize("position", ['rotary', 'alibi', 'xl'])
def test_generate_sliding_window_equals_windowed_full_model(position):
    lm, prompt, w = small(position), tokens(2, 7, 10), 5
    out = lm.generate(prompt, 8, temperature=0, max_cache_len=w)
    with torch.no_grad():
        for t in range(7, 15): assert torch.equal(full_logits(lm, out[:, :t], max_cache_len=w)[:, -1].argmax(-1), out[:, t])


def test_xl_generates_beyond_P_with_a_window():
    "XL's tables bound the window, not the length generated."
    lm = small('xl', max_len=2)         # P = 16
    with pytest.raises(ValueError, match='P=16'): lm.generate(tokens(1, 8, 1), 10)
    out = lm.generate(tokens(1, 8, 1), 20, temperature=0, max_cache_len=16)
    # the reference runs the whole sequence in one pass, which needs tables for all of it: the same model with P = 64,
    # whose rows for the distances a window of 16 reaches are this model's (the others are never read)
    big = small('xl', max_len=2, P=64)
    state = {k: v for k, v in lm.state_dict().items()}
    for k, v in state.items():
        if 'key_pos' in k:
            table = torch.zeros(128, *v.shape[1:], dtype=v.dtype); table[64 - 16:64 + 16] = v; state[k] = table
    big.load_state_dict(state)
    with torch.no_grad():
        for t in (8, 20, 27): assert torch.equal(full_logits(big, out[:, :t], max_cache_len=16)[:, -1].argmax(-1), out[:, t])


@pytest.mark.parametrize("position", ['rotary', 'alibi', 't5'])
def test_grouped_query_heads_cache_kv_heads(position):
    lm = small(position, heads=4, kv_heads=2)
    cache = lm.new_cache(2, 10)
    assert cache.keys[0].shape == (2, 2, 10, 4) and cache.values[0].shape == (2, 2, 10, 4)
    seq = tokens(2, 10, 3)
    with torch.no_grad():
        got = torch.cat([lm(seq[:, :4], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(4, 10)], 1)
        assert err(got, full_logits(lm, seq)) <= TOL


@pytest.mark.parametrize("position", ['t5', 'fourier', 'xl_paper'])
def test_tables_follow_parameter_changes(position):
    "A distance table made once per cache is remade when a parameter changes in place."
    lm, seq = small(position), tokens(1, 8, 2)
    with torch.no_grad():
        cache = lm.new_cache(1, 8)
        lm(seq[:, :6], cache=cache); lm(seq[:, 6:7], cache=cache)
        for name, p in lm.layers[-1].self_attn.module.named_parameters():   # the last layer: its inputs stay the same
            if name == 'v' or name.startswith(('positions.', 'pos_linear.')): p.mul_(1.5)
        got = lm(seq[:, 7:8], cache=cache)[0]
        # the cached keys and values of the last layer do not depend on its position parameters: only the table is stale
        assert err(got[:, -1], full_logits(lm, seq)[:, -1]) <= TOL


def test_batch_of_zero_rows_and_zero_tokens():
    lm = small('rotary')
    assert lm.generate(torch.zeros(0, 3, dtype=torch.long), 4).shape == (0, 7)
    cache = lm.new_cache(2, 4)
    assert lm(torch.zeros(2, 0, dtype=torch.long), cache=cache)[0].shape == (2, 0, V) and cache.seen == 0


# ---------------------------------------------------------------- bad input: clear errors, the cache unchanged
def state(c):
    return [t.clone() for t in (*c.keys, *c.values, c.positions, c.valid, c.times, c.next_position)] + [c.seen, c.all_valid]


def same_state(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.fixture
def primed():
    lm = small('xl', max_len=4)   # P = 32
    cache = lm.new_cache(2, 8)
    with torch.no_grad(): lm(tokens(2, 5, 1), cache=cache)
    return lm, cache


@pytest.mark.parametrize("call, match", [
    (lambda lm, c: lm(torch.zeros(3, 1, dtype=torch.long), cache=c), "batch 3"),
    (lambda lm, c: small('xl', max_len=4)(torch.zeros(2, 1, dtype=torch.long), cache=c), "another model"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long), cache=c, position_ids=torch.tensor([[4], [5]])), "position_ids must continue"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long), cache=c, position_ids=torch.tensor([5.0])), "position_ids"),
    (lambda lm, c: lm(torch.zeros(2, 2, dtype=torch.long), cache=c, attention_mask=torch.ones(2, 3, dtype=torch.long)), "attention_mask"),
    (lambda lm, c: lm(torch.zeros(2, 2, dtype=torch.long), cache=c, attention_mask=torch.ones(2, 2)), "attention_mask"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long), cache=c, doc_start=torch.tensor([True])), "doc_start"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long) + V, cache=c), "n_vocab"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long), lm(torch.zeros(2, 1, dtype=torch.long))[1] or [torch.zeros(2, 1, 16)] * 2, cache=c), "not both"),
    (lambda lm, c: lm(torch.zeros(2, 1, dtype=torch.long), cache="cache"), "KVCache"),
    (lambda lm, c: lm.float()(torch.zeros(2, 1, dtype=torch.long), cache=c), "dtype"),
    (lambda lm, c: c.reset(torch.tensor([True])), "which"),
    (lambda lm, c: c.reset(torch.tensor([1, 0])), "which"),
])
def test_refused_calls_leave_the_cache_unchanged(primed, call, match):
    lm, cache = primed
    before = state(cache)
    with pytest.raises((ValueError, TypeError), match=match): call(lm, cache)
    assert same_state(before, state(cache))


def test_cache_on_another_device_is_refused(primed):
    lm, _ = primed
    meta = KVCache([l.self_attn.module for l in lm.layers], 2, 8, dtype=torch.float64, device='meta', owner=lm)
    with pytest.raises(ValueError, match='cache is on meta'): lm(torch.zeros(2, 1, dtype=torch.long), cache=meta)


def test_limits_of_the_tables():
    lm = small('xl', max_len=4)       # P = 32
    with pytest.raises(ValueError, match='P=32'): lm.new_cache(1, 33)
    with pytest.raises(ValueError, match='P=32'): lm(torch.zeros(1, 40, dtype=torch.long), cache=lm.new_cache(1, 8))
    lm_abs = small('absolute', max_len=6)
    cache = lm_abs.new_cache(1, 4)
    with torch.no_grad(): lm_abs(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    before = state(cache)
    with pytest.raises(ValueError, match='max_len=6'): lm_abs(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert same_state(before, state(cache))
    with pytest.raises(ValueError, match='max_len'): lm_abs.generate(torch.zeros(1, 4, dtype=torch.long), 4, max_cache_len=2)


@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=1.5, max_cache_len=4), "batch_size"), (dict(batch_size=1, max_cache_len=0), "max_cache_len"),
    (dict(batch_size=True, max_cache_len=4), "batch_size")])
def test_new_cache_arguments(kw, match):
    with pytest.raises(ValueError, match=match): small('none').new_cache(**kw)


def test_generate_arguments():
    lm = small('rotary')
    p = tokens(2, 3, 1)
    with pytest.raises(ValueError, match='attention_mask'): lm.generate(p, 2, attention_mask=torch.ones(2, 3), use_cache=False)
    with pytest.raises(ValueError, match='max_cache_len'): lm.generate(p, 2, max_cache_len=0)
    with pytest.raises(TypeError, match='use_cache'): lm.generate(p, 2, use_cache=1)


def test_models_without_a_cached_path():
    "kNN layers and attention whose position term the cache does not know: no cache; generate keeps the hidden states."
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, position='xl', memorizing_layers=(1,), knn_capacity=16, top_k=2)
    assert not lm.supports_cache()
    with pytest.raises(ValueError, match='kNN'): lm.new_cache(1, 4)
    assert lm.generate(tokens(1, 3, 1), 3).shape == (1, 6)

    class Shifted(RotaryMultiHeadAttention):
        def position_bias(self, seq_len_q, seq_len_k, position_ids=None): return torch.ones(1, 1, seq_len_q, seq_len_k)
    assert supports_cache(RotaryMultiHeadAttention(2, 16)) and not supports_cache(Shifted(2, 16))
    custom = DecoderLM(V, d_model=16, heads=2, n_layers=1,
                       position=lambda d, h, p, ml, mem: SequenceFirstAttention(Shifted(h, d, p)))
    assert not custom.supports_cache()
    with pytest.raises(ValueError, match='no cached path'): custom.new_cache(1, 4)


def test_bench_decoder_runs_generate_loops():
    "bench/cache.py's step-by-step loops decode what generate decodes (a smoke test of the benchmark, no timing asserted)."
    import bench.cache as bc
    lm = small('rotary').float()
    prompt = tokens(2, 4, 1)
    for use_cache in (True, False):
        d = bc.Decoder(lm, prompt, use_cache, max_cache_len=12)
        got = [d.logits.argmax(-1)]
        for _ in range(5):
            d.step(); got.append(d.logits.argmax(-1))
        assert torch.equal(torch.stack(got, 1), lm.generate(prompt, 6, temperature=0, use_cache=use_cache)[:, 4:])
    times = bc.interleaved_steps(lm, [prompt, tokens(2, 7, 2)], True, steps=3, rounds=2)
    assert len(times) == 2 and all(len(t) == 3 and min(t) > 0 for t in times)
    prof = bc.step_profile(lm, prompt, steps=2, rounds=1, warmup=1)
    assert set(prof) == {'attention_ms', 'linear_ms', 'other_ms'} and prof['attention_ms'] > 0 and prof['linear_ms'] > 0


@pytest.mark.parametrize("kw", [dict(norm='rms', ffn='swiglu', bias=False, kv_heads=1, heads=4),
                                dict(ffn='gelu', parallel_residual=True), dict(nope_layers=(0,))])
@pytest.mark.parametrize("position", ['rotary', 'alibi', 't5'])
def test_decoder_variants_decode_with_the_cache(position, kw):
    "LLaMA-, GPT-NeoX-shaped and NoPE-mixed DecoderLMs: cached decoding equals the full model."
    lm, seq = small(position, **kw), tokens(2, 12, 5)
    with torch.no_grad():
        cache = lm.new_cache(2, 8)
        got = torch.cat([lm(seq[:, :5], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(5, 12)], 1)
        assert err(got, full_logits(lm, seq, max_cache_len=8)) <= TOL


@pytest.mark.parametrize("position", ['rotary', 'alibi', 't5'])
@pytest.mark.parametrize("ring", [32, 5])   # 32: the sliding layer's slots never wrap the ring; 5: they do
def test_sliding_layer_with_grouped_heads_reads_its_window_in_place(position, ring, monkeypatch):
    """Decode with a window narrower than the ring, grouped-query heads and left padding equals the full model; where the
    window's slots do not wrap the ring, every decode step's SDPA reads the keys in place (views of the cache, no copy)
    and each key head once (its group of query heads as queries, no `enable_gqa` repetition)."""
    import torch.nn.functional as F
    lm = small(position, heads=4, kv_heads=2, sliding_window=3, layer_types=['sliding_attention', 'full_attention'])
    x, keep = tokens(2, 14, 4), torch.ones(2, 14, dtype=torch.long)
    keep[1, :2] = 0
    calls, sdpa = [], F.scaled_dot_product_attention
    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[1], k.shape[1], k.untyped_storage().data_ptr(), kw.get('enable_gqa', False)))
        return sdpa(q, k, v, *a, **kw)
    with torch.no_grad():
        want = full_logits(lm, x, keep, max_cache_len=ring)
        cache = lm.new_cache(2, ring)
        got = [lm(x[:, :5], cache=cache, attention_mask=keep[:, :5])[0]]
        monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
        got += [lm(x[:, t:t + 1], cache=cache)[0] for t in range(5, 14)]
    assert err(torch.cat(got, 1)[keep.bool()], want[keep.bool()]) <= TOL
    assert len(calls) == 2 * 9
    if ring == 32:
        buffers = {t.untyped_storage().data_ptr() for t in cache.keys}
        assert all(ptr in buffers for *_, ptr, _ in calls)
    assert all(h == kv == 2 and not gqa for h, kv, _, gqa in calls)

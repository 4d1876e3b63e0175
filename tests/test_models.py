"""relpos.models: every position method trains, evaluates at 8x its training length, runs with memory,
generates with a cache that equals re-encoding; labml_nn Transformer-XL checkpoints load."""
import ast, copy, math
from pathlib import Path
import pytest
import torch
import torch.nn.functional as F
from relpos.models import DecoderLM, POSITIONS, POSITION_BUILDERS, causal_mask, BatchFirstAttention
from relpos.relative_mha import TransformerXLModel
from relpos.memorizing import KNNMemory

V = 13
MEMORY = [p for p in POSITIONS if DecoderLM(V, d_model=8, heads=2, n_layers=1, position=p, max_len=4).supports_memory]


def randomized(lm, std=0.1, seed=0):
    "Perturb every parameter: XL's zero-initialised tables would make equality checks vacuous."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(std * torch.randn(p.shape, generator=g))
    return lm


def small(position, **kw):
    torch.manual_seed(0)
    kw = dict(dict(d_model=16, heads=2, n_layers=2, max_len=8), **kw)
    return DecoderLM(V, position=position, **kw)


def test_causal_mask_matches_brute_force():
    for q in range(0, 5):
        for k in range(q, 7):
            want = torch.tensor([[j <= i + k - q for j in range(k)] for i in range(q)], dtype=torch.bool).reshape(q, k)
            assert torch.equal(causal_mask(q, k), want)


def test_positions_cover_the_contract():
    assert {'none', 'absolute', 'xl', 'xl_paper', 'shaw', 'fourier'} <= set(POSITIONS)
    assert set(MEMORY) == set(POSITIONS) - {'absolute'}


@pytest.mark.parametrize("position", POSITIONS)
def test_trains_and_evaluates_at_8x(position):
    "Loss falls over a few steps (next token = token + 1 mod V, learnable with or without positions); then 8x the length."
    lm = small(position, max_len=16)
    opt, g = torch.optim.Adam(lm.parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(15):
        x = (torch.randint(0, V, (8, 1), generator=g) + torch.arange(16)) % V
        logits, _ = lm(x)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    lm.eval()
    with torch.no_grad():
        if position == 'absolute':
            with pytest.raises(ValueError, match='max_len='): lm(torch.randint(0, V, (1, 17)))
        else:
            logits, _ = lm(torch.randint(0, V, (2, 8 * 16)))
            assert logits.shape == (2, 128, V) and torch.isfinite(logits).all()


@pytest.mark.parametrize("position", MEMORY)
@pytest.mark.parametrize("mem_len", [3, 5, 12])
def test_memory_is_bounded_detached_and_exact(position, mem_len):
    "Segments with memory give the logits of one pass over [the last mem_len tokens (per layer), segment]."
    lm = randomized(small(position, mem_len=mem_len)).eval()
    tokens = torch.randint(0, V, (2, 15), generator=torch.Generator().manual_seed(1))
    memory, seen = None, 0
    for n in (4, 5, 6):
        seg = tokens[:, seen:seen + n]
        logits, new_memory = lm(seg, memory)
        assert len(new_memory) == 2
        assert all(m.shape == (2, min(mem_len, seen + n), 16) and not m.requires_grad for m in new_memory)
        if mem_len >= seen:   # the memory holds everything before: exact against one pass
            whole, _ = lm(tokens[:, :seen + n])
            torch.testing.assert_close(logits, whole[:, seen:], rtol=1e-5, atol=1e-5)
        memory, seen = new_memory, seen + n


@pytest.mark.parametrize("position", MEMORY)
def test_memory_gradients_stop(position):
    lm = randomized(small(position, mem_len=4))
    _, memory = lm(torch.randint(0, V, (2, 4)))
    logits, _ = lm(torch.randint(0, V, (2, 4)), memory)
    logits.sum().backward()
    assert all(m.grad is None and not m.requires_grad for m in memory)


@pytest.mark.parametrize("position", POSITIONS)
def test_cached_logits_equal_reencoding(position):
    "The cache generate uses (every earlier layer input) gives, step by step, the logits of re-encoding the prefix."
    lm = randomized(small(position, max_len=16)).eval()
    seq = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, cache = lm._run(seq[:, :5], None, None)
        for t in range(5, 12):
            want = lm(seq[:, :t])[0][:, -1]
            torch.testing.assert_close(logits[:, -1], want, rtol=1e-5, atol=1e-5)
            logits, cache = lm._run(seq[:, t:t + 1], cache, None)
            assert all(c.shape[1] == t + 1 for c in cache)


def _reencoding_sampler(lm, prompt, n, temperature, top_k, generator):
    "The naive generator: re-encode the whole prefix for every token, same sampling rule."
    out = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = lm(out)[0][:, -1].float()
            if temperature == 0: nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], float('-inf'))
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            out = torch.cat([out, nxt], 1)
    return out


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("temperature, top_k", [(0, None), (1.0, None), (0.7, 3)])
def test_generate_equals_reencoding(position, temperature, top_k):
    lm = randomized(small(position, max_len=16))
    prompt = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(3))
    got = lm.generate(prompt, 10, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(4))
    assert lm.training   # the mode is restored
    want = _reencoding_sampler(lm.eval(), prompt, 10, temperature, top_k, torch.Generator().manual_seed(4))
    assert torch.equal(got, want)


def test_generate_limits():
    lm = small('absolute', max_len=8)
    assert lm.generate(torch.zeros(1, 4, dtype=torch.long), 5).shape == (1, 9)  # the last token needs no position
    with pytest.raises(ValueError, match='max_len=9'): lm.generate(torch.zeros(1, 4, dtype=torch.long), 6)
    xl = small('xl', max_len=2)   # P = 16
    with pytest.raises(ValueError, match='P=17'): xl.generate(torch.zeros(1, 8, dtype=torch.long), 10)
    for bad, match in [(dict(max_new_tokens=-1), 'max_new_tokens'), (dict(max_new_tokens=2, temperature=-1.0), 'temperature'),
                       (dict(max_new_tokens=2, top_k=0), 'top_k'), (dict(max_new_tokens=2, top_k=V + 1), 'top_k')]:
        with pytest.raises((ValueError, TypeError), match=match): lm.generate(torch.zeros(1, 2, dtype=torch.long), **bad)
    with pytest.raises(ValueError, match='prompt'): lm.generate(torch.zeros(1, 0, dtype=torch.long), 2)


def test_empty_segment_keeps_memory():
    lm = small('xl', mem_len=4).eval()
    _, memory = lm(torch.randint(0, V, (2, 3)))
    logits, new_memory = lm(torch.zeros(2, 0, dtype=torch.long), memory)
    assert logits.shape == (2, 0, V) and all(torch.equal(a, b) for a, b in zip(memory, new_memory))


def test_custom_builder_and_per_layer_factory():
    "`position=` takes a builder; `make_attention(layer)` picks each layer's attention."
    class Half(DecoderLM):
        def make_attention(self, layer):
            return POSITION_BUILDERS['shaw' if layer == 0 else 'xl_paper'](self.d_model, self.heads, 0.0, self.max_len, self.mem_len)
    lm = Half(V, d_model=16, heads=2, n_layers=2, position='none', mem_len=4)
    assert [type(l.self_attn.module).__name__ for l in lm.layers] == ['RelationAwareMultiHeadAttention', 'XLRelativeMultiHeadAttention']
    logits, mem = lm(torch.randint(0, V, (2, 5)))
    assert logits.shape == (2, 5, V) and len(mem) == 2
    lm2 = DecoderLM(V, d_model=16, heads=2, n_layers=1, position=POSITION_BUILDERS['fourier'])
    assert lm2(torch.randint(0, V, (2, 5)))[0].shape == (2, 5, V)


def test_state_dict_round_trip_pickle_deepcopy():
    import copy, pickle
    for position in POSITIONS:
        a = randomized(small(position)).eval()
        b = small(position).eval()
        b.load_state_dict(a.state_dict(), strict=True)
        x = torch.randint(0, V, (2, 6))
        with torch.no_grad():
            for other in (b, copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
                torch.testing.assert_close(other(x)[0], a(x)[0], rtol=0, atol=0)


# ---------------------------------------------------------------- labml_nn compatibility
def _labml_autoregressive_model():
    "labml_nn's Transformer-XL experiment `AutoregressiveModel`, from its source (the experiment module imports "
    "torchvision and labml trainer helpers this venv does not have, so only the class is executed)."
    xl = pytest.importorskip("labml_nn.transformers.xl")
    import labml_nn.utils
    src = Path(xl.__file__).with_name('experiment.py').read_text()
    cls = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == 'AutoregressiveModel')
    ns = dict(torch=torch, nn=torch.nn, List=list, TransformerXL=xl.TransformerXL)
    from labml_nn.transformers.utils import subsequent_mask
    ns['subsequent_mask'] = subsequent_mask
    exec(compile(ast.Module([cls], []), 'labml_nn/transformers/xl/experiment.py', 'exec'), ns)
    return ns['AutoregressiveModel'], xl


def _labml_model(n_vocab, d_model, heads, d_ff, n_layers):
    AutoregressiveModel, xl = _labml_autoregressive_model()
    from labml_nn.transformers.feed_forward import FeedForward
    layer = xl.TransformerXLLayer(d_model=d_model, self_attn=xl.RelativeMultiHeadAttention(heads, d_model, 0.0),
                                  feed_forward=FeedForward(d_model, d_ff, 0.0), dropout_prob=0.0)
    torch.manual_seed(0)
    return randomized(AutoregressiveModel(n_vocab, d_model, xl.TransformerXL(layer, n_layers)), std=0.05).eval()


def test_transformer_xl_model_defaults_load_labml_checkpoint():
    "`TransformerXLModel(n_vocab)` with default sizes loads labml_nn's model strictly and gives its numbers."
    labml = _labml_model(11, d_model=128, heads=4, d_ff=256, n_layers=6)
    ours = TransformerXLModel(11).eval()
    ours.load_state_dict(labml.state_dict(), strict=True)
    x = torch.randint(0, 11, (7, 2))
    with torch.no_grad():
        want, want_mem = labml(x, [])
        got, _ = ours(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_transformer_xl_model_evaluates_at_8x_and_names_its_own_P():
    m = TransformerXLModel(11, d_model=16, heads=2, d_ff=32, n_layers=1, mem_len=128, max_seq_len=128).eval()
    with torch.no_grad():
        _, mem = m(torch.randint(0, 11, (128, 1)))
        assert m(torch.randint(0, 11, (1024, 1)), mem)[0].shape == (1024, 1, 11)
    with pytest.raises(ValueError, match=r'TransformerXLModel\(\.\.\., P=4097\)'):
        m(torch.randint(0, 11, (3969, 1)), mem)


def test_decoder_lm_xl_loads_labml_checkpoint_through_documented_key_map():
    from relpos.models import labml_xl_state_dict
    labml = _labml_model(11, d_model=32, heads=4, d_ff=64, n_layers=2)
    lm = DecoderLM(11, d_model=32, heads=4, n_layers=2, d_ff=64, position='xl', P=4096).eval()
    lm.load_state_dict(labml_xl_state_dict(labml.state_dict()), strict=True)
    x = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        want, _ = labml(x.t(), [])
        torch.testing.assert_close(lm(x)[0], want.transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", ['xl', 'absolute'])
def test_generate_runs_one_position_per_new_token(position):
    "The O(n * context) claim, counted: after the prompt, every step runs the layers on one position."
    lm = small(position, max_len=16)
    seen = []
    lm.layers[0].register_forward_pre_hook(lambda mod, args: seen.append((args[0].shape[1], 0 if args[1] is None else args[1].shape[1])))
    lm.generate(torch.randint(0, V, (2, 5)), 6, use_cache=False)
    assert seen == [(5, 0)] + [(1, 5 + s) for s in range(5)]   # (queries, cached positions)
    # with the K/V cache (the default) a step projects the keys of one position and reads the others from the cache
    keys = []
    lm.layers[0].self_attn.module.key.register_forward_pre_hook(lambda mod, args: keys.append(args[0].shape[-2]))
    lm.generate(torch.randint(0, V, (2, 5)), 6)
    assert keys == [5] + [1] * 5


# ---------------------------------------------------------------- 'fire' and nope_layers
def test_fire_in_the_registry():
    assert 'fire' in POSITIONS
    lm = small('fire', mem_len=4)
    assert type(lm.layers[0].self_attn.module).__name__ == 'FireMultiHeadAttention'
    assert lm.supports_memory and lm.max_keys is None


@pytest.mark.parametrize("position", [p for p in POSITIONS if p != 'absolute'])
def test_all_layers_nope_equals_none(position):
    "Every layer in nope_layers: the model is position='none' with the same weights (a strict state_dict load), with memory."
    lm = randomized(small(position, nope_layers=(0, 1), mem_len=4, max_len=8)).eval()
    plain = small('none', mem_len=4, max_len=8).eval()
    plain.load_state_dict(lm.state_dict())
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        (a, ma), (b, mb) = lm(x), plain(x)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(lm(x, ma)[0], plain(x, mb)[0], rtol=0, atol=0)


def test_nope_layers_mixed():
    "nope_layers picks the plain layers; the others keep the method, its keyword arguments and its length limit."
    lm = small('xl', n_layers=3, nope_layers=[0, 2], P=40)
    kinds = [type(l.self_attn.module).__name__ for l in lm.layers]
    assert kinds == ['MultiHeadAttention', 'RelativeMultiHeadAttention', 'MultiHeadAttention']
    assert lm.layers[1].self_attn.module.P == 40 and lm.max_keys == 40   # read from the layer that has the method
    assert lm.nope_layers == (0, 2) and 'nope_layers=(0, 2)' in repr(lm)
    randomized(lm)(torch.randint(0, V, (1, 8)))


@pytest.mark.parametrize("bad,match", [((3,), 'nope_layers must hold layer indices'), (1, 'nope_layers must be a tuple'),
                                        ((0, 0), 'nope_layers lists a layer twice'), ((True,), 'nope_layers must hold')])
def test_nope_layers_refused(bad, match):
    with pytest.raises((ValueError, TypeError), match=match): small('rotary', n_layers=3, nope_layers=bad)


@pytest.mark.parametrize("nope", [(0, 1), (1,)])
def test_nope_layers_refused_for_absolute(nope):
    "'absolute' adds its positions to the embeddings: no layer can drop them, so nope_layers is refused (not a pos_embed kept)."
    with pytest.raises(ValueError, match=r"nope_layers=.*position='absolute' adds its positions to the embeddings.*position='none'"):
        small('absolute', nope_layers=nope)


# ---------------------------------------------------------------- dropout, place by place
def dropout_places(lm):
    return {name: m.p for name, m in lm.named_modules() if isinstance(m, torch.nn.Dropout)}


@pytest.mark.parametrize("kw", [dict(ffn='swiglu', parallel_residual=True), dict(memorizing_layers=(1,), mem_len=4)])
def test_dropout_alone_sets_every_place(kw):
    "dropout= alone: the embeddings, both residual branches, the feed-forward hidden features and the attention weights."
    places = dropout_places(small('xl', dropout=0.1, **kw))
    assert len(places) >= 1 + 2 * 3 and set(places.values()) == {0.1}   # embeddings; per layer: attention, residual, feed-forward


@pytest.mark.parametrize("position", ['rotary', 'xl', 'alibi'])
def test_each_dropout_in_its_place(position):
    lm = small(position, dropout=0.05, attention_dropout=0.2, residual_dropout=0.3, ffn_dropout=0.0, memorizing_layers=(1,))
    for name, p in dropout_places(lm).items():
        if name == 'drop' or name.endswith(('layers.0.dropout', 'layers.1.dropout')): want = 0.3      # residual stream
        elif '.feed_forward.' in name: want = 0.0
        else: want = 0.2                                           # attention weights, the kNN layer's included
        assert p == want, (name, p)
    lm = small(position, dropout=0.1, attention_dropout=0.0)       # the others default to dropout
    assert {n: p for n, p in dropout_places(lm).items() if '.self_attn.' in n} == {f'layers.{i}.self_attn.module.dropout': 0.0 for i in range(2)}
    assert lm.drop.p == 0.1 and lm.layers[0].feed_forward.dropout.p == 0.1


def test_attention_dropout_only_is_the_only_randomness():
    "Training mode, attention_dropout only, attention outputs zeroed: nothing else drops, the logits are those of eval mode."
    lm = randomized(small('rotary', attention_dropout=0.5))
    with torch.no_grad():
        for layer in lm.layers: layer.self_attn.module.output.weight.zero_(); layer.self_attn.module.output.bias.zero_()
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    want = lm.eval()(x)[0]
    lm.train()
    for _ in range(3): torch.testing.assert_close(lm(x)[0], want, rtol=0, atol=0)
    lm = randomized(small('rotary', attention_dropout=0.5))
    assert not torch.equal(lm(x)[0], lm(x)[0])   # with the outputs left as they are, the attention weights do drop


@pytest.mark.parametrize("arg", ['dropout', 'attention_dropout', 'residual_dropout', 'ffn_dropout'])
@pytest.mark.parametrize("bad", [1.0, -0.1, True, '0.1'])
def test_bad_dropout_refused_by_name(arg, bad):
    with pytest.raises(ValueError, match=f"{arg} must be a float in \\[0, 1\\)"): small('rotary', **{arg: bad})


# ---------------------------------------------------------------- reliability (issue 27)
def test_generate_restores_every_submodule_mode():
    "A frozen (eval) submodule stays in eval and the rest in train after generate, also when generate raises."
    lm = small('xl', max_len=16, dropout=0.1)
    lm.train(); lm.layers[0].eval(); lm.norm.eval()
    modes = {name: m.training for name, m in lm.named_modules()}
    lm.generate(torch.zeros(1, 3, dtype=torch.long), 2)
    assert {name: m.training for name, m in lm.named_modules()} == modes
    def fail(*_): raise RuntimeError("boom")
    hook = lm.layers[1].feed_forward.register_forward_pre_hook(fail)   # run by the cached and the uncached path
    for use_cache in (True, False):
        with pytest.raises(RuntimeError, match='boom'): lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, use_cache=use_cache)
        assert {name: m.training for name, m in lm.named_modules()} == modes
    hook.remove()


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_generate_tiny_temperature_is_greedy(temperature):
    "logits / temperature overflows in float32; the greedy limit is what comes out, not a multinomial error."
    lm = randomized(small('xl', max_len=16)).eval()
    prompt = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(3))
    want = lm.generate(prompt, 8, temperature=0)
    got = lm.generate(prompt, 8, temperature=temperature, generator=torch.Generator().manual_seed(4))
    assert torch.equal(got, want)
    got = lm.generate(prompt, 8, temperature=temperature, top_k=3, generator=torch.Generator().manual_seed(4))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8, torch.uint16, torch.uint32])
def test_small_integer_token_dtypes(dtype):
    "Token ids in any integer dtype give the logits and generations of the same ids as torch.long."
    lm = randomized(small('xl', max_len=16, mem_len=4)).eval()
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, want_mem = lm(ids)
        got, got_mem = lm(ids.to(dtype))
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_mem, want_mem))
        assert torch.equal(lm(ids.to(dtype), want_mem)[0], lm(ids, want_mem)[0])
    out = lm.generate(ids.to(dtype), 3, temperature=0)
    assert out.dtype == torch.long and torch.equal(out, lm.generate(ids, 3, temperature=0))
    if dtype == torch.uint8:   # a wide unsigned id is still refused by name
        with pytest.raises(ValueError, match=r'tokens must be ids in \[0, n_vocab=13\), got values in \[200, 200\]'):
            lm(torch.full((1, 2), 200, dtype=dtype))
        with pytest.raises(ValueError, match='prompt'): lm.generate(torch.full((1, 2), 200, dtype=dtype), 2)


class _Float32OnlyMemory(KNNMemory):
    "A kNN memory that, like FaissKNNMemory, refuses to become anything but float32 (checked before it moves)."
    def _apply(self, fn, *args, **kwargs):
        probe = fn(self.keys[:0])
        if probe.dtype != torch.float32: raise TypeError(f"_Float32OnlyMemory holds float32; it cannot become {probe.dtype}")
        return super()._apply(fn, *args, **kwargs)


def _faiss_memory():
    pytest.importorskip('faiss')
    from relpos.memorizing import FaissKNNMemory
    return FaissKNNMemory


@pytest.mark.parametrize("memory_class", [lambda: _Float32OnlyMemory, _faiss_memory], ids=['float32-only', 'faiss'])
@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.bfloat16),
                                     lambda m: m.to(dtype=torch.float64)])
def test_refused_dtype_conversion_leaves_model_unchanged(convert, memory_class):
    "A kNN memory that refuses a conversion refuses it before any layer (before or after it) has been converted."
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=3, max_len=8, mem_len=8, memorizing_layers=(1,), knn_capacity=16,
                   top_k=2, knn_memory=memory_class()).eval()
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): _, memory = lm(x, doc_start=torch.ones(2, dtype=torch.bool))
    twin = copy.deepcopy(lm)
    with pytest.raises((TypeError, ValueError), match='float32'): convert(lm)
    for (name, a), b in zip(lm.state_dict().items(), twin.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert lm.memorizing[0].memory.dtype == torch.float32
    with torch.no_grad(): torch.testing.assert_close(lm(x, memory)[0], twin(x, memory)[0], rtol=0, atol=0)
    lm.release_knn_memory(); lm.double()                     # without a memory held, the conversion goes through
    assert all(p.dtype == torch.float64 for p in lm.parameters())

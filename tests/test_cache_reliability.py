"""relpos.cache where a user could get a wrong number without an error: a call that fails partway, padding between a
row's tokens, the reference `full_logits` with padding, empty batches, copies and pickles of a cache, parameters edited
through `.data`, and rotary scalings whose frequencies change with the length. Float64 models, tolerance 1e-10."""
import copy, io, pickle
import pytest
import torch
from relpos.models import POSITIONS
from relpos.cache import full_logits
from test_cache import small, tokens, err, state, same_state, V, TOL


class Boom(Exception): pass


def boom(*args): raise Boom("a hook in a later layer")


def cache_equals(a, b):
    "Every buffer and counter of two caches (the layers' keys and values included) is the same."
    return same_state(state(a), state(b)) and a.positions.shape == b.positions.shape


# ---------------------------------------------------------------- a call that fails partway
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("where", ['feed_forward', 'generator'])
def test_a_failed_call_leaves_the_cache_as_it_was(position, n, where):
    """Window 4 after 6 tokens (the ring has wrapped): a call that raises in layer 1's feed-forward block (or in the head)
    leaves every buffer as it was; retried, it gives the logits of a copy that never saw it, and of the full model."""
    lm, seq = small(position), tokens(2, 14, 3)
    with torch.no_grad():
        cache = lm.new_cache(2, 4)
        lm(seq[:, :6], cache=cache)
        untouched = copy.deepcopy(cache)
        hook = (lm.layers[1].feed_forward if where == 'feed_forward' else lm.generator).register_forward_hook(boom)
        with pytest.raises(Boom): lm(seq[:, 6:6 + n], cache=cache)
        hook.remove()
        assert cache_equals(cache, untouched)
        got = torch.cat([lm(seq[:, 6:6 + n], cache=cache)[0], lm(seq[:, 6 + n:7 + n], cache=cache)[0]], 1)
        want = torch.cat([lm(seq[:, 6:6 + n], cache=untouched)[0], lm(seq[:, 6 + n:7 + n], cache=untouched)[0]], 1)
        assert err(got, want) <= TOL
        assert err(got, full_logits(lm, seq[:, :7 + n], max_cache_len=4)[:, 6:]) <= TOL


@pytest.mark.parametrize("position", ['rotary', 'alibi', 'xl', 'shaw'])
def test_other_calls_after_a_failed_one(position):
    """A decode that fails (KeyboardInterrupt, a document reset in the same call), then a different chunk of three tokens: the
    full model's logits; a failed first call (the prefill) leaves the cache empty."""
    lm, seq = small(position), tokens(2, 12, 4)
    with torch.no_grad():
        cache = lm.new_cache(2, 4)
        lm(seq[:, :6], cache=cache)
        before = state(cache)

        def interrupt(*args): raise KeyboardInterrupt
        hook = lm.layers[1].feed_forward.register_forward_hook(interrupt)
        with pytest.raises(KeyboardInterrupt): lm(seq[:, 6:7] + 1, cache=cache, doc_start=torch.tensor([False, True]))
        hook.remove()
        assert same_state(before, state(cache))
        got = lm(seq[:, 6:9], cache=cache)[0]
        assert err(got, full_logits(lm, seq[:, :9], max_cache_len=4)[:, 6:]) <= TOL

        fresh = lm.new_cache(2, 4)
        hook = lm.layers[0].feed_forward.register_forward_hook(boom)
        with pytest.raises(Boom): lm(seq[:, :5], cache=fresh)
        hook.remove()
        assert fresh.seen == 0 and not fresh.valid.any() and (fresh.times == -1).all()
        assert err(lm(seq[:, :5], cache=fresh)[0], full_logits(lm, seq[:, :5], max_cache_len=4)) <= TOL


# ---------------------------------------------------------------- padding between a row's tokens
GAP = [1, 1, 1, 1, 0, 0, 0, 1, 1, 1]


def gapped_batch(seed=4):
    "Row 0 has padding between its tokens, row 1 is left-padded, row 2 has none; each row's tokens and the mask."
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([GAP, [0, 0, 0] + [1] * 7, [1] * 10])
    seq = torch.randint(0, V, (3, 10), generator=g)
    return seq, mask


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("window", [None, 6])
def test_padding_between_tokens(position, window):
    """A prompt with a gap (`1 1 1 1 0 0 0 1 1 1`), then four tokens one at a time: every real token's logits equal the
    full model's over the same rows (positions count tokens only); without a window, those of each row's tokens alone."""
    lm, (prompt, mask) = small(position), gapped_batch()
    new = tokens(3, 4, 5)
    with torch.no_grad():
        cache = lm.new_cache(3, window or 14)
        got = torch.cat([lm(prompt, cache=cache, attention_mask=mask)[0]]
                        + [lm(new[:, t:t + 1], cache=cache)[0] for t in range(4)], 1)
        whole, whole_mask = torch.cat([prompt, new], 1), torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], 1)
        want = full_logits(lm, whole, whole_mask, max_cache_len=window)
        keep = whole_mask.bool()
        assert err(got[keep], want[keep]) <= TOL
        assert torch.isnan(want[~keep]).all()
        if window is None:
            for r in range(3):
                assert err(got[r, keep[r]], full_logits(lm, whole[r:r + 1, keep[r]])[0]) <= TOL


@pytest.mark.parametrize("position", POSITIONS)
def test_padding_between_tokens_after_a_cache(position):
    "Several tokens after a cache, with padding between them: the tokens' logits equal the row without the padding."
    lm, seq = small(position), tokens(2, 12, 6)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 6:8] = 0
    with torch.no_grad():
        cache = lm.new_cache(2, 12)
        got = torch.cat([lm(seq[:, :4], cache=cache)[0], lm(seq[:, 4:10], cache=cache, attention_mask=mask[:, 4:10])[0],
                         lm(seq[:, 10:], cache=cache)[0]], 1)
        keep = mask[0].bool()
        assert err(got[0, keep], full_logits(lm, seq[:1, keep])[0]) <= TOL
        assert err(got[1], full_logits(lm, seq[1:])[0]) <= TOL


# ---------------------------------------------------------------- full_logits: the positions the cache uses
@pytest.mark.parametrize("position", POSITIONS)
def test_full_logits_counts_positions_over_tokens(position):
    """A left-padded row through `full_logits` gives the row alone's logits: FIRE too, whose bias depends on the query's
    position (init_L=4: positions past its threshold), and the cache gives the same."""
    lm = small(position, **(dict(init_L=4.0) if position == 'fire' else {}))
    row = tokens(1, 9, 1)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], 1)
    mask = torch.tensor([[0] * 3 + [1] * 9])
    with torch.no_grad():
        want = full_logits(lm, row)[0]
        ref = full_logits(lm, padded, mask)[0]
        assert err(ref[3:], want) <= TOL and torch.isnan(ref[:3]).all()
        cache = lm.new_cache(1, 12)
        got = torch.cat([lm(padded[:, :7], cache=cache, attention_mask=mask[:, :7])[0]]
                        + [lm(padded[:, t:t + 1], cache=cache)[0] for t in range(7, 12)], 1)[0]
        assert err(got[3:], ref[3:]) <= TOL


# ---------------------------------------------------------------- empty inputs
@pytest.mark.parametrize("position", POSITIONS)
def test_empty_batches_and_sequences(position):
    "Batch 0 through every kind of cached call and generate, and 0 tokens through the model: empty results of the right shape."
    lm = small(position)
    empty = torch.zeros(0, 3, dtype=torch.long)
    with torch.no_grad():
        cache = lm.new_cache(0, 4)
        assert lm(empty, cache=cache)[0].shape == (0, 3, V)                         # prefill
        assert lm(empty[:, :1], cache=cache)[0].shape == (0, 1, V)                  # decode
        assert lm(empty, cache=cache)[0].shape == (0, 3, V) and cache.seen == 7     # extend across the ring's wrap
        assert lm(empty, cache=lm.new_cache(0, 4), attention_mask=empty)[0].shape == (0, 3, V)
        assert lm(torch.zeros(2, 0, dtype=torch.long))[0].shape == (2, 0, V)
        assert lm(torch.zeros(2, 0, dtype=torch.long), cache=lm.new_cache(2, 4))[0].shape == (2, 0, V)
        assert full_logits(lm, empty).shape == (0, 3, V) and full_logits(lm, empty, empty).shape == (0, 3, V)
    for use_cache in (True, False):
        out = lm.generate(empty, 4, use_cache=use_cache)
        assert out.shape == (0, 7) and out.dtype == torch.long


# ---------------------------------------------------------------- copies, pickles, parameters edited in place
@pytest.mark.parametrize("position", POSITIONS)
def test_pickled_cache_continues_where_it_was(position):
    "A cache through pickle and torch.save decodes on as the original does; a model with other parameters refuses it."
    lm, seq = small(position), tokens(2, 10, 7)
    with torch.no_grad():
        cache = lm.new_cache(2, 4)
        lm(seq[:, :6], cache=cache)
        buf = io.BytesIO(); torch.save(cache, buf); buf.seek(0)
        copies = [pickle.loads(pickle.dumps(cache)), torch.load(buf, weights_only=False)]
        assert all(same_state(state(c), state(cache)) for c in copies)
        want = torch.cat([lm(seq[:, t:t + 1], cache=cache)[0] for t in range(6, 10)], 1)
        for c in copies:
            got = torch.cat([lm(seq[:, t:t + 1], cache=c)[0] for t in range(6, 10)], 1)
            assert err(got, want) <= TOL
        other = small(position)
        with torch.no_grad(): other.generator.bias.add_(1.0)
        stranger = pickle.loads(pickle.dumps(copies[0]))
        before = state(stranger)
        with pytest.raises(ValueError, match='other parameters'): other(seq[:, :1], cache=stranger)
        assert same_state(before, state(stranger))
        with pytest.raises(ValueError, match='another model'): other(seq[:, :1], cache=copies[0])   # adopted by lm


def test_deepcopy_forks_a_cache():
    "A copy decodes on its own: the original is unaffected, and copying a model with its cache gives a pair that works."
    lm, seq = small('xl_paper'), tokens(2, 9, 8)
    with torch.no_grad():
        cache = lm.new_cache(2, 6)
        lm(seq[:, :5], cache=cache)
        fork = copy.deepcopy(cache)
        a = lm(seq[:, 5:6], cache=fork)[0]
        b = lm(seq[:, 5:6] + 1, cache=cache)[0]
        assert err(a, full_logits(lm, seq[:, :6], max_cache_len=6)[:, -1:]) <= TOL
        assert err(b, full_logits(lm, torch.cat([seq[:, :5], seq[:, 5:6] + 1], 1), max_cache_len=6)[:, -1:]) <= TOL
        lm2, cache2 = copy.deepcopy((lm, cache))
        assert err(lm2(seq[:, 6:7], cache=cache2)[0], lm(seq[:, 6:7], cache=cache)[0]) <= TOL


@pytest.mark.parametrize("position", ['t5', 'fourier', 'xl_paper', 'xl', 'alibi'])
@pytest.mark.parametrize("how", ['data', 'assign', 'no_grad'])
def test_parameter_edits_reach_the_cached_bias(position, how):
    """The last layer's position parameters edited through `.data`, by assigning `.data`, or in place under no_grad: the next
    step's logits are the full model's (the cached keys and values of the last layer do not depend on them)."""
    lm, seq = small(position), tokens(1, 8, 2)
    with torch.no_grad():
        cache = lm.new_cache(1, 8)
        lm(seq[:, :6], cache=cache); lm(seq[:, 6:7], cache=cache)
        for name, p in lm.layers[-1].self_attn.module.named_parameters():
            if name in ('v', 'key_pos_embeddings', 'key_pos_bias') or name.startswith(('positions.', 'pos_linear.')):
                if how == 'data': p.data.mul_(1.5)
                elif how == 'assign': p.data = p.data * 1.5
                else: p.mul_(1.5)
        got = lm(seq[:, 7:8], cache=cache)[0]
        assert err(got[:, -1], full_logits(lm, seq)[:, -1]) <= TOL


# ---------------------------------------------------------------- rotary scalings at the length where they switch
M, ORIGINAL = 32, 12
ROPE = {
    'default': dict(rope_type='default'),
    'linear': dict(rope_type='linear', factor=2.0),
    'dynamic': dict(rope_type='dynamic', factor=2.0),
    'yarn': dict(rope_type='yarn', factor=2.0, original_max_position_embeddings=ORIGINAL),
    'longrope': dict(rope_type='longrope', short_factor=[1.0, 1.5, 2.0, 3.0], long_factor=[1.2, 2.0, 4.0, 8.0],
                     original_max_position_embeddings=ORIGINAL),
    'llama3': dict(rope_type='llama3', factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
}
EXACT = {'dynamic': M, 'longrope': ORIGINAL}   # what 09a states: beyond these lengths the frequencies change


def rope_decode_error(lm, total):
    seq = tokens(2, total, 1)
    with torch.no_grad():
        cache = lm.new_cache(2, total)
        got = torch.cat([lm(seq[:, :4], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(4, total)], 1)
        return err(got, full_logits(lm, seq))


@pytest.mark.parametrize("kind", list(ROPE))
def test_rope_scaling_cache_is_exact_up_to_its_switch(kind):
    """Each rope type decoded with the cache equals the full model up to `cache_exact_len()` tokens and, for `dynamic` and
    `longrope`, differs one token later (the limit is where their frequencies change); the others have no limit."""
    lm = small('rotary', rope_scaling=ROPE[kind], max_position_embeddings=M)
    limit = lm.layers[0].self_attn.module.cache_exact_len()
    assert limit == EXACT.get(kind)
    for total in (ORIGINAL, ORIGINAL + 1, M, M + 1):
        e = rope_decode_error(lm, total)
        if limit is None or total <= limit: assert e <= TOL, (kind, total, e)
        else: assert e > 1e-4, (kind, total, e)

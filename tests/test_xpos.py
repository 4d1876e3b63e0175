"Tests of `relpos.xpos` that would clutter the chapter: x-transformers parity (float64, values and gradients), fast == readable (hypothesis), gradcheck, causality, compile, dtypes, state, errors."
from functools import partial
import copy, math
import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.mha import MultiHeadAttention
from relpos.rotary import rotary_cos_sin, rotary_inv_freq
from relpos.xpos import xpos_zeta, xpos_scale, apply_xpos, XPosMultiHeadAttention
from mha_module_checks import (rel_err, run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_state_dict_is_plain_mha_and_round_trips, check_dropout_training_path_runs)
from mha_module_checks import perturbed_lm as _lm, decode_through_cache as _decode, check_left_padded_decoding

try:
    from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb, Attention
    NO_XT = None
except ImportError as e:
    NO_XT = f"x-transformers (the dev-only reference for xPos) cannot be imported: {e}"
needs_xt = pytest.mark.skipif(NO_XT is not None, reason=NO_XT or "")


def xt_rotary(dim, scale_base, base=10000.0):
    "x-transformers' RotaryEmbedding(use_xpos=True), its float32 buffers rebuilt in float64 by its own formulas."
    rot = RotaryEmbedding(dim, use_xpos=True, scale_base=scale_base, base=base).double()
    rot.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rot.scale = (torch.arange(0, dim, 2, dtype=torch.float64) + 0.4 * dim) / (1.4 * dim)
    return rot


@pytest.fixture
def float64_default():
    "x-transformers divides integer positions by scale_base in the default dtype: float64 for the float64 comparisons."
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ---------------------------------------------------------------- x-transformers
@needs_xt
@pytest.mark.parametrize('positions', [torch.arange(13), torch.arange(5, 40, 3), torch.tensor([[0, 1, 2, 2, 3, 9], [0, 4, 5, 6, 7, 8]])])
@pytest.mark.parametrize('dim,scale_base', [(8, 16.0), (16, 512.0), (32, 7.5)])
def test_scale_equals_x_transformers(dim, scale_base, positions, float64_default):
    freqs, scale = xt_rotary(dim, scale_base)(positions)
    ours = xpos_scale(positions, dim, scale_base, interleaved=True, dtype=torch.float64)
    torch.testing.assert_close(ours.reshape(scale.shape), scale, rtol=1e-14, atol=0)
    cos, _ = rotary_cos_sin(positions.double()[..., None] * rotary_inv_freq(dim, dtype=torch.float64), interleaved=True)
    torch.testing.assert_close(cos.reshape(freqs.shape), freqs.cos(), rtol=1e-14, atol=1e-15)


@needs_xt
@pytest.mark.parametrize('rot_dim', [8, 4])
def test_apply_equals_x_transformers_values_and_gradients(rot_dim, float64_default):
    "Queries scaled by sigma and keys by 1/sigma, partial rotation included: values and the gradients of q and k, float64."
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 11, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    pos = torch.arange(11)
    freqs, scale = xt_rotary(rot_dim, 4.0)(pos)
    want = apply_rotary_pos_emb(q, freqs, scale), apply_rotary_pos_emb(k, freqs, scale ** -1.0)
    cos, sin = rotary_cos_sin(pos.double()[:, None] * rotary_inv_freq(rot_dim, dtype=torch.float64), interleaved=True)
    ours_scale = xpos_scale(pos, rot_dim, 4.0, dtype=torch.float64)
    got = apply_xpos(q, cos, sin, ours_scale), apply_xpos(k, cos, sin, 1 / ours_scale)
    g = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want): torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    ga = torch.autograd.grad(got, (q, k), g)
    gb = torch.autograd.grad(want, (q, k), g)
    for a, b in zip(ga, gb): torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def _copy_from_x_transformers(ours, ref):
    with torch.no_grad():
        for mine, theirs in [(ours.query.linear, ref.to_q), (ours.key.linear, ref.to_k), (ours.value.linear, ref.to_v),
                             (ours.output, ref.to_out)]:
            mine.weight.copy_(theirs.weight)
        ours.value.linear.bias.zero_(); ours.output.bias.zero_()


@needs_xt
@pytest.mark.parametrize('need_weights', [False, True])
@pytest.mark.parametrize('mem,rot_dim', [(0, 8), (5, 8), (0, 4), (3, 4)])
def test_layer_equals_x_transformers_attention(mem, rot_dim, need_weights, float64_default):
    "XPosMultiHeadAttention == x-transformers' Attention(causal=True) with RotaryEmbedding(use_xpos=True), float64 (its softmax too): output and the gradients of the input, the memory and every weight; with memory keys and partial rotation."
    torch.manual_seed(0)
    ref = Attention(dim=32, heads=4, dim_head=8, causal=True).double()
    ref.attend.attn_fn = partial(torch.softmax, dim=-1)
    ours = XPosMultiHeadAttention(4, 32, dropout_prob=0.0, bias=False, scale_base=8.0, rotary_dim=rot_dim).double()
    _copy_from_x_transformers(ours, ref)
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    m = torch.randn(2, mem, 32, dtype=torch.float64, requires_grad=True)
    want = ref(x, mem=m if mem else None, rotary_pos_emb=xt_rotary(rot_dim, 8.0)(torch.arange(10 + mem)))
    kv = torch.cat([m, x], 1).transpose(0, 1)
    got = ours(query=x.transpose(0, 1), key=kv, value=kv, need_weights=need_weights).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(got)
    wrt_ours = [x, m, ours.query.linear.weight, ours.key.linear.weight, ours.value.linear.weight, ours.output.weight]
    wrt_ref = [x, m, ref.to_q.weight, ref.to_k.weight, ref.to_v.weight, ref.to_out.weight]
    if not mem: wrt_ours, wrt_ref = wrt_ours[:1] + wrt_ours[2:], wrt_ref[:1] + wrt_ref[2:]
    for a, b in zip(torch.autograd.grad(got, wrt_ours, g), torch.autograd.grad(want, wrt_ref, g)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@needs_xt
def test_layer_equals_x_transformers_float32_as_shipped():
    "Untouched x-transformers (float32 buffers and softmax) against the layer in float32."
    torch.manual_seed(1)
    ref = Attention(dim=64, heads=4, dim_head=16, causal=True)
    ours = XPosMultiHeadAttention(4, 64, dropout_prob=0.0, bias=False)
    _copy_from_x_transformers(ours, ref)
    x = torch.randn(2, 50, 64)
    with torch.no_grad():
        want = ref(x, rotary_pos_emb=RotaryEmbedding(16, use_xpos=True)(torch.arange(50)))
        got = ours(query=x.transpose(0, 1), key=x.transpose(0, 1), value=x.transpose(0, 1)).transpose(0, 1)
    assert rel_err(got, want) <= 1e-5


# ---------------------------------------------------------------- the method
def test_score_decays_per_pair():
    "One pair at a time: the score of q_i and k_j is the rotary term times zeta_f^((i - j)/gamma), for any centre."
    D, gamma = 8, 5.0
    pos = torch.arange(30)
    cos, sin = rotary_cos_sin(pos.double()[:, None] * rotary_inv_freq(D, dtype=torch.float64), interleaved=True)
    scale = xpos_scale(pos, D, gamma, dtype=torch.float64)
    zeta, theta = xpos_zeta(D, torch.float64), rotary_inv_freq(D, dtype=torch.float64)
    for f in range(D // 2):
        e = torch.zeros(D, dtype=torch.float64); e[2 * f] = 1.0
        s = apply_xpos(e, cos, sin, scale) @ apply_xpos(e, cos, sin, 1 / scale).T          # [i, j]
        back = (pos[:, None] - pos[None, :]).double()
        torch.testing.assert_close(s, torch.cos(back * theta[f]) * zeta[f] ** (back / gamma), rtol=1e-12, atol=1e-13)


def test_shifted_positions_give_the_same_layer_output():
    "Only differences of positions matter: ids shifted by a constant give the same output (float64)."
    torch.manual_seed(0)
    layer = XPosMultiHeadAttention(2, 16, dropout_prob=0.0, scale_base=8.0).double()
    x = torch.randn(12, 2, 16, dtype=torch.float64)
    ids = torch.arange(12)
    torch.testing.assert_close(run(layer, x, x, position_ids=ids + 37), run(layer, x, x, position_ids=ids), rtol=1e-11, atol=1e-12)


def test_causal_only():
    "A query's output does not change when the tokens after it change, with and without a caller's mask, with memory keys."
    torch.manual_seed(0)
    layer = XPosMultiHeadAttention(2, 16, dropout_prob=0.0)
    x, kv = torch.randn(6, 2, 16), torch.randn(9, 2, 16)
    kv2 = kv.clone(); kv2[6:] = torch.randn(3, 2, 16)          # keys 6..8: after query 2 (at position 5)
    for mask in [None, torch.ones(1, 9, 2, dtype=torch.bool)]:
        for nw in (False, True):
            a, b = run(layer, x, kv, mask, need_weights=nw), run(layer, x, kv2, mask, need_weights=nw)
            torch.testing.assert_close(a[:3], b[:3])
            assert not torch.allclose(a[3:], b[3:])


def test_centring_keeps_long_sequences_finite():
    "At 50,000 positions (float32) the centred scales are finite; the layer's output too."
    s = xpos_scale(torch.arange(50_000), 64)
    assert s.isfinite().all() and (1 / s).isfinite().all() and s.min() > 0
    layer = XPosMultiHeadAttention(1, 16, dropout_prob=0.0, scale_base=512.0)
    x = torch.randn(50_000, 1, 16)
    with torch.no_grad(): assert run(layer, x[-2:], x).isfinite().all()


# ---------------------------------------------------------------- fast == readable
@settings(max_examples=30, deadline=None)
@given(mask_kind=st.sampled_from(['none', 'padding', 'ids']), nq=st.integers(1, 20), mem=st.integers(0, 9),
       batch=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]), rot=st.sampled_from([None, 2]),
       interleaved=st.booleans(), gqa=st.booleans(), seed=st.integers(0, 10_000))
def test_property_fast_equals_readable(mask_kind, nq, mem, batch, heads, rot, interleaved, gqa, seed):
    "The fast path (default) == the readable path (need_weights=True), float64: output and the gradients of the inputs and every parameter, for padding masks (fully masked rows too), memory keys, position ids, partial rotation, both layouts and grouped-query heads."
    torch.manual_seed(seed)
    layer = XPosMultiHeadAttention(heads, heads * 4, dropout_prob=0.0, scale_base=6.0, rotary_dim=rot,
                                   interleaved=interleaved, kv_heads=1 if gqa else None).double()
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    x, kv = (torch.randn(n, batch, heads * 4, generator=g, dtype=torch.float64) for n in (nq, nk))
    mask = (torch.rand(1 if seed % 2 else nq, nk, batch, generator=g) > 0.4) if mask_kind == 'padding' else None
    ids = None
    if mask_kind == 'ids':   # non-decreasing ids with repeats (a padding gap) and jumps
        ids = torch.randint(0, 3, (batch, nk), generator=g).cumsum(-1)
    w = torch.randn(nq, batch, heads * 4, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (False, True):
        layer.zero_grad()
        xx, kk = x.clone().requires_grad_(), kv.clone().requires_grad_()
        out = layer(query=xx, key=kk, value=kk, mask=mask, position_ids=ids, need_weights=need_weights)
        (out * w).sum().backward()
        res.append([out.detach(), xx.grad, kk.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_fast_path_is_causal_sdpa():
    "Causal self-attention without a mask reaches SDPA with is_causal=True (no mask tensor), after the fast rotation."
    import relpos.mha as mha
    seen = []
    real = mha.F.scaled_dot_product_attention
    def spy(*a, **kw): seen.append((kw.get('is_causal'), kw.get('attn_mask') is None)); return real(*a, **kw)
    layer = XPosMultiHeadAttention(2, 16, dropout_prob=0.0)
    x = torch.randn(8, 2, 16)
    orig = mha.F.scaled_dot_product_attention
    mha.F.scaled_dot_product_attention = spy
    try: run(layer, x, x)
    finally: mha.F.scaled_dot_product_attention = orig
    assert seen == [(True, True)]


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize('kw', [{}, {'rotary_dim': 2}, {'interleaved': False}])
@pytest.mark.parametrize('mem', [0, 3])
def test_gradcheck_layer(kw, mem):
    torch.manual_seed(0)
    layer = XPosMultiHeadAttention(2, 8, dropout_prob=0.0, scale_base=3.0, **kw).double()
    x = torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(4 + mem, 2, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, kv: run(layer, x, kv), (x, kv))
    ids = torch.tensor([0, 2, 3, 3, 5, 6, 9][:4 + mem])
    assert torch.autograd.gradcheck(lambda x, kv: run(layer, x, kv, position_ids=ids), (x, kv))


def test_double_backward_readable():
    "The readable path is differentiable twice (the fused SDPA path refuses create_graph with a clear error)."
    layer = XPosMultiHeadAttention(2, 8, dropout_prob=0.0, scale_base=3.0).double()
    x = torch.randn(4, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: run(layer, x, x, need_weights=True), (x,))


def test_torch_func_grad():
    torch.manual_seed(2)
    layer = XPosMultiHeadAttention(3, 12, dropout_prob=0.0).double()
    q, kv = torch.randn(6, 2, 12, dtype=torch.float64), torch.randn(9, 2, 12, dtype=torch.float64)
    params = dict(layer.named_parameters())
    f = lambda p, q: torch.func.functional_call(layer, p, (), dict(query=q, key=kv, value=kv)).square().sum()
    g = torch.func.grad(f)(params, q)
    expected = torch.autograd.grad(layer(query=q, key=kv, value=kv).square().sum(), list(params.values()))
    for name, e in zip(params, expected): torch.testing.assert_close(g[name], e, rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------- compile, dtypes, state
@pytest.mark.parametrize('need_weights', [False, True])
def test_compile_aot_eager_fullgraph(need_weights):
    m = make()
    x, mem = torch.randn(6, 2, 32), torch.randn(9, 2, 32)
    cm = torch.compile(m, fullgraph=True, backend='aot_eager')
    torch.testing.assert_close(run(cm, x, mem, need_weights=need_weights), run(m, x, mem), rtol=1e-5, atol=1e-6)


def test_compile_inductor_forward_backward():
    torch.manual_seed(0)
    m = XPosMultiHeadAttention(3, 24, dropout_prob=0.0)
    x, mem = torch.randn(5, 2, 24), torch.randn(8, 2, 24)
    out_c = run(torch.compile(m, fullgraph=True), x, mem)
    out_c.sum().backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = run(m, x, mem)
    out.sum().backward()
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, (p.grad for p in m.parameters())): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def make(): return XPosMultiHeadAttention(4, 32, scale_base=16.0).eval()

@pytest.mark.parametrize('need_weights', [False, True])
def test_bf16_module(need_weights): check_bf16_module(make(), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make())
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(XPosMultiHeadAttention(2, 16), 5000)
def test_state_dict_is_plain_mha_and_round_trips(): check_state_dict_is_plain_mha_and_round_trips(make(), make())
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make())


def test_cache_has_hooks_of_its_own():
    "The K/V cache takes the layer through xPos's own hooks (the rotary layer's would drop the decay)."
    from relpos.cache import supports_cache, _definer, _CACHE_HOOKS
    from relpos.xpos import XPosMultiHeadAttention as X
    assert supports_cache(X(2, 16)) and 'cache_attend' in vars(X) and 'cache_prefill_ok' in vars(X)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize('build,error,match', [
    (lambda: XPosMultiHeadAttention(4, 32, scale_base=0), ValueError, r"scale_base must be a finite number > 0.*got 0"),
    (lambda: XPosMultiHeadAttention(4, 32, scale_base=-3.0), ValueError, r"scale_base must be a finite number > 0"),
    (lambda: XPosMultiHeadAttention(4, 32, scale_base=float('nan')), ValueError, r"scale_base must be a finite number > 0"),
    (lambda: XPosMultiHeadAttention(4, 32, scale_base=True), ValueError, r"scale_base must be a finite number > 0.*got True"),
    (lambda: XPosMultiHeadAttention(4, 32, scale_base='512'), ValueError, r"scale_base must be a finite number > 0"),
    (lambda: XPosMultiHeadAttention(4, 32, rotary_dim=3), ValueError, r"rotary_dim must be a positive even int"),
    (lambda: XPosMultiHeadAttention(4, 32, rotary_dim=10), ValueError, r"rotary_dim must be <= d_k"),
    (lambda: xpos_zeta(0), ValueError, r"rotary_dim must be a positive even int"),
    (lambda: xpos_zeta(4.0), TypeError, r"rotary_dim must be an int"),
])
def test_bad_arguments(build, error, match):
    with pytest.raises(error, match=match): build()


def test_bad_calls():
    m = make()
    long, short = torch.randn(9, 3, 32), torch.randn(6, 3, 32)
    with pytest.raises(ValueError, match='key must be at least as long as query'): run(m, long, short)
    with pytest.raises(ValueError, match='position_ids decrease inside what a query sees'):
        run(m, short, short, position_ids=torch.tensor([0, 1, 2, 1, 2, 3]))
    with pytest.raises(ValueError, match=r'position_ids must have shape'): run(m, short, short, position_ids=torch.arange(4))
    with pytest.raises(TypeError, match='position_ids must have an integer dtype'): run(m, short, short, position_ids=torch.arange(6.0))
    with pytest.raises(ValueError, match=r'mask must have shape'): run(m, short, short, torch.ones(6, 5, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r'query has dtype torch.float64'): run(m, short.double(), short.double())


# ---------------------------------------------------------------- DecoderLM(position=...) and the K/V cache
@pytest.mark.parametrize('window', [None, 4])
@pytest.mark.parametrize('kw', [dict(), dict(rotary_dim=4), dict(interleaved=False, kv_heads=1)])
def test_cached_decoding_equals_full_model(kw, window):
    "DecoderLM(position='xpos'): a prompt, then one token at a time, then chunks: the full model's logits (same window), float64 <= 1e-10."
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0, **kw)                    # a short scale base: the decay matters over 16 tokens
    seq = torch.randint(0, 13, (3, 16), generator=torch.Generator().manual_seed(1))
    want = full_logits(lm, seq, max_cache_len=window)
    assert (_decode(lm, seq, 5, window) - want).abs().max() <= 1e-10
    assert (_decode(lm, seq, 3, window, chunks=[4, 1, 6, 2]) - want).abs().max() <= 1e-10


def test_cached_decoding_left_padded():
    "A left-padded prompt: each row's cached logits equal the full model on that row alone."
    check_left_padded_decoding(_lm('xpos', scale_base=4.0))


@pytest.mark.parametrize('kw', [dict(), dict(rotary_dim=4)])
def test_cached_step_scales_once_for_every_layer(monkeypatch, kw):
    """A decode step computes the scale of its query and key once for all layers (it depends on the position ids and the
    anchor alone, not on the layer): one `xpos_scale` call per step, not one per layer; the logits stay the full model's."""
    import relpos.cache
    from relpos.cache import full_logits
    real, calls = relpos.cache.xpos_scale, []
    monkeypatch.setattr(relpos.cache, 'xpos_scale', lambda *a, **k: calls.append(1) or real(*a, **k))
    lm = _lm('xpos', scale_base=4.0, **kw)                         # 2 layers
    seq = torch.randint(0, 13, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = lm.new_cache(2, 10)
    with torch.no_grad():
        got = [lm(seq[:, :4], cache=cache)[0]]
        calls.clear()
        got += [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(4, 10)]   # 6 one-token steps, the anchor kept
    assert len(calls) == 6, len(calls)
    assert (torch.cat(got, 1) - full_logits(lm, seq)).abs().max() <= 1e-10


def test_decoder_lm_position_kwargs():
    from relpos.models import DecoderLM, POSITIONS
    assert 'xpos' in POSITIONS
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='xpos', scale_base=64.0)
    assert lm.layers[0].self_attn.module.scale_base == 64.0
    with pytest.raises(ValueError, match='scale_base must be'): DecoderLM(11, d_model=16, heads=2, position='xpos', scale_base=-1)
    prompt = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(lm.generate(prompt, 6, temperature=0), lm.generate(prompt, 6, temperature=0, use_cache=False))


# ---------------------------------------------------------------- the cache's keys are scaled against an anchor
from torch.utils._python_dispatch import TorchDispatchMode


class _BigResults(TorchDispatchMode):
    "Records every op (views aside) whose result has at least `limit` elements: a pass over the cached keys."
    def __init__(self, limit):
        super().__init__()
        self.limit, self.ops = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rets = func._schema.returns
        if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets): return out   # a view
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit: self.ops.append(str(func))
        return out


@pytest.mark.parametrize('window', [None, 12])
def test_a_decode_step_passes_over_no_cached_key(window):
    """Every op of a decode step is recorded: none makes a result the size of the cached keys (the old centred path
    multiplied all of them by their scales at every step and layer), and the stored keys stay as written, except at the
    steps where the anchor moves (every H + 1 tokens); the logits stay the full model's (float64, 1e-10)."""
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0)                                   # H = 13 tokens between moves of the anchor
    H = lm.layers[0].self_attn.module.cache_anchor_reach()
    assert H == int(math.log(64) * 4.0 / math.log(3.5)) == 13
    b, n, prompt, seen = 2, 60, 8, 20
    seq = torch.randint(0, 13, (b, n), generator=torch.Generator().manual_seed(5))
    cache = lm.new_cache(b, window or n)
    limit = b * 2 * min(seen, window or n) * 8                        # kv_heads 2, d_k 8: the cached keys of `seen` tokens
    got, moved = [], []
    with torch.no_grad():
        got.append(lm(seq[:, :prompt], cache=cache)[0])
        for t in range(prompt, n):
            keys = [K.clone() for K in cache.keys]
            times = [s['time'] for s in cache.layer_state]
            with _BigResults(limit) as rec: got.append(lm(seq[:, t:t + 1], cache=cache)[0])
            move = [s['time'] != u for s, u in zip(cache.layer_state, times)]
            assert all(move) or not any(move)                          # the layers move together (same scale base)
            if move[0]: moved.append(t)
            elif t >= seen:
                assert not rec.ops, (t, rec.ops)
            if not move[0]:                                            # stored keys unchanged but the one slot written
                slot = t % cache.max_cache_len
                for K, old in zip(cache.keys, keys):
                    keep = torch.ones(cache.max_cache_len, dtype=torch.bool); keep[slot] = False
                    assert torch.equal(K[:, :, keep], old[:, :, keep])
    assert moved == list(range(prompt + H, n, H + 1)), moved          # prefill anchors at t = 7; then t = 21, 35, 49
    assert (torch.cat(got, 1) - full_logits(lm, seq, max_cache_len=window)).abs().max() <= 1e-10


@pytest.mark.parametrize('prompt', [8, 600])
def test_long_decoding_stays_in_float_range(prompt):
    """gamma = 8: an anchor kept at 0 would scale key j by zeta_0^(-j/8), past float32's range after 566 tokens; and a
    600-token prompt scaled around its newest position (the old cached path) puts its first query there. Decoded to 750
    tokens, the cache's keys stay finite and the logits equal the full model's: float64 1e-10, float32 close to it."""
    from relpos.cache import full_logits
    assert (1 / xpos_scale(torch.arange(750), 8, 8.0, centre=0)).isinf().any()      # the naive fixed anchor overflows
    lm = _lm('xpos', scale_base=8.0)
    seq = torch.randint(0, 13, (2, 750), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = full_logits(lm, seq)
        assert want.isfinite().all()
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            model = copy.deepcopy(lm).to(dtype)
            cache = model.new_cache(2, 750)
            got = torch.cat([model(seq[:, :prompt], cache=cache)[0]] +
                            [model(seq[:, t:t + 1], cache=cache)[0] for t in range(prompt, 750)], 1)
            assert all(K.isfinite().all() for K in cache.keys)
            assert got.isfinite().all() and (got.double() - want).abs().max() <= tol, (dtype, (got.double() - want).abs().max())


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_decoding_stays_finite(dtype):
    "gamma = 8, 300 tokens: a fixed anchor would leave float16's range after 70. The half-precision cache stays finite, its logits near float64's."
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=8.0)
    seq = torch.randint(0, 13, (2, 300), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = full_logits(lm, seq)
        model = copy.deepcopy(lm).to(dtype)
        cache = model.new_cache(2, 300)
        got = torch.cat([model(seq[:, :8], cache=cache)[0]] + [model(seq[:, t:t + 1], cache=cache)[0] for t in range(8, 300)], 1)
    assert all(K.isfinite().all() for K in cache.keys) and got.isfinite().all()
    assert (got.double() - want).abs().max() < 0.1, (got.double() - want).abs().max()


def test_a_failed_call_that_moved_the_anchor_is_undone():
    """The step that moves the anchor fails in layer 1, after layer 0 rescaled its keys: the cache is as before (keys and
    anchors), and decoding on gives the full model's logits."""
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0)                                   # H = 13: the anchor set at t = 7 moves at t = 21
    seq = torch.randint(0, 13, (2, 30), generator=torch.Generator().manual_seed(8))
    cache = lm.new_cache(2, 10)                                        # a ring of 10: wrapped by then
    with torch.no_grad():
        got = [lm(seq[:, :8], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(8, 21)]
        keys, anchors = [K.clone() for K in cache.keys], [dict(s) for s in cache.layer_state]

        def boom(*a, **k): raise RuntimeError('boom')
        lm.layers[1].self_attn.module.cache_attend = boom
        with pytest.raises(RuntimeError, match='boom'): lm(seq[:, 21:22], cache=cache)
        del lm.layers[1].self_attn.module.cache_attend
        assert all(torch.equal(K, k) for K, k in zip(cache.keys, keys))
        assert all(s['time'] == a['time'] and torch.equal(s['anchor'], a['anchor']) for s, a in zip(cache.layer_state, anchors))
        assert not torch.equal(keys[0], cache.keys[0] * 0) and cache.seen == 21
        got += [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(21, 30)]
    assert (torch.cat(got, 1) - full_logits(lm, seq, max_cache_len=10)).abs().max() <= 1e-10


@pytest.mark.parametrize('how', ['pickle', 'deepcopy'])
def test_a_copied_cache_keeps_its_anchors(how):
    "After two moves of the anchor, a pickled (or deep-copied) cache decodes on as the full model runs."
    import pickle
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0)
    seq = torch.randint(0, 13, (2, 45), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache = lm.new_cache(2, 45)
        got = [lm(seq[:, :8], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(8, 36)]
        assert cache.layer_state[0]['time'] == 35
        copied = pickle.loads(pickle.dumps(cache)) if how == 'pickle' else copy.deepcopy(cache)
        got += [lm(seq[:, t:t + 1], cache=copied)[0] for t in range(36, 45)]
    assert (torch.cat(got, 1) - full_logits(lm, seq)).abs().max() <= 1e-10


def _pickled_before_layer_state(cache):
    "The cache as a relpos before per-layer state would have unpickled it: no `layer_state`, no `resets`."
    import pickle
    state = pickle.loads(pickle.dumps(cache)).__dict__
    state = {k: v for k, v in state.items() if k not in ('layer_state', 'resets')}
    old = object.__new__(type(cache)); old.__setstate__(state)
    return old


def test_a_cache_pickled_before_anchors_is_refused_not_misread():
    "A filled xPos cache from before the anchors (keys unscaled) cannot be read as scaled keys: it is refused, naming the way out."
    lm = _lm('xpos', scale_base=4.0)
    seq = torch.randint(0, 13, (2, 12), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        cache = lm.new_cache(2, 12); lm(seq[:, :8], cache=cache)
        with pytest.raises(ValueError, match='new_cache'): lm(seq[:, 8:9], cache=_pickled_before_layer_state(cache))


@pytest.mark.parametrize('position, filled', [('xpos', 0), ('rotary', 8)])
def test_an_old_cache_that_holds_nothing_xpos_needs_decodes_on(position, filled):
    "An old xPos cache still empty, or an old filled cache of a model without xPos: filled on and decoded, the full model's logits."
    from relpos.cache import full_logits
    lm = _lm(position, **(dict(scale_base=4.0) if position == 'xpos' else {}))
    seq = torch.randint(0, 13, (2, 30), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        cache = lm.new_cache(2, 30)
        got = [lm(seq[:, :filled], cache=cache)[0]] if filled else []
        cache = _pickled_before_layer_state(cache)
        got += [lm(seq[:, filled:12], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(12, 30)]
    assert (torch.cat(got, 1) - full_logits(lm, seq)).abs().max() <= 1e-10


def test_a_reset_row_after_the_anchor_moved():
    "Row 1's document ends at token 30, its anchor far from position 0: from then on it equals the full model on its new document alone."
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0)
    seq = torch.randint(0, 13, (2, 50), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        cache = lm.new_cache(2, 50)
        got = [lm(seq[:, :8], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(8, 30)]
        assert int(cache.layer_state[0]['anchor'][1]) == 21
        got += [lm(seq[:, 30:33], cache=cache, doc_start=torch.tensor([False, True]))[0]]
        got += [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(33, 50)]
    got = torch.cat(got, 1)
    assert (got[0] - full_logits(lm, seq[:1])[0]).abs().max() <= 1e-10
    assert (got[1, 30:] - full_logits(lm, seq[1:, 30:])[0]).abs().max() <= 1e-10


@pytest.mark.parametrize('window', [None, 6])
def test_anchored_cache_with_chunks(window):
    "Chunks of several tokens (those longer than H + 1 attended in blocks) across moves of the anchor, a ring of 6 or none: the full model's logits."
    from relpos.cache import full_logits
    lm = _lm('xpos', scale_base=4.0)                                   # H = 13
    seq = torch.randint(0, 13, (2, 64), generator=torch.Generator().manual_seed(11))
    chunks = [20, 1, 1, 17, 3, 1, 15, 1, 5]                          # 20 and 17: blocks of 14; the rest one at a time
    assert sum(chunks) == 64
    got = _decode(lm, seq, 0, window, chunks=chunks)
    assert (got - full_logits(lm, seq, max_cache_len=window)).abs().max() <= 1e-10

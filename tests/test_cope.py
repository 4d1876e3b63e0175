"Tests of `relpos.cope` that would clutter the chapter: the paper's formula in NumPy (values, and gradients by finite differences, float64), x-transformers' `CoPE` (the position logits and the whole attention, float64), blocked == readable and bounded memory (hypothesis), gradcheck, dtypes, modes, errors, the K/V cache, compile."
import functools
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from relpos.cope import (CoPEMultiHeadAttention, cope_positions, cope_interpolate, cope_attention, cope_attention_blocked)
from mha_module_checks import (run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_dropout_training_path_runs, perturbed_lm, check_left_padded_decoding)
from mha_module_checks import decode_through_cache as _decode

try: import x_transformers.x_transformers as xtr
except ImportError: xtr = None


# ---------------------------------------------------------------- the paper's formula, in NumPy
def numpy_cope(P, heads, xq, xk, mask=None):
    """CoPE by the paper's formula, NumPy float64, from the state dict `P` (NumPy arrays): for query i and each key j it
    may see (j <= i, `mask` [nq, nk, batch] True), the gates g_it = sigmoid(q_i . k_t / sqrt(d_k)) of the keys t in j..i
    it may see, summed: c_ij, clamped to c_max; the embedding vectors interpolated at c_ij; the logit
    q_i . k_j / sqrt(d_k) + q_i . e(c_ij); softmax over those keys. A query that sees no key gives 0."""
    proj = lambda x, n: (x @ P[f'{n}.linear.weight'].T + P.get(f'{n}.linear.bias', 0)).reshape(*x.shape[:-1], heads, -1)
    q, k, v = proj(xq, 'query'), proj(xk, 'key'), proj(xk, 'value')
    E = P['pos_emb']
    c_max, d_k = len(E) - 1, q.shape[-1]
    nq, nk, B = len(xq), len(xk), xq.shape[1]
    sees = lambda i, j, b: mask is None or mask[i if mask.shape[0] > 1 else 0, j, b if mask.shape[2] > 1 else 0]
    out = np.zeros_like(q)
    for i in range(nq):
        ii = i + nk - nq
        for b in range(B):
            js = [j for j in range(ii + 1) if sees(i, j, b)]
            if not js: continue
            for h in range(heads):
                s = {t: q[i, b, h] @ k[t, b, h] / np.sqrt(d_k) for t in js}
                g = {t: 1 / (1 + np.exp(-s[t])) for t in js}
                logits = []
                for j in js:
                    c = min(sum(g[t] for t in js if t >= j), c_max)
                    lo, hi = int(np.floor(c)), int(np.ceil(c))
                    e = (1 - (c - lo)) * E[lo] + (c - lo) * E[hi]
                    logits.append(s[j] + q[i, b, h] @ e)
                w = np.exp(np.array(logits) - max(logits))
                out[i, b, h] = w @ v[js, b, h] / w.sum()
    return out.reshape(nq, B, -1) @ P['output.weight'].T + P['output.bias']


def _layer(heads=2, d=4, seed=0, kv_heads=None, max_pos=5, bias=True, chunk_size=None):
    "A float64 layer whose positions spread over 0 .. c_max (larger keys: gates away from 1/2) and a random `pos_emb`."
    torch.manual_seed(seed)
    layer = CoPEMultiHeadAttention(heads, heads * d, dropout_prob=0.0, kv_heads=kv_heads, max_pos=max_pos, bias=bias,
                                   chunk_size=chunk_size).double()
    with torch.no_grad(): layer.key.linear.weight.mul_(3); layer.pos_emb.normal_()
    return layer


def test_positions_and_interpolation():
    "c_ij sums the gates from j to the end of the row; the logit at an integer is that embedding's exactly, clamped at c_max."
    g = torch.rand(3, 7, dtype=torch.float64)
    c = cope_positions(g)
    for j in range(7): torch.testing.assert_close(c[:, j], g[:, j:].sum(1), rtol=1e-14, atol=1e-14)
    z_int = torch.randn(3, 4, dtype=torch.float64)
    ints = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0]] * 3, dtype=torch.float64)
    assert torch.equal(cope_interpolate(z_int, ints), z_int[:, [0, 1, 2, 3, 3]])
    half = cope_interpolate(z_int, torch.full((3, 1), 1.5, dtype=torch.float64))
    torch.testing.assert_close(half[:, 0], (z_int[:, 1] + z_int[:, 2]) / 2)


@pytest.mark.parametrize('need_weights', [True, False])
@pytest.mark.parametrize('case', ['self', 'memory', 'padding', 'gqa', 'clamped'])
def test_layer_equals_paper_numpy(case, need_weights):
    "Both paths == the paper's formula in NumPy, float64: self-attention, keys longer than queries, a padding mask with a fully masked row, grouped-query heads, counts past c_max."
    layer = _layer(3, 4, seed=1, kv_heads=1 if case == 'gqa' else None, max_pos=2 if case == 'clamped' else 5,
                   chunk_size=2)
    g = torch.Generator().manual_seed(1)
    xk = torch.randn(8, 2, 12, dtype=torch.float64, generator=g)
    xq = xk[3:] if case in ('memory', 'padding') else xk
    mask = None
    if case == 'padding':
        mask = torch.rand(5, 8, 2, generator=g) > 0.3; mask[1, :, 1] = False
    P = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    if case == 'gqa':   # the reference repeats the key/value head for every query head
        for n in ('key', 'value'):
            for s in ('weight', 'bias'): P[f'{n}.linear.{s}'] = np.tile(P[f'{n}.linear.{s}'], (3,) + (1,) * (P[f'{n}.linear.{s}'].ndim - 1))
    ours = layer(query=xq, key=xk, value=xk, mask=mask, need_weights=need_weights)
    want = numpy_cope(P, 3, xq.numpy(), xk.numpy(), None if mask is None else mask.numpy())
    if case == 'padding': want[1, 1] = P['output.bias']   # fully masked row: 0 before the output projection
    np.testing.assert_allclose(ours.detach().numpy(), want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize('need_weights', [True, False])
def test_gradients_equal_numpy_finite_differences(need_weights):
    "d(loss)/d(pos_emb, key weights) by autograd (both paths) == central differences of the NumPy reference."
    layer = _layer(2, 3, seed=2, chunk_size=2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 6, dtype=torch.float64, generator=g)
    w = torch.randn(6, 2, 6, dtype=torch.float64, generator=g)
    layer.zero_grad()
    (layer(query=x, key=x, value=x, need_weights=need_weights) * w).sum().backward()
    P = {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    loss = lambda P: (numpy_cope(P, 2, x.numpy(), x.numpy()) * w.numpy()).sum()
    for name in ('pos_emb', 'key.linear.weight'):
        num = np.zeros_like(P[name])
        for idx in np.ndindex(*P[name].shape):
            h, old = 1e-6, P[name][idx]
            P[name][idx] = old + h; up = loss(P)
            P[name][idx] = old - h; down = loss(P)
            P[name][idx] = old; num[idx] = (up - down) / (2 * h)
        got = dict(layer.named_parameters())[name].grad.numpy()
        np.testing.assert_allclose(got, num, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- x-transformers' CoPE
@pytest.mark.skipif(xtr is None, reason='x-transformers not installed')
def test_position_logits_and_gradient_equal_x_transformers():
    "x-transformers' `CoPE` module on the same queries and scaled, causally masked scores: the same position logits on and below the diagonal, and the same gradients of the queries, scores and embeddings."
    torch.manual_seed(3)
    q = torch.randn(2, 3, 9, 4, dtype=torch.float64, requires_grad=True)
    s = (torch.randn(2, 3, 9, 9, dtype=torch.float64) * 3).requires_grad_()
    ref = xtr.CoPE(dim=4, heads=3, max_pos=6).double()
    with torch.no_grad(): ref.pos_emb.normal_()
    e = ref.pos_emb.detach().clone().requires_grad_()
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    masked = s.masked_fill(~causal, -torch.finfo(s.dtype).max)                 # as x-transformers' Attend masks
    theirs = ref(q, masked)
    ours = cope_interpolate(q @ e.T, cope_positions(torch.sigmoid(s).masked_fill(~causal, 0.0)))
    torch.testing.assert_close(ours[..., causal], theirs[..., causal], rtol=1e-13, atol=1e-13)
    wt = torch.randn_like(ours)
    mine = torch.autograd.grad((ours[..., causal] * wt[..., causal]).sum(), (q, s, e))
    other = torch.autograd.grad((theirs[..., causal] * wt[..., causal]).sum(), (q, s, ref.pos_emb))
    for a, b in zip(mine, other): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(xtr is None, reason='x-transformers not installed')
@pytest.mark.parametrize('need_weights', [True, False])
def test_attention_equals_x_transformers(need_weights):
    "x-transformers' `Attention(causal=True, use_cope=True)` with the same weights (no projection biases), float64: the same outputs, input gradients and `pos_emb` gradients on both paths."
    layer = _layer(3, 4, seed=4, bias=False, chunk_size=3)
    with torch.no_grad(): layer.value.linear.bias.zero_(); layer.output.bias.zero_()
    ref = xtr.Attention(dim=12, dim_head=4, heads=3, causal=True, use_cope=True, cope_max_pos=5).double().eval()
    ref.to_q.weight.data.copy_(layer.query.linear.weight); ref.to_k.weight.data.copy_(layer.key.linear.weight)
    ref.to_v.weight.data.copy_(layer.value.linear.weight); ref.to_out.weight.data.copy_(layer.output.weight)
    ref.attend.cope.pos_emb.data.copy_(layer.pos_emb)
    ref.attend.attn_fn = functools.partial(torch.softmax, dim=-1)   # its softmax computes in float32: float64 here
    x = torch.randn(2, 10, 12, dtype=torch.float64, requires_grad=True)
    theirs = ref(x)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    xs = x.detach().transpose(0, 1).clone().requires_grad_()
    ours = layer(query=xs, key=xs, value=xs, need_weights=need_weights)
    torch.testing.assert_close(ours.transpose(0, 1), theirs, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(theirs)
    (theirs * w).sum().backward(); (ours.transpose(0, 1) * w).sum().backward()
    torch.testing.assert_close(xs.grad.transpose(0, 1), x.grad, rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(layer.pos_emb.grad, ref.attend.cope.pos_emb.grad, rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- blocked path
@settings(max_examples=30, deadline=None)
@given(mask_kind=st.sampled_from(['none', 'causal', 'padding', 'padding+causal']),
       nq=st.integers(1, 16), mem=st.integers(0, 8), batch=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       gqa=st.booleans(), chunk=st.one_of(st.none(), st.integers(1, 7)), seed=st.integers(0, 10_000))
def test_property_blocked_equals_readable(mask_kind, nq, mem, batch, heads, gqa, chunk, seed):
    "The blocked path (default) == the readable path (need_weights=True), float64: output and the gradients of the inputs and every parameter."
    layer = _layer(heads, 4, seed, kv_heads=1 if gqa else None, chunk_size=chunk)
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    x, kv = (torch.randn(n, batch, heads * 4, generator=g, dtype=torch.float64) for n in (nq, nk))
    causal = torch.ones(nq, nk, dtype=torch.bool).tril(mem)[..., None]
    pad = torch.rand(1 if seed % 2 else nq, nk, batch, generator=g) > 0.4
    mask = {'none': None, 'causal': causal, 'padding': pad, 'padding+causal': pad & causal}[mask_kind]
    w = torch.randn(nq, batch, heads * 4, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (False, True):
        layer.zero_grad()
        xx, kk = x.clone().requires_grad_(), kv.clone().requires_grad_()
        out = layer(query=xx, key=kk, value=kk, mask=mask, need_weights=need_weights)
        (out * w).sum().backward()
        res.append([out.detach(), xx.grad, kk.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


class LargestFloat(TorchDispatchMode):
    "The most elements of any floating-point tensor an op returns."
    def __init__(self): super().__init__(); self.most = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.is_floating_point(): self.most = max(self.most, t.numel())
        return out


@settings(max_examples=15, deadline=None)
@given(n=st.integers(40, 160), chunk=st.integers(1, 12), batch=st.integers(1, 2), heads=st.sampled_from([1, 2]),
       seed=st.integers(0, 1000))
def test_property_blocked_memory_does_not_grow_with_n_beyond_the_block(n, chunk, batch, heads, seed):
    "A training step of the blocked path (forward, checkpointed backward) creates no floating-point tensor larger than one block's scores (chunk x n_k x batch x heads) or an n x d_model activation, and gives the readable path's values."
    d_model = 4 * heads
    layer = _layer(heads, 4, seed, chunk_size=chunk).float()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, batch, d_model, generator=g, requires_grad=True)
    with LargestFloat() as seen:
        out = layer(query=x, key=x, value=x)
        out.sum().backward()
    bound = max(chunk * n * batch * heads, 4 * n * batch * d_model)
    assert seen.most <= bound, (seen.most, bound)
    assert seen.most < n * n * batch * heads or chunk * n * batch * heads >= n * n * batch * heads
    torch.testing.assert_close(out, layer(query=x, key=x, value=x, need_weights=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('dropout', [0.0, 0.3])
def test_blocked_path_saves_only_inputs(dropout):
    "With a backward coming, the blocked path keeps no n x n tensor for it: every block is computed again (with dropout: checkpointed blocks)."
    n = 96
    layer = CoPEMultiHeadAttention(2, 16, dropout_prob=dropout, chunk_size=8).train()
    x = torch.randn(n, 1, 16, requires_grad=True)
    sizes = []
    def pack(t): sizes.append(t.numel() if t.is_floating_point() else 0); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(query=x, key=x, value=x).sum().backward()
    assert max(sizes) < n * n, max(sizes)


def test_dropout_blocks_replay_their_masks():
    "With dropout, the checkpointed blocks' gradients are those of the same blocks run without checkpoints (the same dropout masks)."
    layer = _layer(2, 4, seed=10, chunk_size=3)
    layer.dropout.p = 0.4
    layer.train()
    x = torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(11)
    out = layer(query=x, key=x, value=x)
    g1 = torch.autograd.grad(out.square().sum(), (x, layer.pos_emb))
    import relpos.cope as rc
    torch.manual_seed(11)
    q, k, v, see = rc._heads_first(*(t for t in (layer.query(x), layer.key(x), layer.value(x))),
                                   torch.ones(9, 9, dtype=torch.bool).tril()[..., None, None], 2)
    plain = [None] * 9
    for i0, i1, k1 in rc._blocks(9, 9, 3):
        plain[i0] = rc.cope_attention(q[:, :, i0:i1], k[:, :, :k1], v[:, :, :k1], layer.pos_emb, see[..., i0:i1, :k1], layer.scale, 0.4)[0]
    x2 = layer.output(torch.cat([p for p in plain if p is not None], 2).permute(2, 0, 1, 3).reshape(9, 2, 8))
    torch.testing.assert_close(out, x2, rtol=1e-12, atol=1e-12)
    g2 = torch.autograd.grad(x2.square().sum(), (x, layer.pos_emb))
    for a, b in zip(g1, g2): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck_blocked_path():
    "float64 gradcheck of the blocked path on the inputs and pos_emb, keys longer than queries, a padding mask."
    layer = _layer(2, 3, seed=5, chunk_size=2)
    x = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(6, 2, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True, False, True], [True, True, False, True, True, True]]).T[None]
    e = layer.pos_emb.detach().clone().requires_grad_()
    def f(x, kv, e):
        return torch.func.functional_call(layer, {'pos_emb': e}, (), dict(query=x, key=kv, value=kv, mask=mask))
    assert torch.autograd.gradcheck(f, (x, kv, e))


@pytest.mark.parametrize('need_weights', [True, False])
def test_gradgradcheck(need_weights):
    "Second derivatives on both paths (the blocked one through its checkpoints)."
    layer = _layer(2, 3, seed=6, chunk_size=2)
    x = torch.randn(5, 1, 6, dtype=torch.float64, requires_grad=True)
    e = layer.pos_emb.detach().clone().requires_grad_()
    f = lambda x, e: torch.func.functional_call(layer, {'pos_emb': e}, (), dict(query=x, key=x, value=x, need_weights=need_weights))
    assert torch.autograd.gradgradcheck(f, (x, e))


# ---------------------------------------------------------------- dtypes, modes, state
def make():
    torch.manual_seed(0)
    m = CoPEMultiHeadAttention(4, 32).eval()
    with torch.no_grad(): m.pos_emb.normal_()   # zero embeddings would make every check one of plain attention
    return m

@pytest.mark.parametrize('need_weights', [False, True])
def test_bf16_module(need_weights): check_bf16_module(make(), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make())
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(CoPEMultiHeadAttention(2, 16), 5000)
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make())

def test_padding_token_is_not_counted():
    "A key the mask hides from every query is padding: the other tokens get what the row without it gives (both paths)."
    layer = _layer(2, 4, seed=7, chunk_size=3)
    x = torch.randn(9, 1, 8, dtype=torch.float64)
    keep = torch.ones(9, dtype=torch.bool); keep[4] = False
    mask = keep[None, :, None].expand(9, 9, 1)
    for need_weights in (False, True):
        got = layer(query=x, key=x, value=x, mask=mask, need_weights=need_weights)[keep]
        want = layer(query=x[keep], key=x[keep], value=x[keep], need_weights=need_weights)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_functions_take_no_mask():
    "`cope_attention` with `see=None` attends to every key; the blocked function with an all-True causal mask agrees."
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 6, 3, dtype=torch.float64) for _ in range(3))
    e = torch.randn(4, 3, dtype=torch.float64)
    full = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    torch.testing.assert_close(cope_attention(q, k, v, e, None, 0.5)[0], cope_attention(q, k, v, e, full, 0.5)[0])
    causal = full.tril()
    torch.testing.assert_close(cope_attention_blocked(q, k, v, e, causal, 0.5, chunk_size=4),
                               cope_attention(q, k, v, e, causal, 0.5)[0], rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize('kw,error,match', [
    (dict(max_pos=0), ValueError, 'max_pos must be a positive int'),
    (dict(max_pos=2.0), ValueError, 'max_pos must be a positive int'),
    (dict(max_pos=True), ValueError, 'max_pos must be a positive int'),
    (dict(chunk_size=0), ValueError, 'chunk_size must be None'),
    (dict(chunk_size='8'), ValueError, 'chunk_size must be None'),
    (dict(kv_heads=3), ValueError, 'kv_heads must be a positive int'),
])
def test_bad_arguments(kw, error, match):
    with pytest.raises(error, match=match): CoPEMultiHeadAttention(2, 8, **kw)


def test_bad_calls():
    layer = CoPEMultiHeadAttention(2, 8)
    x = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match='key must be at least as long as query'): layer(query=x, key=x[:2], value=x[:2])
    with pytest.raises(TypeError, match='position_ids.*packed_causal_mask'): layer(query=x, key=x, value=x, position_ids=torch.arange(4))
    with pytest.raises(TypeError, match='key has dtype torch.float64'): layer(query=x, key=x.double(), value=x)
    with pytest.raises(ValueError, match='key must have d_model=8'): layer(query=x, key=x[..., :4], value=x)
    with pytest.raises(TypeError, match='key must be a torch.Tensor'): layer(query=x, key=[1], value=x)
    with pytest.raises(TypeError, match='mask must have dtype torch.bool'): layer(query=x, key=x, value=x, mask=torch.ones(4, 4, 1))
    with pytest.raises(ValueError, match=r'mask must have shape'): layer(query=x, key=x, value=x, mask=torch.ones(4, 3, 1, dtype=torch.bool))


# ---------------------------------------------------------------- DecoderLM(position='cope') and the K/V cache
def _lm(**kw): return perturbed_lm('cope', max_pos=6, **kw)   # every parameter perturbed: pos_emb no longer zero


@pytest.mark.parametrize('window', [None, 4])
@pytest.mark.parametrize('kw', [dict(), dict(kv_heads=1)])
def test_cached_decoding_equals_full_model(kw, window):
    "DecoderLM(position='cope'): a prompt, then one token at a time, then chunks (the ring wrapping): the full model's logits (same window), float64 <= 1e-10."
    from relpos.cache import full_logits
    lm = _lm(**kw)
    seq = torch.randint(0, 13, (3, 16), generator=torch.Generator().manual_seed(1))
    want = full_logits(lm, seq, max_cache_len=window)
    assert (_decode(lm, seq, 5, window) - want).abs().max() <= 1e-10
    assert (_decode(lm, seq, 3, window, chunks=[4, 1, 6, 2]) - want).abs().max() <= 1e-10


def test_cached_decoding_left_padded():
    "A left-padded prompt: each row's cached logits equal the full model on that row alone."
    check_left_padded_decoding(_lm())


def test_decoder_lm_position_ids_refused_with_the_way_out():
    lm = _lm()
    with pytest.raises(TypeError, match='packed_causal_mask'): lm(torch.randint(0, 13, (1, 5)), position_ids=torch.arange(5))


def test_decoder_lm_trains_the_embeddings():
    from relpos.models import DecoderLM, POSITIONS, GQA_POSITIONS, KNN_LOCAL_POSITIONS
    assert 'cope' in POSITIONS and 'cope' in GQA_POSITIONS and 'cope' in KNN_LOCAL_POSITIONS
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='cope', kv_heads=1, max_pos=4)
    assert lm.layers[0].self_attn.module.pos_emb.shape == (4, 8)
    logits, _ = lm(torch.randint(0, 11, (2, 40)))
    logits.sum().backward()
    assert lm.layers[0].self_attn.module.pos_emb.grad.abs().sum() > 0


# ---------------------------------------------------------------- compile
@pytest.mark.parametrize('need_weights', [False, True])
def test_compile_aot_eager_fullgraph(need_weights):
    m = make()
    m.chunk_size = 4
    x, mem = torch.randn(6, 2, 32), torch.randn(9, 2, 32)
    mask = torch.rand(6, 9, 2) > 0.2
    cm = torch.compile(m, fullgraph=True, backend='aot_eager')
    for msk in (None, mask):
        torch.testing.assert_close(run(cm, x, mem, msk, need_weights=need_weights), run(m, x, mem, msk), rtol=1e-5, atol=1e-6)


def test_compile_trains():
    "A compiled layer's gradients equal the eager ones (blocks without checkpoints under compile)."
    m = make()
    x = torch.randn(7, 2, 32, requires_grad=True)
    cm = torch.compile(m, fullgraph=True, backend='aot_eager')
    cm(query=x, key=x, value=x).sum().backward()
    want = torch.autograd.grad(m(query=x, key=x, value=x).sum(), m.pos_emb)[0]
    torch.testing.assert_close(m.pos_emb.grad, want, rtol=1e-5, atol=1e-6)


def test_never_the_base_class_fast_path():
    "A CoPE layer whose class lacks CoPE's own `attention_fast` (as in the chapter before its last section) takes the readable path, never plain SDPA without the position term."
    from relpos.mha import MultiHeadAttention
    class Bare(CoPEMultiHeadAttention): attention_fast = MultiHeadAttention.attention_fast
    layer = _layer(2, 4, seed=9)
    bare = Bare(2, 8, dropout_prob=0.0, max_pos=5).double()
    bare.load_state_dict(layer.state_dict())
    x = torch.randn(6, 1, 8, dtype=torch.float64)
    torch.testing.assert_close(bare(query=x, key=x, value=x), layer(query=x, key=x, value=x, need_weights=True))


@pytest.mark.parametrize('kw', [dict(layer_types=['sliding_attention', 'full_attention'], sliding_window=3),
                                dict(layer_types=['chunked_attention', 'full_attention'], attention_chunk_size=4)])
def test_cached_decoding_with_layer_patterns(kw):
    "Per-layer windows narrower than the ring and chunked layers: CoPE counts only the keys each layer sees, cached as in the full model (float64 <= 1e-10)."
    from relpos.cache import full_logits
    lm = _lm(**kw)
    seq = torch.randint(0, 13, (2, 14), generator=torch.Generator().manual_seed(3))
    want = full_logits(lm, seq)
    assert (_decode(lm, seq, 4, None) - want).abs().max() <= 1e-10
    ring = full_logits(lm, seq, max_cache_len=6)                                   # a ring of 6 that wraps
    assert (_decode(lm, seq, 2, 6) - ring).abs().max() <= 1e-10
    assert (_decode(lm, seq, 2, 6, chunks=[3, 1, 5, 3]) - ring).abs().max() <= 1e-10

"Tests of `relpos.kerple` that would clutter the chapter: the paper's formulas in NumPy (values and gradients, float64), the paper's code, fast == readable (hypothesis), gradcheck, compile, the parameters' projection, dtypes, state, errors."
import copy, io, pickle
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import relpos.bias
from relpos.kerple import KERPLE_KERNELS, KerpleBias, KerpleMultiHeadAttention, kerple_log, kerple_power
from mha_module_checks import (rel_err, run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_dropout_training_path_runs)
from mha_module_checks import perturbed_lm as _lm, decode_through_cache as _decode, check_left_padded_decoding


# ---------------------------------------------------------------- the paper's formulas, in NumPy
def numpy_kernel(kernel, r, r1, r2):
    "Bias [heads, *r.shape] and its derivatives in r1 and r2, from the paper's formulas, NumPy float64."
    a = np.abs(r)[None]
    r1, r2 = r1.reshape(-1, *[1] * r.ndim), r2.reshape(-1, *[1] * r.ndim)
    if kernel == 'log':   # -r1 log(1 + r2 |r|)
        return -r1 * np.log(1 + r2 * a), -np.log(1 + r2 * a), -r1 * a / (1 + r2 * a)
    power = a ** r2       # -r1 |r|^r2; d/dr2 |r|^r2 = |r|^r2 log|r| (0 at r = 0)
    dlog = np.where(a > 0, power * np.log(np.where(a > 0, a, 1.0)), 0.0)
    return -r1 * power, -power, -r1 * dlog


def numpy_attention(kernel, q, k, v, r1, r2, scale, mask, g):
    """softmax(q k^T scale + B) v for q [b, h, nq, d], k, v [b, h, nk, d], the last query on the last key, `mask` bool
    [b, nq, nk] (None: all) -- and, for the upstream gradient g, the gradients of q, k, v, r1, r2. NumPy float64."""
    nq, nk = q.shape[2], k.shape[2]
    r = np.arange(nk)[None, :] - (np.arange(nq)[:, None] + nk - nq)                 # j - i
    B, dB1, dB2 = numpy_kernel(kernel, r.astype(float), r1, r2)                      # [h, nq, nk]
    S = np.einsum('bhqd,bhkd->bhqk', q, k) * scale + B[None]
    if mask is not None: S = np.where(mask[:, None], S, -np.inf)
    P = np.exp(S - S.max(-1, keepdims=True)); P /= P.sum(-1, keepdims=True)
    out = P @ v
    dP = g @ v.transpose(0, 1, 3, 2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True))
    dq, dk, dv = scale * dS @ k, scale * dS.transpose(0, 1, 3, 2) @ q, P.transpose(0, 1, 3, 2) @ g
    return out, dq, dk, dv, (dS * dB1[None]).sum((0, 2, 3)), (dS * dB2[None]).sum((0, 2, 3))


def _r1_r2_leaves(kernel, bias_p, bias_a):
    return (bias_p, bias_a) if kernel == 'log' else (bias_a, bias_p)


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_kernels_equal_formulas(kernel):
    rng = np.random.default_rng(0)
    r = np.arange(-40, 41).astype(float)
    r1, r2 = rng.uniform(0.05, 2, 5), rng.uniform(0.05, 2, 5)
    fn = kerple_log if kernel == 'log' else kerple_power
    t1, t2 = (torch.tensor(x[:, None], requires_grad=True) for x in (r1, r2))
    got = fn(torch.tensor(r)[None], t1, t2)
    want, d1, d2 = numpy_kernel(kernel, r, r1, r2)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-13, atol=1e-14)
    w = rng.normal(size=want.shape)
    g1, g2 = torch.autograd.grad(got, (t1, t2), torch.tensor(w))
    np.testing.assert_allclose(g1.numpy()[:, 0], (w * d1).sum(-1), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(g2.numpy()[:, 0], (w * d2).sum(-1), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize('need_weights', [True, False])
@pytest.mark.parametrize('mask_kind', ['none', 'causal', 'padding'])
@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_attention_equals_numpy(kernel, mask_kind, need_weights):
    "The layer's attention (readable and fast path) on given heads == the NumPy reference: output and the gradients of q, k, v, r1, r2, float64, with memory keys."
    rng = np.random.default_rng(1)
    b, h, nq, nk, d = 2, 3, 5, 8, 4
    layer = KerpleMultiHeadAttention(h, h * d, dropout_prob=0.0, kernel=kernel).double()
    with torch.no_grad():
        layer.positions.bias_p.copy_(torch.tensor([0.3, 1.1, 1.9])); layer.positions.bias_a.copy_(torch.tensor([0.05, 0.6, 1.7]))
    q, k, v = (rng.normal(size=(b, h, n, d)) for n in (nq, nk, nk))
    mask = {'none': None, 'causal': np.broadcast_to(np.tril(np.ones((nq, nk), bool), nk - nq), (b, nq, nk)),
            'padding': rng.uniform(size=(b, nq, nk)) > 0.3}[mask_kind]
    if mask is not None: mask = mask.copy(); mask[..., -1] = True      # no fully masked row here (see the chapter for those)
    g = rng.normal(size=(b, h, nq, d))
    want = numpy_attention(kernel, q, k, v, *(t.detach().numpy() for t in layer.positions.r1_r2()), layer.scale, mask, g)
    ql, kl, vl = (torch.tensor(x.transpose(2, 0, 1, 3), requires_grad=True) for x in (q, k, v))   # [seq, b, h, d]
    m = None if mask is None else torch.tensor(mask).permute(1, 2, 0)[..., None]               # [nq, nk, b, 1]
    if need_weights: x = layer.attention_reference(ql, kl, vl, m)[0]
    else: x = layer.attention_fast(ql, kl, vl, m)
    x = x.permute(1, 2, 0, 3)
    r1, r2 = _r1_r2_leaves(kernel, layer.positions.bias_p, layer.positions.bias_a)
    got = torch.autograd.grad(x, (ql, kl, vl, r1, r2), torch.tensor(g))
    np.testing.assert_allclose(x.detach().numpy(), want[0], rtol=1e-11, atol=1e-12)
    for a, w in zip([t.permute(1, 2, 0, 3) for t in got[:3]] + list(got[3:]), want[1:]):
        np.testing.assert_allclose(a.numpy(), w, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- the paper's code
def reference_forward(x, bias_p, bias_a, kernel, eps=1e-2):
    "The forward of ParallelKerpleLog / ParallelKerplePower (chijames/KERPLE, megatron/mpu/layers.py), model parallelism left out."
    seq_len_q, seq_len_k = x.shape[-2], x.shape[-1]
    diff = torch.tril(torch.arange(seq_len_k).view(seq_len_k, 1).repeat(1, seq_len_k) + torch.arange(0, -seq_len_k, -1))
    diff = diff.to(x.dtype)
    if kernel == 'log':
        bias_p.data = bias_p.data.clamp(min=eps)
        bias_a.data = bias_a.data.clamp(min=eps)
        bias = -bias_p * torch.log(1 + bias_a * diff)
    else:
        bias_p.data = bias_p.data.clamp(min=eps, max=2)
        bias = diff.pow(bias_p)
        bias_a.data = bias_a.data.clamp(min=eps)
        bias = -bias * bias_a
    if seq_len_q != seq_len_k:
        bias = bias[:, seq_len_k - 1, :].view(bias.shape[0], 1, bias.shape[2])
    return x + bias


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_equals_reference_code(kernel):
    "Values on every causal pair, the projection of out-of-range parameters, and the parameters' gradients of a causal attention (in range) equal the reference's, float64."
    torch.manual_seed(0)
    layer = KerpleMultiHeadAttention(4, 16, dropout_prob=0.0, kernel=kernel).double()
    start = torch.tensor([-0.5, 0.3, 1.7, 2.5], dtype=torch.float64)
    with torch.no_grad(): layer.positions.bias_p.copy_(start); layer.positions.bias_a.copy_(start.flip(0))
    p, a = (torch.nn.Parameter(t[:, None, None].clone()) for t in (start, start.flip(0)))
    n = 9
    seen = torch.ones(n, n, dtype=torch.bool).tril()
    want = reference_forward(torch.zeros(1, 4, n, n, dtype=torch.float64), p, a, kernel)
    got = layer.position_bias(n, n)
    torch.testing.assert_close(got[..., seen], want[..., seen], rtol=1e-13, atol=1e-14)
    assert torch.equal(layer.positions.bias_p.data, p.data.flatten()) and torch.equal(layer.positions.bias_a.data, a.data.flatten())
    # gradients through a causal attention over the bias, the parameters now in range
    x = torch.randn(n, 2, 16, dtype=torch.float64)
    scores = torch.randn(2, 4, n, n, dtype=torch.float64)
    w = torch.randn(2, 4, n, n, dtype=torch.float64)
    causal = ~seen
    ref = torch.softmax(reference_forward(scores, p, a, kernel).masked_fill(causal, float('-inf')), -1)
    ours = torch.softmax((scores + layer.position_bias(n, n)).masked_fill(causal, float('-inf')), -1)
    torch.testing.assert_close(ours, ref, rtol=1e-13, atol=1e-14)
    gp, ga = torch.autograd.grad((ref * w).sum(), (p, a))
    op, oa = torch.autograd.grad((ours * w).sum(), (layer.positions.bias_p, layer.positions.bias_a))
    torch.testing.assert_close(op, gp.flatten(), rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(oa, ga.flatten(), rtol=1e-11, atol=1e-13)
    # one query against a longer cache: the reference's last row
    torch.testing.assert_close(layer.position_bias(1, n), reference_forward(torch.zeros(1, 4, 1, n, dtype=torch.float64), p, a, kernel))


def test_alibi_is_power_with_exponent_one():
    from relpos.alibi import alibi_slopes, alibi_bias
    kb = KerpleBias(12, 'power', eps=1e-4).double()
    with torch.no_grad(): kb.bias_a.copy_(alibi_slopes(12, torch.float64)); kb.bias_p.fill_(1.0)
    assert torch.equal(kb(7, 11).detach(), alibi_bias(12, 7, 11, bidirectional=True, dtype=torch.float64))


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_kernel_is_conditionally_positive_definite(kernel):
    "For random (r1, r2) in range, c^T K c >= 0 for every c summing to zero (the paper's theorem); power with r2 > 2 is not."
    rng = np.random.default_rng(2)
    N = 48
    m = torch.arange(N, dtype=torch.float64)
    P = torch.eye(N, dtype=torch.float64) - 1 / N
    fn = kerple_log if kernel == 'log' else kerple_power
    for _ in range(20):
        r1 = torch.tensor(rng.uniform(0.01, 3), dtype=torch.float64)
        r2 = torch.tensor(rng.uniform(0.01, 2 if kernel == 'power' else 10), dtype=torch.float64)
        K = fn(m[:, None] - m, r1, r2)
        assert torch.linalg.eigvalsh(P @ K @ P)[0] >= -1e-12 * K.abs().max()
    K = kerple_power(m[:, None] - m, torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.2, dtype=torch.float64))
    assert torch.linalg.eigvalsh(P @ K @ P)[0] < -1e-3 * K.abs().max()


# ---------------------------------------------------------------- fast == readable
def _layer(heads, kernel, seed, kv_heads=None, d=4):
    torch.manual_seed(seed)
    layer = KerpleMultiHeadAttention(heads, heads * d, dropout_prob=0.0, kernel=kernel, kv_heads=kv_heads).double()
    with torch.no_grad():   # spread the numbers over their ranges (power's exponent up to 2)
        layer.positions.bias_p.uniform_(0.05, 2.0); layer.positions.bias_a.uniform_(0.05, 1.5)
    return layer


@settings(max_examples=30, deadline=None)
@given(kernel=st.sampled_from(KERPLE_KERNELS), mask_kind=st.sampled_from(['none', 'causal', 'padding', 'padding+causal', 'ids']),
       nq=st.integers(1, 20), mem=st.integers(0, 9), batch=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       gqa=st.booleans(), seed=st.integers(0, 10_000))
def test_property_fast_equals_readable(kernel, mask_kind, nq, mem, batch, heads, gqa, seed):
    "The fast path (default) == the readable path (need_weights=True), float64: output and the gradients of the inputs and every parameter, for masks incl. padding (fully masked rows too), memory keys longer than queries, position ids and grouped-query heads."
    layer = _layer(heads, kernel, seed, kv_heads=1 if gqa else None)
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    x, kv = (torch.randn(n, batch, heads * 4, generator=g, dtype=torch.float64) for n in (nq, nk))
    causal = torch.ones(nq, nk, dtype=torch.bool).tril(mem)[..., None]
    pad = torch.rand(1 if seed % 2 else nq, nk, batch, generator=g) > 0.4
    ids = None
    if mask_kind == 'ids':   # a gap: positions skip ahead at a random key
        gap = int(torch.randint(0, nk, (1,), generator=g))
        ids = torch.arange(nk) + (torch.arange(nk) >= gap) * 3
    mask = {'none': None, 'causal': causal, 'padding': pad, 'padding+causal': pad & causal, 'ids': causal}[mask_kind]
    w = torch.randn(nq, batch, heads * 4, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (False, True):
        layer.zero_grad()
        xx, kk = x.clone().requires_grad_(), kv.clone().requires_grad_()
        out = layer(query=xx, key=kk, value=kk, mask=mask, position_ids=ids, need_weights=need_weights)
        (out * w).sum().backward()
        res.append([out.detach(), xx.grad, kk.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_fast_path_takes_the_toeplitz_kernel(kernel, monkeypatch):
    "No mask or the causal one: the layer calls `toeplitz_attention` with the distance table (never a built [n, n] bias)."
    import relpos.kerple as kmod
    calls = []
    real = kmod._toeplitz_heads
    monkeypatch.setattr(kmod, '_toeplitz_heads', lambda *a, **kw: calls.append(a[3].shape) or real(*a, **kw))
    layer = _layer(2, kernel, 0)
    x = torch.randn(6, 1, 8, dtype=torch.float64)
    layer(query=x, key=x, value=x)
    layer(query=x, key=x, value=x, mask=torch.ones(6, 6, dtype=torch.bool).tril()[..., None])
    assert calls == [(2, 11), (2, 11)]


def test_no_score_sized_tensor_saved():
    "The causal fast path keeps nothing of n x n elements for backward; the readable path does."
    torch.manual_seed(0)
    n = 256
    layer = KerpleMultiHeadAttention(2, 32, dropout_prob=0.0)
    x = torch.randn(n, 1, 32, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
    sizes = []
    def pack(t): sizes.append(t.numel()); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(query=x, key=x, value=x, mask=mask)
    assert max(sizes) < n * n, max(sizes)
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(query=x, key=x, value=x, mask=mask, need_weights=True)
    assert max(sizes) >= 2 * n * n


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize('mask_kind', ['none', 'causal', 'padding', 'ids'])
@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_gradcheck_layer(kernel, mask_kind):
    "float64 gradcheck of the layer's fast path on the inputs and both raw parameters, on each route (Toeplitz kernel, sdpa_bias)."
    layer = _layer(2, kernel, 0, d=3)
    x = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(6, 2, 6, dtype=torch.float64, requires_grad=True)
    mask = {'none': None, 'causal': torch.ones(4, 6, dtype=torch.bool).tril(2)[..., None],
            'padding': torch.tensor([[True, False, True, True, False, True], [True, True, False, True, True, True]]).T[None],
            'ids': torch.ones(4, 6, dtype=torch.bool).tril(2)[..., None]}[mask_kind]
    ids = torch.tensor([0, 1, 4, 5, 6, 7]) if mask_kind == 'ids' else None
    names = ['positions.bias_p', 'positions.bias_a']
    ps = [dict(layer.named_parameters())[n].detach().clone().requires_grad_() for n in names]
    def f(x, kv, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (),
                                          dict(query=x, key=kv, value=kv, mask=mask, position_ids=ids))
    assert torch.autograd.gradcheck(f, (x, kv, *ps))


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_double_backward_causal(kernel):
    "backward(create_graph=True) through the causal fast path: the same second-order gradients as the readable path."
    layer = _layer(2, kernel, 1)
    q = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[..., None]
    def penalty(need_weights):
        y = layer(query=q, key=q, value=q, mask=mask, need_weights=need_weights)
        (gq,) = torch.autograd.grad(y.square().sum(), q, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (layer.positions.bias_p, layer.positions.bias_a))
    for a, b in zip(penalty(False), penalty(True)): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_torch_func_grad():
    "Under torch.func the fast path takes ordinary ops; the gradients equal plain autograd's."
    layer = _layer(3, 'log', 2)
    q, kv = torch.randn(6, 2, 12, dtype=torch.float64), torch.randn(9, 2, 12, dtype=torch.float64)
    params = dict(layer.named_parameters())
    f = lambda p, q: torch.func.functional_call(layer, p, (), dict(query=q, key=kv, value=kv)).square().sum()
    g = torch.func.grad(f)(params, q)
    expected = torch.autograd.grad(layer(query=q, key=kv, value=kv).square().sum(), list(params.values()))
    for name, e in zip(params, expected): torch.testing.assert_close(g[name], e, rtol=1e-9, atol=1e-12, msg=name)


# ---------------------------------------------------------------- the parameters' projection
def test_projection_after_an_optimiser_step():
    "A step that pushes a raw parameter out of range is undone at the next call (in place, as the reference), and the parameter gets a gradient again."
    torch.manual_seed(0)
    layer = KerpleMultiHeadAttention(2, 8, dropout_prob=0.0, kernel='power')
    x = torch.randn(6, 1, 8)
    with torch.no_grad(): layer.positions.bias_p.copy_(torch.tensor([-3.0, 5.0])); layer.positions.bias_a.copy_(torch.tensor([-1.0, 0.5]))
    layer(query=x, key=x, value=x).sum().backward()
    assert torch.equal(layer.positions.bias_p.data, torch.tensor([0.01, 2.0]))
    assert torch.equal(layer.positions.bias_a.data, torch.tensor([0.01, 0.5]))
    assert (layer.positions.bias_p.grad != 0).all() and (layer.positions.bias_a.grad != 0).all()


def test_init_is_the_reference_one():
    "bias_p ~ U(0, 2) and bias_a ~ U(0, 1) per head, projected once."
    torch.manual_seed(3)
    kb = KerpleBias(4000, 'power')
    p, a = kb.bias_p.detach(), kb.bias_a.detach()
    assert p.min() >= 0.01 and p.max() <= 2 and a.min() >= 0.01 and a.max() <= 1
    assert abs(p.mean() - 1.0) < 0.05 and abs(a.mean() - 0.5) < 0.03


def test_compiled_call_reads_the_clamped_values():
    "Under torch.compile the in-place projection is skipped, the values are the clamped ones all the same."
    layer = KerpleMultiHeadAttention(2, 8, dropout_prob=0.0)
    x = torch.randn(5, 1, 8)
    with torch.no_grad(): layer.positions.bias_p.copy_(torch.tensor([-1.0, 0.7]))
    out_c = torch.compile(layer, backend='aot_eager', fullgraph=True)(query=x, key=x, value=x)
    assert layer.positions.bias_p.tolist()[0] == -1.0           # not projected inside the compiled graph
    out = layer(query=x, key=x, value=x)                        # projected here
    torch.testing.assert_close(out_c, out, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- compile, dtypes, state
@pytest.mark.parametrize('need_weights', [False, True])
@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_compile_aot_eager_fullgraph(kernel, need_weights):
    m = KerpleMultiHeadAttention(4, 32, kernel=kernel).eval()
    x, mem = torch.randn(6, 2, 32), torch.randn(9, 2, 32)
    mask = torch.ones(6, 9, dtype=torch.bool).tril(3)[..., None]
    cm = torch.compile(m, fullgraph=True, backend='aot_eager')
    torch.testing.assert_close(run(cm, x, mem, mask, need_weights=need_weights), run(m, x, mem, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_compile_inductor_forward_backward(kernel):
    torch.manual_seed(0)
    m = KerpleMultiHeadAttention(3, 24, dropout_prob=0.0, kernel=kernel)
    x, mem = torch.randn(5, 2, 24), torch.randn(8, 2, 24)
    mask = torch.ones(5, 8, dtype=torch.bool).tril(3)[..., None]
    out_c = run(torch.compile(m, fullgraph=True), x, mem, mask)
    out_c.sum().backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = run(m, x, mem, mask)
    out.sum().backward()
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, (p.grad for p in m.parameters())): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def make(kernel='log'): return KerpleMultiHeadAttention(4, 32, kernel=kernel).eval()

@pytest.mark.parametrize('need_weights', [False, True])
@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_bf16_module(kernel, need_weights): check_bf16_module(make(kernel), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make('power'))
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(KerpleMultiHeadAttention(2, 16), 5000)
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make())


def test_state_dict_round_trips():
    torch.manual_seed(0)
    m = make('power')
    keys = list(m.state_dict())
    assert keys[-2:] == ['positions.bias_p', 'positions.bias_a'] and m.state_dict()['positions.bias_p'].shape == (4,)
    other = make('power')
    other.load_state_dict(m.state_dict())
    x = torch.randn(5, 2, 32)
    assert torch.equal(run(other, x, x), run(m, x, x))
    buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))): assert torch.equal(run(c, x, x), run(m, x, x))


# ---------------------------------------------------------------- FlexAttention (CUDA's route) on explicit tensors
@pytest.mark.parametrize('nq,nk', [(5, 5), (5, 13), (1, 9)])
@pytest.mark.parametrize('kernel', KERPLE_KERNELS)
def test_score_mod_equals_readable_bias(kernel, nq, nk):
    layer = _layer(4, kernel, 0)
    idx = (torch.arange(2)[:, None, None, None], torch.arange(4)[None, :, None, None],
           torch.arange(nq)[None, None, :, None], torch.arange(nk)[None, None, None, :])
    score = torch.randn(2, 4, nq, nk, dtype=torch.float64)
    got, want = layer.score_mod(nq, nk)(score, *idx), score + layer.position_bias(nq, nk)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g, ps = torch.randn_like(got), list(layer.positions.parameters())
    for a, b in zip(torch.autograd.grad(got, ps, g), torch.autograd.grad(want, ps, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not relpos.bias.flex_available(), reason='FlexAttention needs torch >= 2.5')
def test_flex_route_forward_on_cpu(monkeypatch):
    "The layer's FlexAttention route (CUDA's), through FlexAttention's compiled forward on the CPU, == the readable path."
    monkeypatch.setattr(relpos.bias, '_FLEX_DEVICES', ('cpu',))
    torch.manual_seed(0)
    layer = KerpleMultiHeadAttention(4, 32, dropout_prob=0.0, kernel='power')
    x, kv = torch.randn(5, 2, 32), torch.randn(9, 2, 32)
    pad = torch.ones(1, 9, 2, dtype=torch.bool); pad[:, -3:, 1] = False
    with torch.no_grad():
        for m in [None, torch.ones(5, 9, dtype=torch.bool).tril(4)[..., None], pad]:
            torch.testing.assert_close(run(layer, x, kv, m), run(layer, x, kv, m, need_weights=True), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize('build,error,match', [
    (lambda: KerpleBias(4, 'linear'), ValueError, r"kernel must be one of \('log', 'power'\).*got 'linear'"),
    (lambda: KerpleBias(4, 1), TypeError, r"kernel must be a str.*got int 1"),
    (lambda: KerpleBias(0), ValueError, r"heads must be >= 1, got 0"),
    (lambda: KerpleBias(2.5), TypeError, r"heads must be an int"),
    (lambda: KerpleBias(4, eps=0.0), ValueError, r"eps must be a number in \(0, 2\).*got 0.0"),
    (lambda: KerpleBias(4, eps=2.0), ValueError, r"eps must be a number in \(0, 2\)"),
    (lambda: KerpleBias(4, eps='1e-2'), ValueError, r"eps must be a number"),
    (lambda: KerpleMultiHeadAttention(4, 32, kernel='Power'), ValueError, r"kernel must be one of"),
    (lambda: KerpleMultiHeadAttention(3, 32), ValueError, r"d_model must be a positive int divisible by heads=3"),
])
def test_bad_arguments(build, error, match):
    with pytest.raises(error, match=match): build()


def test_bad_calls():
    m = make()
    long, short = torch.randn(9, 3, 32), torch.randn(6, 3, 32)
    with pytest.raises(ValueError, match='key must be at least as long as query'): run(m, long, short)
    with pytest.raises(ValueError, match=r'position_ids must have shape \[batch or 1, seq_len_k\]'):
        run(m, short, short, position_ids=torch.arange(5))
    with pytest.raises(TypeError, match='position_ids must have an integer dtype'):
        run(m, short, short, position_ids=torch.arange(6.0))
    with pytest.raises(ValueError, match=r'mask must have shape'): run(m, short, short, torch.ones(6, 5, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r'seq_len_k \(3\) must be >= seq_len_q \(4\)'): m.positions.distance_table(4, 3)
    with pytest.raises(TypeError, match='seq_len_q must be an int'): m.positions(2.0, 3)


# ---------------------------------------------------------------- DecoderLM(position=...) and the K/V cache
@pytest.mark.parametrize('window', [None, 4])
@pytest.mark.parametrize('kw', [dict(kernel='log'), dict(kernel='power'), dict(kernel='power', kv_heads=1)])
def test_cached_decoding_equals_full_model(kw, window):
    "DecoderLM(position='kerple'): a prompt, then one token at a time, then chunks: the full model's logits (same window), float64 <= 1e-10."
    from relpos.cache import full_logits
    lm = _lm('kerple', **kw)
    with torch.no_grad():
        for p in lm.parameters():
            if p.shape == (2,): p.uniform_(0.05, 1.9)        # r1, r2 of both layers across their ranges
    seq = torch.randint(0, 13, (3, 16), generator=torch.Generator().manual_seed(1))
    want = full_logits(lm, seq, max_cache_len=window)
    assert (_decode(lm, seq, 5, window) - want).abs().max() <= 1e-10
    assert (_decode(lm, seq, 3, window, chunks=[4, 1, 6, 2]) - want).abs().max() <= 1e-10


def test_cached_decoding_left_padded():
    "A left-padded prompt: each row's cached logits equal the full model on that row alone."
    check_left_padded_decoding(_lm('kerple', kernel='power'))


def test_decoder_lm_position_kwargs():
    from relpos.models import DecoderLM, POSITIONS
    assert 'kerple' in POSITIONS
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='kerple', kernel='power')
    assert lm.layers[0].self_attn.module.positions.kernel == 'power'
    with pytest.raises(ValueError, match='kernel must be one of'): DecoderLM(11, d_model=16, heads=2, position='kerple', kernel='exp')
    logits, _ = lm(torch.randint(0, 11, (2, 40)))
    logits.sum().backward()
    assert lm.layers[0].self_attn.module.positions.bias_p.grad is not None

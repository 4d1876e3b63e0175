"Tests of `relpos.t5` that would clutter the chapter: transformers parity, fast == readable (hypothesis), gradcheck, torch.func, compile, bf16, state."
import math
import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.t5 import (relative_position_bucket, T5RelativeBias, T5MultiHeadAttention, toeplitz, toeplitz_attention,
                       _toeplitz_attention_reference)

try:
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention
    _NO_TRANSFORMERS = None
except ImportError as e:  # a dev dependency: without it the parity tests are skipped, never passed
    _NO_TRANSFORMERS = f"transformers (the reference, a dev dependency) cannot be imported: {e}"
needs_transformers = pytest.mark.skipif(_NO_TRANSFORMERS is not None, reason=_NO_TRANSFORMERS or "")


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def t5_attention(heads, decoder, num_buckets=32, max_distance=128, d_kv=4, seed=0):
    "A random transformers T5Attention with a position table; nothing downloaded."
    torch.manual_seed(seed)
    cfg = T5Config(d_model=heads * d_kv, d_kv=d_kv, num_heads=heads, relative_attention_num_buckets=num_buckets,
                   relative_attention_max_distance=max_distance, is_decoder=decoder, dropout_rate=0.0)
    ref = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).eval()
    torch.nn.init.normal_(ref.relative_attention_bias.weight)
    return ref.requires_grad_(False)


SETTINGS = [(32, 128), (64, 256), (8, 20), (6, 4), (12, 1000), (4, 3)]


# ---------------------------------------------------------------- parity with transformers
@needs_transformers
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("num_buckets, max_distance", SETTINGS)
def test_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    if bidirectional and (num_buckets % 2 or max_distance <= num_buckets // 4): pytest.skip("refused settings")
    r = torch.arange(-5000, 5001)
    expected = T5Attention._relative_position_bucket(r, bidirectional, num_buckets, max_distance)
    assert torch.equal(relative_position_bucket(r, bidirectional, num_buckets, max_distance), expected)
    assert torch.equal(relative_position_bucket(r.int().view(73, 137)[:, :99], bidirectional, num_buckets, max_distance),
                       expected.view(73, 137)[:, :99])   # any integer dtype and shape


@needs_transformers
@settings(max_examples=40, deadline=None)
@given(r=st.lists(st.integers(-10**6, 10**6), min_size=1, max_size=50), bidirectional=st.booleans(),
       setting=st.sampled_from(SETTINGS))
def test_buckets_match_transformers_property(r, bidirectional, setting):
    nb, md = setting
    if bidirectional and (nb % 2 or md <= nb // 4): return
    r = torch.tensor(r)
    assert torch.equal(relative_position_bucket(r, bidirectional, nb, md),
                       T5Attention._relative_position_bucket(r, bidirectional, nb, md))


@needs_transformers
@pytest.mark.parametrize("heads", [1, 3, 5, 8])
@pytest.mark.parametrize("decoder", [True, False])
@pytest.mark.parametrize("nq, nk, offset", [(7, 7, None), (1, 200, None), (13, 300, None), (6, 10, 0), (5, 9, 50)])
def test_checkpoint_bias_matches_compute_bias(heads, decoder, nq, nk, offset):
    ref = t5_attention(heads, decoder)
    ours = T5RelativeBias(heads, bidirectional=not decoder)
    state = {k: v for k, v in ref.state_dict().items() if k.startswith('relative_attention_bias.')}
    assert list(state) == ['relative_attention_bias.weight']
    ours.load_state_dict(state)                       # strict: the checkpoint key is the module's key
    expected = ref.compute_bias(nq, nk, past_seen_tokens=nk - nq if offset is None else offset)
    for got in (ours(nq, nk, offset), ours.fast(nq, nk, offset)):
        assert got.shape == expected.shape
        assert rel_err(got, expected) <= 1e-6


@needs_transformers
@pytest.mark.parametrize("heads", [3, 4])
@pytest.mark.parametrize("decoder", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_layer_matches_t5_attention(heads, decoder, need_weights):
    "A T5Attention's weights (q scaled by sqrt(d_kv): relpos divides by it, T5 does not) give its output."
    ref = t5_attention(heads, decoder, d_kv=8, num_buckets=16, max_distance=40)
    m = T5MultiHeadAttention(heads, heads * 8, dropout_prob=0.0, bias=False, num_buckets=16, max_distance=40,
                             bidirectional=not decoder).eval()
    with torch.no_grad():
        m.query.linear.weight.copy_(ref.q.weight * math.sqrt(8)); m.key.linear.weight.copy_(ref.k.weight)
        m.value.linear.weight.copy_(ref.v.weight); m.value.linear.bias.zero_()
        m.output.weight.copy_(ref.o.weight); m.output.bias.zero_()
        m.positions.relative_attention_bias.weight.copy_(ref.relative_attention_bias.weight)
    torch.manual_seed(1)
    x = torch.randn(2, 90, heads * 8)
    allowed = torch.ones(90, 90, dtype=torch.bool).tril() if decoder else torch.ones(90, 90, dtype=torch.bool)
    additive = torch.zeros(90, 90).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    expected = ref(x, mask=additive)[0]
    xs = x.transpose(0, 1)
    got = m(query=xs, key=xs, value=xs, mask=allowed[..., None] if decoder else None, need_weights=need_weights)
    assert rel_err(got.transpose(0, 1), expected) <= 1e-5


# ---------------------------------------------------------------- fast == readable
def _module(heads, bidirectional, seed=0, d_k=4, **kw):
    torch.manual_seed(seed)
    m = T5MultiHeadAttention(heads, heads * d_k, dropout_prob=0.0, num_buckets=8, max_distance=20,
                             bidirectional=bidirectional, **kw)
    with torch.no_grad(): m.positions.relative_attention_bias.weight.normal_()
    return m


def _fast_and_readable(m, q, kv, mask):
    table = m.positions.relative_attention_bias.weight
    out = []
    for need_weights in (False, True):
        y = m(query=q, key=kv, value=kv, mask=mask, need_weights=need_weights)
        w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
        out.append((y, *torch.autograd.grad((y * w).sum(), (q, kv, table))))
    return out


@settings(max_examples=30, deadline=None)
@given(nq=st.integers(1, 40), extra=st.integers(0, 40), batch=st.integers(1, 3), heads=st.sampled_from([1, 3, 5, 6]),
       bidirectional=st.booleans(), mask_kind=st.sampled_from(['none', 'causal', 'random', 'key_padding']),
       seed=st.integers(0, 100))
def test_fast_equals_readable(nq, extra, batch, heads, bidirectional, mask_kind, seed):
    "In float64, so that a wrong term cannot hide under float32 rounding of small, cancelling gradients."
    nk = nq + extra
    m = _module(heads, bidirectional, seed).double()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(nq, batch, m.heads * m.d_k, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(nk, batch, m.heads * m.d_k, generator=g, dtype=torch.float64, requires_grad=True)
    mask = {'none': None,
            'causal': torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None],
            'random': torch.rand(nq, nk, batch, generator=g) > 0.4,
            'key_padding': torch.rand(1, nk, batch, generator=g) > 0.3}[mask_kind]
    fast, readable = _fast_and_readable(m, q, kv, mask)
    for a, b in zip(fast, readable):
        assert torch.isfinite(a).all()
        # absolute for a gradient that is 0 in exact arithmetic (one key: the softmax ignores the bias), where both
        # paths return rounding noise and a relative error divides by it
        assert rel_err(a, b) <= 1e-10 or (a - b).abs().max() <= 1e-14


def test_fast_equals_readable_many_blocks_and_workers():
    "Large enough for several query blocks, worker threads and the causal column skip."
    torch.manual_seed(0)
    b, h, nq, nk, d = 2, 4, 700, 1100, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    t = torch.randn(h, nq + nk - 1, dtype=torch.float64, requires_grad=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for causal in (False, True):
            fast = toeplitz_attention(q, k, v, t, 0.3, causal)
            ref = _toeplitz_attention_reference(q, k, v, t, 0.3, causal)
            g = torch.randn_like(fast)
            assert rel_err(fast, ref) <= 1e-10
            for a, r in zip(torch.autograd.grad(fast, (q, k, v, t), g), torch.autograd.grad(ref, (q, k, v, t), g)):
                assert rel_err(a, r) <= 1e-10
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_exp_sees_no_input_that_underflows(dtype):
    "A steeply falling bias (KERPLE's power kernel, ALiBi far off) puts most scores far below 0: the backward's exp, whose"
    " slow path takes the inputs below log(smallest normal), sees none of them (they are 0 already, -inf going in), and"
    " the gradients still equal the reference's."
    from torch.utils._python_dispatch import TorchDispatchMode
    tiny = math.log(torch.finfo(dtype).tiny)
    seen = []
    class ExpInputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.exp_.default, torch.ops.aten.exp.default):
                x = args[0]; seen.append(x[torch.isfinite(x)].min().item() if torch.isfinite(x).any() else math.inf)
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    h, n, d = 2, 40, 8
    q, k, v = (torch.randn(1, h, n, d, dtype=dtype, requires_grad=True) for _ in range(3))
    r = torch.arange(-(n - 1), n, dtype=dtype).abs()
    t = (-r * torch.tensor([[20.0], [60.0]], dtype=dtype)).requires_grad_()   # down to -780 and -2340 (float64 underflows below -708)
    for causal in (False, True):
        fast = toeplitz_attention(q, k, v, t, 0.3, causal)
        g = torch.randn_like(fast)
        seen.clear()
        with ExpInputs(): grads = torch.autograd.grad(fast, (q, k, v, t), g)
        assert seen and min(seen) >= tiny, (min(seen), tiny)
        ref = _toeplitz_attention_reference(q, k, v, t, 0.3, causal)
        tol = 1e-5 if dtype == torch.float32 else 1e-10   # absolute: near one-hot weights leave q's gradient at rounding level
        for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v, t), g)):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_distance_bias_shape_checked():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="distance_bias"):
        toeplitz_attention(q, q, q, torch.randn(2, 4), 1.0)


# ---------------------------------------------------------------- gradients of every order
@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 8, 8))
    t = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    fn = lambda *a: toeplitz_attention(*a, 0.5, causal)
    assert torch.autograd.gradcheck(fn, (q, k, v, t))
    assert torch.autograd.gradgradcheck(fn, (q, k, v, t))


@pytest.mark.parametrize("mask_kind", [None, 'causal', 'random'])
def test_gradcheck_module_float64(mask_kind):
    m = _module(3, bidirectional=mask_kind is None).double()
    torch.manual_seed(1)
    q, kv = torch.randn(4, 2, 12, dtype=torch.float64, requires_grad=True), torch.randn(6, 2, 12, dtype=torch.float64, requires_grad=True)
    mask = {None: None, 'causal': torch.ones(4, 6, dtype=torch.bool).tril(2)[..., None],
            'random': torch.rand(4, 6, 2) > 0.3}[mask_kind]
    table = m.positions.relative_attention_bias.weight
    assert torch.autograd.gradcheck(lambda q, kv: m(query=q, key=kv, value=kv, mask=mask), (q, kv))
    # the table's gradient against finite differences, through the module
    y = m(query=q, key=kv, value=kv, mask=mask)
    w = torch.randn_like(y)
    (grad,) = torch.autograd.grad((y * w).sum(), table)
    eps, fd = 1e-6, torch.zeros_like(table)
    with torch.no_grad():
        for idx in [(0, 0), (1, 2), (5, 1), (7, 0), (3, 2)]:
            table[idx] += eps; up = (m(query=q, key=kv, value=kv, mask=mask) * w).sum()
            table[idx] -= 2 * eps; down = (m(query=q, key=kv, value=kv, mask=mask) * w).sum()
            table[idx] += eps
            assert abs((up - down).item() / (2 * eps) - grad[idx].item()) <= 1e-6 * max(1.0, abs(grad[idx].item()))


def test_torch_func_grad_and_vmap():
    "Under torch.func the fast path takes its readable route; results equal plain autograd's."
    m = _module(3, False).double()
    torch.manual_seed(2)
    q = torch.randn(6, 2, 12, dtype=torch.float64); kv = torch.randn(9, 2, 12, dtype=torch.float64)
    params = dict(m.named_parameters())
    f = lambda p, q: torch.func.functional_call(m, p, (), dict(query=q, key=kv, value=kv)).square().sum()
    g = torch.func.grad(f)(params, q)
    loss = m(query=q, key=kv, value=kv).square().sum()
    expected = torch.autograd.grad(loss, list(params.values()))
    for name, e in zip(params, expected):
        torch.testing.assert_close(g[name], e, rtol=1e-9, atol=1e-12, msg=name)
    batched = torch.func.vmap(lambda q, kv: m(query=q, key=kv, value=kv), in_dims=1, out_dims=1)(q[:, :, None], kv[:, :, None])
    assert rel_err(batched[:, :, 0], m(query=q, key=kv, value=kv)) <= 1e-10


def test_double_backward_through_module():
    m = _module(2, False).double()
    q = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    table = m.positions.relative_attention_bias.weight
    def penalty(need_weights):
        y = m(query=q, key=q, value=q, mask=torch.ones(5, 5, dtype=torch.bool).tril()[..., None], need_weights=need_weights)
        (gq,) = torch.autograd.grad(y.square().sum(), q, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), table)[0]
    assert rel_err(penalty(False), penalty(True)) <= 1e-10


# ---------------------------------------------------------------- compile, dtypes, state
@pytest.mark.parametrize("causal", [False, True])
def test_compile(causal):
    m = _module(3, True)
    q = torch.randn(10, 2, 12, requires_grad=True); kv = torch.randn(14, 2, 12)
    mask = torch.ones(10, 14, dtype=torch.bool).tril(4)[..., None] if causal else None
    compiled = torch.compile(m)
    y = compiled(query=q, key=kv, value=kv, mask=mask)
    (gc,) = torch.autograd.grad(y.sum(), q)
    y0 = m(query=q, key=kv, value=kv, mask=mask)
    (g0,) = torch.autograd.grad(y0.sum(), q)
    assert rel_err(y, y0) <= 1e-5 and rel_err(gc, g0) <= 1e-5


def test_bfloat16():
    m = _module(4, False, d_k=8)
    torch.manual_seed(3)
    q = torch.randn(30, 2, 32); kv = torch.randn(40, 2, 32)
    causal = torch.ones(30, 40, dtype=torch.bool).tril(10)[..., None]
    ref = m(query=q, key=kv, value=kv, mask=causal)
    mb = _module(4, False, d_k=8).to(torch.bfloat16)
    qb = q.bfloat16().requires_grad_()
    y = mb(query=qb, key=kv.bfloat16(), value=kv.bfloat16(), mask=causal)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert torch.isfinite(qb.grad.float()).all() and torch.isfinite(mb.positions.relative_attention_bias.weight.grad.float()).all()
    assert rel_err(y.float(), ref) <= 3e-2
    with torch.autocast('cpu', dtype=torch.bfloat16):
        ya = m(query=q, key=kv, value=kv, mask=causal)
    assert rel_err(ya.float(), ref) <= 3e-2


def test_state_does_not_depend_on_mode():
    with torch.inference_mode(): a = T5MultiHeadAttention(3, 12)
    with torch.no_grad(): b = T5MultiHeadAttention(3, 12)
    c = T5MultiHeadAttention(3, 12).eval()
    keys = list(c.state_dict())
    assert list(a.state_dict()) == list(b.state_dict()) == keys
    assert 'positions.relative_attention_bias.weight' in keys and c.state_dict()['positions.relative_attention_bias.weight'].shape == (32, 3)
    b.load_state_dict(c.state_dict())
    x = torch.randn(5, 1, 12)
    with torch.inference_mode(): y = c(query=x, key=x, value=x)
    assert torch.equal(y, c(query=x, key=x, value=x).detach())


def test_training_learns_a_distance():
    "The bias alone can learn 'copy the value three positions back': a few steps of Adam on the table only."
    torch.manual_seed(0)
    m = T5MultiHeadAttention(1, 8, dropout_prob=0.0, num_buckets=16, max_distance=32)
    for p in m.parameters(): p.requires_grad_(False)
    with torch.no_grad():   # identity projections, zero scores: only the bias can choose the key
        m.query.linear.weight.zero_(); m.key.linear.weight.zero_()
        m.value.linear.weight.copy_(torch.eye(8)); m.value.linear.bias.zero_()
        m.output.weight.copy_(torch.eye(8)); m.output.bias.zero_()
    table = m.positions.relative_attention_bias.weight.requires_grad_(True)
    opt = torch.optim.Adam([table], lr=0.3)
    x = torch.randn(64, 4, 8)
    mask = torch.ones(64, 64, dtype=torch.bool).tril()[..., None]
    for _ in range(60):
        loss = (m(query=x, key=x, value=x, mask=mask)[3:] - x[:-3]).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
    assert loss.item() < 0.05
    assert table[:, 0].argmax().item() == 3   # bucket of distance -3 (exact) holds the largest value

"Tests of `relpos.mha` that would clutter the chapter: parity, gradcheck, compile, low precision, state, training."
import copy, io, pickle
import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.mha import MultiHeadAttention, PrepareForMultiHeadAttention

labml_mha = pytest.importorskip("labml_nn.transformers.mha")


def make(heads=4, d_model=32, seed=0, **kw):
    torch.manual_seed(seed)
    return MultiHeadAttention(heads, d_model, **kw)


def inputs(sq=5, sk=7, b=3, d=32, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, b, d, generator=g, dtype=dtype)
    kv = torch.randn(sk, b, d, generator=g, dtype=dtype)
    mask = torch.rand(sq, sk, b, generator=g) > 0.3
    return q, kv, mask


def run(m, q, kv, mask=None, **kw):
    return m(query=q, key=kv, value=kv, mask=mask, **kw)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- parity with labml_nn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mask_kind", [None, "full", "q1", "b1"])
def test_labml_parity(bias, mask_kind):
    torch.manual_seed(0)
    theirs = labml_mha.MultiHeadAttention(4, 32, bias=bias).eval()
    ours = MultiHeadAttention(4, 32, bias=bias).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    q, kv, mask = inputs(sk=9)
    mask[:, 0] = True  # labml_nn gives NaN for a fully masked row
    mask = {None: None, "full": mask, "q1": mask[:1], "b1": mask[..., :1]}[mask_kind]
    ref = run(theirs, q, kv, mask)
    assert rel_err(run(ours, q, kv, mask), ref) <= 1e-5
    assert rel_err(run(ours, q, kv, mask, need_weights=True), ref) <= 1e-5
    torch.testing.assert_close(ours.attn, theirs.attn, rtol=1e-5, atol=1e-6)


def test_labml_state_dict_keys_and_shapes():
    ours, theirs = make(), labml_mha.MultiHeadAttention(4, 32)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert ours.value.linear.bias is not None and make(bias=False).query.linear.bias is None
    theirs.load_state_dict(ours.state_dict(), strict=True)  # and back


# ---------------------------------------------------------------- fast path == readable path (property)
@settings(max_examples=25, deadline=None)
@given(sq=st.integers(0, 6), sk=st.integers(0, 8), b=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       mask_kind=st.sampled_from([None, "full", "q1", "b1"]), p_mask=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_fast_equals_readable(sq, sk, b, heads, mask_kind, p_mask, seed):
    m = make(heads=heads, d_model=8, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(sq, b, 8, generator=g), torch.randn(sk, b, 8, generator=g)
    mask = torch.rand(sq, sk, b, generator=g) >= p_mask
    mask = {None: None, "full": mask, "q1": mask[:1], "b1": mask[..., :1]}[mask_kind]
    fast, slow = run(m, q, kv, mask), run(m, q, kv, mask, need_weights=True)
    assert fast.isfinite().all() and slow.isfinite().all()
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(sq=st.integers(1, 5), sk=st.integers(2, 8), drop=st.integers(0, 7), seed=st.integers(0, 2**16),
       need_weights=st.booleans())
def test_masking_a_key_equals_removing_it(sq, sk, drop, seed, need_weights):
    drop = drop % sk
    m = make(heads=2, d_model=8, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(sq, 2, 8, generator=g), torch.randn(sk, 2, 8, generator=g)
    mask = torch.ones(1, sk, 1, dtype=torch.bool)
    mask[0, drop] = False
    keep = [j for j in range(sk) if j != drop]
    torch.testing.assert_close(run(m, q, kv, mask, need_weights=need_weights),
                               run(m, q, kv[keep], need_weights=need_weights), rtol=1e-5, atol=1e-6)


def test_fully_masked_rows_finite_with_finite_grads():
    m = make(dropout_prob=0.0)
    q, kv, mask = inputs()
    mask[1] = False
    mask[:, :, 2] = False
    for need_weights in (False, True):
        kv_ = kv.clone().requires_grad_()
        out = run(m, q, kv_, mask, need_weights=need_weights)
        torch.testing.assert_close(out[1], m.output.bias.expand(3, 32))
        torch.testing.assert_close(out[:, 2], m.output.bias.expand(5, 32))
        out.square().sum().backward()
        assert kv_.grad.isfinite().all()
        assert all(p.grad.isfinite().all() for p in m.parameters())
        m.zero_grad()


# ---------------------------------------------------------------- numerics
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gradcheck_float64(need_weights, with_mask):
    m = make(heads=2, d_model=4, dropout_prob=0.0).double()
    q, kv, mask = inputs(sq=3, sk=4, b=2, d=4, dtype=torch.float64)
    mask[0, :, 0] = False  # a fully masked row too
    q.requires_grad_(); kv.requires_grad_()
    f = lambda q, kv: run(m, q, kv, mask if with_mask else None, need_weights=need_weights)
    assert torch.autograd.gradcheck(f, (q, kv))


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_low_precision_forward(dtype, tol, need_weights):
    m = make().eval()
    q, kv, mask = inputs()
    ref = run(m, q, kv, mask)
    low = copy.deepcopy(m).to(dtype)
    out = run(low, q.to(dtype), kv.to(dtype), mask, need_weights=need_weights)
    assert out.dtype == dtype
    assert rel_err(out.float(), ref) <= tol


def test_autocast_bf16():
    m = make().eval()
    q, kv, mask = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(m, q, kv, mask)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), run(m, q, kv, mask)) <= 3e-2


def test_to_float64_matches():
    m = make().eval()
    q, kv, mask = inputs()
    m64 = copy.deepcopy(m).to(torch.float64)
    torch.testing.assert_close(run(m64, q.double(), kv.double(), mask).float(), run(m, q, kv, mask),
                               rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("need_weights", [False, True])
def test_compile_aot_eager_fullgraph(need_weights):
    m = make().eval()
    q, kv, mask = inputs()
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(cm, q, kv, mask, need_weights=need_weights), run(m, q, kv, mask),
                               rtol=1e-5, atol=1e-6)


def test_compile_inductor_forward_backward():
    m = make(dropout_prob=0.0)
    q, kv, mask = inputs()
    cm = torch.compile(m, fullgraph=True)
    out_c = run(cm, q, kv, mask)
    out_c.sum().backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out_e = run(m, q, kv, mask)
    out_e.sum().backward()
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, (p.grad for p in m.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- bad inputs
Q = torch.randn(5, 3, 32)
BAD = {
    "query rank 2": (dict(query=torch.randn(5, 32)), ValueError, "query must have shape"),
    "query rank 4": (dict(query=torch.randn(5, 3, 4, 8)), ValueError, "query must have shape"),
    "key features": (dict(key=torch.randn(5, 3, 16)), ValueError, "key must have d_model=32"),
    "value length": (dict(value=torch.randn(6, 3, 32)), ValueError, "key and value must have the same"),
    "batch mismatch": (dict(key=torch.randn(5, 2, 32), value=torch.randn(5, 2, 32)), ValueError, "same batch size"),
    "int query": (dict(query=torch.ones(5, 3, 32, dtype=torch.long)), TypeError, "query must be a floating-point"),
    "list query": (dict(query=[[0.0]]), TypeError, "query must be a torch.Tensor"),
    "float64 key": (dict(key=Q.double()), TypeError, "key has dtype torch.float64"),
    "float mask": (dict(mask=torch.ones(5, 5, 3)), TypeError, "mask must have dtype torch.bool"),
    "int mask": (dict(mask=torch.ones(5, 5, 3, dtype=torch.int64)), TypeError, "mask must have dtype torch.bool"),
    "mask rank 2": (dict(mask=torch.ones(5, 5, dtype=torch.bool)), ValueError, "mask must have shape"),
    "mask rank 4": (dict(mask=torch.ones(5, 5, 3, 1, dtype=torch.bool)), ValueError, "mask must have shape"),
    "mask seq_k": (dict(mask=torch.ones(5, 4, 3, dtype=torch.bool)), ValueError, "mask must have shape"),
    "mask seq_q": (dict(mask=torch.ones(2, 5, 3, dtype=torch.bool)), ValueError, "mask must have shape"),
    "mask batch": (dict(mask=torch.ones(5, 5, 2, dtype=torch.bool)), ValueError, "mask must have shape"),
    "mask list": (dict(mask=[[True]]), TypeError, "mask must be a bool torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case):
    kw, exc, match = BAD[case]
    m = make()
    with pytest.raises(exc, match=match):
        m(**{"query": Q, "key": Q, "value": Q, **kw})


@pytest.mark.parametrize("args, match", [
    ((3, 32), "d_model must be a positive int divisible by heads=3"),
    ((0, 32), "heads must be a positive int"),
    ((4, 32, 1.5), "dropout_prob must be in"),
])
def test_bad_constructor(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(*args)


def test_positional_call_refused():
    with pytest.raises(TypeError):
        make()(Q, Q, Q)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_nan_inf_query_is_never_hidden(bad, need_weights, with_mask):
    # torch's fused CPU kernel returns 0 for a NaN query row without a mask; the module must not
    m = make().eval()
    q, kv, mask = inputs()
    q[2, 1, 0] = bad
    out = run(m, q, kv, mask if with_mask else None, need_weights=need_weights)
    assert out[2, 1].isnan().all()
    ok = torch.ones(5, 3, dtype=torch.bool); ok[2, 1] = False
    assert out[ok].isfinite().all()   # it stays in its own row


def test_prepare_accepts_labml_layouts():
    p = PrepareForMultiHeadAttention(16, 4, 4, bias=False)
    assert p(torch.randn(5, 3, 16)).shape == (5, 3, 4, 4)
    assert p(torch.randn(3, 16)).shape == (3, 4, 4)
    with pytest.raises(ValueError, match="x must have 16 features"):
        p(torch.randn(3, 15))


# ---------------------------------------------------------------- state
def test_state_dict_deepcopy_pickle_roundtrip():
    m = make().eval()
    q, kv, mask = inputs()
    ref = run(m, q, kv, mask)
    m2 = make(seed=123).eval()
    m2.load_state_dict(m.state_dict(), strict=True)
    torch.testing.assert_close(run(m2, q, kv, mask), ref, rtol=0, atol=0)
    torch.testing.assert_close(run(copy.deepcopy(m), q, kv, mask), ref, rtol=0, atol=0)
    torch.testing.assert_close(run(pickle.loads(pickle.dumps(m)), q, kv, mask), ref, rtol=0, atol=0)
    buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
    m3 = make(seed=7).eval(); m3.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(run(m3, q, kv, mask), ref, rtol=0, atol=0)


def test_determinism_same_seed():
    q, kv, mask = inputs()
    a, b = make(seed=5), make(seed=5)
    torch.manual_seed(0); out_a = run(a, q, kv, mask)   # train mode: dropout uses the global RNG
    torch.manual_seed(0); out_b = run(b, q, kv, mask)
    assert torch.equal(out_a, out_b)
    assert not torch.equal(run(make(seed=6).eval(), q, kv, mask), run(a.eval(), q, kv, mask))


def test_two_optimizer_steps_fast_equals_readable():
    q, kv, mask = inputs()
    target = torch.randn(5, 3, 32)
    losses, params = {}, {}
    for need_weights in (False, True):
        m = make(dropout_prob=0.0)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)  # SGD: Adam would amplify float noise in ~0 gradients
        losses[need_weights] = []
        for _ in range(2):
            opt.zero_grad()
            loss = (run(m, q, kv, mask, need_weights=need_weights) - target).square().mean()
            loss.backward(); opt.step()
            losses[need_weights].append(loss.item())
        params[need_weights] = [p.detach().clone() for p in m.parameters()]
    assert losses[False][1] < losses[False][0]
    assert losses[False] == pytest.approx(losses[True], rel=1e-5)
    for a, b in zip(params[False], params[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_dropout_active_in_training_only():
    m = make(dropout_prob=0.5)
    q, kv, mask = inputs()
    for need_weights in (False, True):
        m.train()
        torch.manual_seed(0); a = run(m, q, kv, mask, need_weights=need_weights)
        torch.manual_seed(1); b = run(m, q, kv, mask, need_weights=need_weights)
        assert not torch.allclose(a, b)
        m.eval()
        assert torch.equal(run(m, q, kv, mask, need_weights=need_weights), run(m, q, kv, mask, need_weights=need_weights))


def test_exactly_causal_mask_reaches_sdpa_as_is_causal(monkeypatch):
    "An exactly causal mask over seq_q == seq_k goes to SDPA as is_causal=True (its kernels skip the masked blocks), with the readable path's numbers; any other mask, or a bias, as a mask."
    import torch.nn.functional as F
    from relpos.mha import MultiHeadAttention
    calls, real = [], F.scaled_dot_product_attention
    def spy(*a, **kw):
        calls.append((kw.get('is_causal', False), kw.get('attn_mask') is not None)); return real(*a, **kw)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
    torch.manual_seed(0)
    m = MultiHeadAttention(4, 32, dropout_prob=0.0)
    x = torch.randn(7, 2, 32, dtype=torch.float64, requires_grad=True); m.double()
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[..., None]
    memory = torch.ones(5, 7, dtype=torch.bool).tril(2)[..., None]      # 5 queries after 2 keys: causal, but not square
    padded = causal & torch.tensor([True] * 6 + [False])[None, :, None]
    for q, mask in [(x, causal), (x, causal.expand(7, 7, 2)), (x[2:], memory), (x, padded)]:
        fast = m(query=q, key=x, value=x, mask=mask)
        ref = m(query=q, key=x, value=x, mask=mask, need_weights=True)
        torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
        g_fast, = torch.autograd.grad(fast.square().sum(), x)
        g_ref, = torch.autograd.grad(ref.square().sum(), x)
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-10, atol=1e-12)
    assert calls == [(True, False), (True, False), (False, True), (False, True)], calls

"Tests of relpos.relative_mha (chapter 02): labml parity, gradients, compile, dtypes, errors, training steps, serialisation."
import copy, io, pickle

import pytest
import torch

import IPython.core.display, IPython.display  # labml 0.4.168 imports names that current IPython moved
IPython.core.display.display, IPython.core.display.HTML = IPython.display.display, IPython.display.HTML
from labml_nn.transformers.xl.relative_mha import RelativeMultiHeadAttention as LabmlRelMHA

from relpos.relative_mha import (RelativeMultiHeadAttention, XLRelativeMultiHeadAttention, TransformerXLModel,
                                 relative_attention, merge_memory)


def randomize(m, seed=0, std=0.5):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters(): p.normal_(0, std)
    return m


def causal(n_q, n_k, batch=1):
    m = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    return m[..., None].expand(n_q, n_k, batch).clone()


def rel_err(a, b): return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize('n_q,n_k', [(5, 5), (5, 9), (1, 7)])
@pytest.mark.parametrize('mask_kind', [None, 'causal', 'random'])
@pytest.mark.parametrize('need_weights', [True, False])
def test_labml_parity(n_q, n_k, mask_kind, need_weights):
    ref = randomize(LabmlRelMHA(4, 32)).eval()
    ours = RelativeMultiHeadAttention(4, 32).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    torch.manual_seed(1)
    x = torch.randn(n_k, 3, 32)
    mask = None
    if mask_kind == 'causal': mask = causal(n_q, n_k)
    if mask_kind == 'random':
        mask = torch.rand(n_q, n_k, 3) > 0.4
        mask[:, -1] = True
    want = ref(query=x[-n_q:], key=x, value=x, mask=mask)
    got = ours(query=x[-n_q:], key=x, value=x, mask=mask, need_weights=need_weights)
    assert rel_err(got, want) <= 1e-5
    if need_weights: torch.testing.assert_close(ours.attn, ref.attn)
    else: assert ours.attn is None


def test_state_dict_keys_and_shapes():
    ref, ours = LabmlRelMHA(8, 64), RelativeMultiHeadAttention(8, 64)
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}
    assert ours.key_pos_embeddings.shape == (2 * 4096, 8, 8) and ours.key_pos_bias.shape == (8192, 8)
    assert RelativeMultiHeadAttention(8, 64, P=32).key_pos_embeddings.shape == (64, 8, 8)


@pytest.mark.parametrize('cls', [RelativeMultiHeadAttention, XLRelativeMultiHeadAttention])
@pytest.mark.parametrize('chunk_size', [None, 3])
def test_gradcheck_float64(cls, chunk_size):
    kw = dict(P=12) if cls is RelativeMultiHeadAttention else {}
    m = randomize(cls(2, 8, dropout_prob=0.0, chunk_size=chunk_size, **kw)).double()
    x = torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True)
    mask = causal(5, 9, 2); mask[1, :, 0] = False          # one fully masked row
    for need_weights in (False, True):
        f = lambda x: m(query=x[-5:], key=x, value=x, mask=mask, need_weights=need_weights)
        assert torch.autograd.gradcheck(f, (x,))
    if chunk_size is None: return
    # gradients of the parameters as well (tables, biases, projections), with several chunks
    params = [p for p in m.parameters()]
    def g(*ps):
        with torch.nn.utils.stateless._reparametrize_module(m, dict(zip([n for n, _ in m.named_parameters()], ps))):
            return m(query=x[-5:], key=x, value=x, mask=mask)
    assert torch.autograd.gradcheck(g, tuple(p.detach().requires_grad_() for p in params))


@pytest.mark.parametrize('recompute', [False, True])
def test_kernel_gradcheck_with_dropout(recompute):
    torch.manual_seed(0)
    b, h, n_q, n_k, d = 2, 2, 4, 6, 3
    t = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    args = (t(b, h, n_q, d), t(b, h, n_q, d), t(b, h, n_k, d), t(b, h, n_k, d), t(h, n_k + n_q, d), t(h, n_k + n_q))
    def f(*a):
        torch.manual_seed(3)  # same keep-mask on every call
        return relative_attention(*a, dropout_p=0.3, chunk_size=3, recompute=recompute)
    assert torch.autograd.gradcheck(f, args)
    torch.manual_seed(3); a = relative_attention(*args, dropout_p=0.3)
    torch.manual_seed(4); b_ = relative_attention(*args, dropout_p=0.3)
    assert not torch.allclose(a, b_)


@pytest.mark.parametrize('cls', [RelativeMultiHeadAttention, XLRelativeMultiHeadAttention])
def test_fast_equals_reference(cls):
    m = randomize(cls(4, 32), std=0.3).eval()
    torch.manual_seed(2)
    x = torch.randn(20, 3, 32, requires_grad=True)
    mask = torch.rand(12, 20, 3) > 0.3; mask[4, :, 2] = False
    outs, grads = [], []
    for kw in [dict(need_weights=True), {}, dict(chunk_size=5), dict(recompute=True), dict(chunk_size=5, recompute=True)]:
        m.chunk_size, m.recompute = kw.pop('chunk_size', None), kw.pop('recompute', False)
        x.grad = None; m.zero_grad()
        out = m(query=x[-12:], key=x, value=x, mask=mask, **kw)
        (out * torch.cos(torch.arange(out.numel()).view_as(out).float())).sum().backward()
        outs.append(out.detach()); grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for o, g in zip(outs[1:], grads[1:]):
        assert rel_err(o, outs[0]) <= 1e-5
        for a, b in zip(g, grads[0]): assert rel_err(a, b) <= 1e-5
    assert torch.isfinite(outs[1]).all()


@pytest.mark.parametrize('cls', [RelativeMultiHeadAttention, XLRelativeMultiHeadAttention])
def test_relative_property(cls):
    kw = dict(P=64) if cls is RelativeMultiHeadAttention else {}
    m = randomize(cls(2, 16, **kw)).eval()
    x, pad = torch.randn(8, 2, 16), torch.randn(11, 2, 16)
    with torch.no_grad():
        s0 = m.get_scores(m.query(x[-5:]), m.key(x))
        s1 = m.get_scores(m.query(x[-5:]), m.key(torch.cat([pad, x])))
    torch.testing.assert_close(s1[:, 11:], s0, rtol=1e-4, atol=1e-4)


def test_length_errors():
    m = RelativeMultiHeadAttention(2, 8, P=16)
    x = torch.randn(17, 1, 8)
    with pytest.raises(ValueError, match=r'key has seq_len 17.*P=16.*P=32'):
        m(query=x[-4:], key=x, value=x)
    with pytest.raises(ValueError, match='key has seq_len 17'):
        m(query=x, key=x, value=x, need_weights=True)
    with pytest.raises(ValueError, match='query is longer than key'):
        m(query=x[:6], key=x[:4], value=x[:4])
    with pytest.raises(ValueError, match='P must be a positive int'):
        RelativeMultiHeadAttention(2, 8, P=0)
    with pytest.raises(ValueError, match='query is longer than key'):
        XLRelativeMultiHeadAttention(2, 8)(query=x[:6], key=x[:4], value=x[:4])
    assert m(query=x[:16], key=x[:16], value=x[:16]).shape == (16, 1, 8)


def test_fully_masked_rows_finite():
    m = randomize(RelativeMultiHeadAttention(2, 8, P=16), std=0.3)
    x = torch.randn(6, 2, 8, requires_grad=True)
    mask = torch.zeros(6, 6, 2, dtype=torch.bool)
    for nw in (False, True):
        out = m(query=x, key=x, value=x, mask=mask, need_weights=nw)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
        torch.testing.assert_close(out, m.output.bias.expand_as(out))
        x.grad = None


def test_torch_compile_aot_eager():
    m = randomize(RelativeMultiHeadAttention(2, 16, P=16), std=0.3).eval()
    x = torch.randn(10, 2, 16, requires_grad=True)
    want = m(query=x[-6:], key=x, value=x)
    cm = torch.compile(m, backend='aot_eager')
    got = cm(query=x[-6:], key=x, value=x)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_torch_compile_inductor_readable():
    m = randomize(RelativeMultiHeadAttention(2, 16, P=16), std=0.3).eval()
    x = torch.randn(10, 2, 16)
    want = m(query=x[-6:], key=x, value=x, need_weights=True)
    got = torch.compile(m)(query=x[-6:], key=x, value=x, need_weights=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('cls', [RelativeMultiHeadAttention, XLRelativeMultiHeadAttention])
def test_bf16_forward_cpu(cls):
    kw = dict(P=32) if cls is RelativeMultiHeadAttention else {}
    m = randomize(cls(4, 32, **kw), std=0.2).eval()
    x = torch.randn(12, 2, 32)
    mask = causal(8, 12)
    want = m(query=x[-8:], key=x, value=x, mask=mask)
    mb = copy.deepcopy(m).to(torch.bfloat16)
    for nw in (False, True):
        got = mb(query=x[-8:].bfloat16(), key=x.bfloat16(), value=x.bfloat16(), mask=mask, need_weights=nw)
        assert got.dtype == torch.bfloat16
        assert rel_err(got.float(), want) < 5e-2


def test_two_optimizer_steps_fast_matches_readable():
    torch.manual_seed(0)
    base = randomize(RelativeMultiHeadAttention(2, 16, dropout_prob=0.0, P=16), std=0.3)
    x, y = torch.randn(12, 3, 16), torch.randn(8, 3, 16)
    mask = causal(8, 12)
    runs = []
    for nw in (False, True):
        m = copy.deepcopy(base)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            loss = ((m(query=x[-8:], key=x, value=x, mask=mask, need_weights=nw) - y) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
        runs.append((losses, m.state_dict()))
    (l0, s0), (l1, s1) = runs
    assert l0[1] < l0[0]
    assert l0 == pytest.approx(l1, rel=1e-5)
    for k in s0: torch.testing.assert_close(s0[k], s1[k], rtol=1e-4, atol=1e-6)
    assert not torch.equal(s0['key_pos_bias'], base.state_dict()['key_pos_bias'])


@pytest.mark.parametrize('cls', [RelativeMultiHeadAttention, XLRelativeMultiHeadAttention])
def test_state_dict_deepcopy_pickle(cls):
    kw = dict(P=16) if cls is RelativeMultiHeadAttention else {}
    m = randomize(cls(2, 8, **kw)).eval()
    x = torch.randn(7, 2, 8)
    want = m(query=x, key=x, value=x)
    m2 = cls(2, 8, **kw).eval(); m2.load_state_dict(m.state_dict(), strict=True)
    buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
    m3 = cls(2, 8, **kw).eval(); m3.load_state_dict(torch.load(buf), strict=True)
    for other in (m2, m3, copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        torch.testing.assert_close(other(query=x, key=x, value=x), want)
    if cls is RelativeMultiHeadAttention: assert pickle.loads(pickle.dumps(m)).P == 16


def test_model_memory_detached_and_truncated():
    torch.manual_seed(0)
    model = TransformerXLModel(10, d_model=16, heads=2, d_ff=32, n_layers=2, mem_len=5, max_seq_len=4)
    mem = None
    for _ in range(3):
        logits, mem = model(torch.randint(10, (4, 3)), mem)
        assert logits.shape == (4, 3, 10)
        assert len(mem) == 2 and all(m.shape == (5 if m is not None else 0, 3, 16) or m.shape[0] <= 5 for m in mem)
        assert not any(m.requires_grad for m in mem)
        logits.sum().backward()
    assert mem[0].shape == (5, 3, 16)
    assert merge_memory(mem, mem, 0) == []
    # memory changes the output: the same segment with and without memory
    x = torch.randint(10, (4, 3))
    assert not torch.allclose(model.eval()(x, mem)[0], model(x, None)[0])


def test_model_input_errors_and_empty_inputs():
    torch.manual_seed(0)
    m = TransformerXLModel(11, d_model=8, heads=2, d_ff=16, n_layers=2, mem_len=4, max_seq_len=6).eval()
    tok = torch.randint(0, 11, (5, 2))
    _, mem = m(tok)
    for fn, match in [(lambda: m(tok.float()), 'x'), (lambda: m(tok[..., None]), 'x'), (lambda: m(tok.tolist()), 'x'),
                      (lambda: m(tok + 11), 'n_vocab=11'), (lambda: m(tok - 11), 'n_vocab=11'),
                      (lambda: m(tok, mem[:1]), 'mem'), (lambda: m(tok, [t[..., :4] for t in mem]), 'mem'),
                      (lambda: m(tok, [t[:, :1] for t in mem]), 'mem'), (lambda: m(torch.randint(0, 11, (4097, 2))), r'TransformerXLModel\(..., P=4097\)')]:
        with pytest.raises((ValueError, TypeError), match=match): fn()
    out, new_mem = m(tok[:0], mem)
    assert out.shape == (0, 2, 11) and all(torch.equal(a, b) for a, b in zip(new_mem, mem))
    assert m(tok[:, :0])[0].shape == (5, 0, 11)


def test_recompute_none_decides_by_size(monkeypatch):
    "The default recompute=None keeps the softmax up to KEEP_SOFTMAX_BYTES and recomputes it beyond; both give the same gradients."
    import relpos.relative_mha as rm
    seen, apply = [], rm._RelativeAttentionFn.apply
    monkeypatch.setattr(rm._RelativeAttentionFn, 'apply', lambda *a: (seen.append(a[-2]), apply(*a))[1])   # a[-2]: recompute
    torch.manual_seed(0)
    m = rm.RelativeMultiHeadAttention(2, 8, 0.0, P=16)
    assert m.recompute is None
    x = torch.randn(6, 2, 8, requires_grad=True)
    grads = []
    for limit in (2**30, 0):   # 6 x 6 scores: kept under the default limit, recomputed under a zero limit
        monkeypatch.setattr(rm, 'KEEP_SOFTMAX_BYTES', limit)
        grads.append(torch.autograd.grad(m(query=x, key=x, value=x).square().sum(), [x] + list(m.parameters())))
    assert seen == [False, True]
    for a, b in zip(*grads): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad(): m(query=x, key=x, value=x)
    assert seen[-1] is True   # nothing to keep without a gradient coming


# ---- blocks that skip masked keys, and the batched (device-generic) path

from hypothesis import given, settings, strategies as st
from mha_module_checks import ops_forward_backward
import relpos.relative_mha as rm


def kernel_args(b, h, n_q, n_k, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()
    return t(b, h, n_q, d), t(b, h, n_q, d), t(b, h, n_k, d), t(b, h, n_k, d), t(h, n_k + n_q, d), t(h, n_k + n_q)


def make_mask(kind, b, n_q, n_k, seed=0):
    "bool [b|1, 1, n_q|1, n_k], True = may attend."
    g = torch.Generator().manual_seed(seed)
    i, j = torch.arange(n_q)[:, None] + n_k - n_q, torch.arange(n_k)[None, :]   # absolute query position, key
    if kind is None: return None
    if kind == 'causal': m = (j <= i)[None, None]
    if kind == 'window': m = ((j <= i) & (j > i - 3))[None, None]
    if kind == 'padding': m = (j < torch.randint(1, n_k + 1, (b, 1, 1, 1), generator=g))[:, :, :1]
    if kind == 'random': m = torch.rand(b, 1, n_q, n_k, generator=g) > 0.5
    if kind == 'causal_empty_row':
        m = (j <= i)[None, None].expand(b, 1, n_q, n_k).clone(); m[0, 0, n_q // 2] = False
    return m


def reference(args, mask):
    qu, qp, k, v, R, S = args
    qpa = torch.cat([qp, torch.ones_like(qp[..., :1])], -1).transpose(0, 1)
    Ra = torch.cat([R, S[..., None]], -1)
    return rm._relative_attention_reference(qu, k, v, qpa, Ra, mask, 0.0, 0)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), n_q=st.integers(1, 12), extra=st.integers(0, 6),
       kind=st.sampled_from([None, 'causal', 'window', 'padding', 'random', 'causal_empty_row']),
       chunk=st.sampled_from([None, 1, 3, 5]), batched=st.booleans(), recompute=st.booleans())
def test_blocks_skip_masked_keys_exactly(b, h, n_q, extra, kind, chunk, batched, recompute):
    "Per head or batched, kept or recomputed softmax, any mask: the blocks give the reference's values and gradients (float64)."
    n_k = n_q + extra
    args, mask = kernel_args(b, h, n_q, n_k, 4), make_mask(kind, b, n_q, n_k)
    g = torch.randn(b, h, n_q, 4, dtype=torch.float64)
    want = reference(args, mask)
    got = relative_attention(*args, mask=mask, chunk_size=chunk, batched=batched, recompute=recompute)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, w in zip(torch.autograd.grad(got, args, g), torch.autograd.grad(want, args, g)):
        torch.testing.assert_close(a, w, rtol=1e-9, atol=1e-11)


def test_causal_blocks_visit_about_half_the_scores(monkeypatch):
    "Under a causal mask the blocks compute about n^2/2 + n c/2 scores, not n^2 (this fails if skipping is removed)."
    seen, scores = [], rm._block_scores
    monkeypatch.setattr(rm, '_block_scores', lambda qu, kT, *a, **k: (seen.append(qu.shape[-2] * kT.shape[-1]), scores(qu, kT, *a, **k))[1])
    n, c = 64, 8
    args = kernel_args(1, 1, n, n, 4)
    relative_attention(*args, mask=make_mask('causal', 1, n, n), chunk_size=c, recompute=True).sum().backward()
    assert sum(seen) == 2 * (n * n // 2 + n * c // 2)            # forward and recomputing backward
    seen.clear()
    relative_attention(*args, chunk_size=c, recompute=True).sum().backward()
    assert sum(seen) == 2 * n * n                                # no mask: every key


@pytest.mark.parametrize('batched', [True, False])
def test_ops_per_call_do_not_grow_with_batch_and_heads(batched):
    "The batched path (the default off CPU) dispatches as many ops for batch 3 x 5 heads as for 2 x 2; the per-head path does not."
    counts = [ops_forward_backward(lambda: relative_attention(*kernel_args(b, h, 24, 24, 4, dtype=torch.float32),
                                                             mask=make_mask('causal', b, 24, 24), chunk_size=8,
                                                             batched=batched, recompute=True))
              for b, h in [(2, 2), (3, 5)]]
    if batched: assert counts[0] == counts[1], counts
    else: assert counts[1][0] > 3 * counts[0][0], counts     # a loop over batch x heads


@pytest.mark.parametrize('batched', [True, False])
def test_dropout_reproducible_and_double_backward_consistent(batched):
    "With dropout, the blocks' backward and the differentiable reference (create_graph=True) see the same keep-masks."
    args, mask = kernel_args(2, 2, 7, 9, 3), make_mask('causal', 2, 7, 9)
    def f(*a):
        torch.manual_seed(3)
        return relative_attention(*a, mask=mask, dropout_p=0.3, chunk_size=3, batched=batched)
    assert torch.autograd.gradcheck(f, args)
    g = torch.randn(2, 2, 7, 3, dtype=torch.float64)
    plain = torch.autograd.grad(f(*args), args, g)
    graph = torch.autograd.grad(f(*args), args, g, create_graph=True)
    for a, b in zip(plain, graph): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(f, args)


def test_module_batched_path_equals_per_head(monkeypatch):
    "The modules on the batched path (forced on CPU) give the per-head path's outputs and gradients."
    m = randomize(XLRelativeMultiHeadAttention(4, 32, dropout_prob=0.0), std=0.3)
    x = torch.randn(16, 3, 32, requires_grad=True)
    mask = causal(10, 16, 3)
    results = []
    for batched in (False, True):
        monkeypatch.setattr(rm, 'relative_attention', lambda *a, _f=relative_attention, _b=batched, **k: _f(*a, batched=_b, **k))
        x.grad = None; m.zero_grad()
        out = m(query=x[-10:], key=x, value=x, mask=mask)
        out.square().sum().backward()
        results.append([out.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*results): assert rel_err(a, b) <= 1e-5


def test_block_softmax_and_logsumexp():
    "The blocks' softmax (torch's fused kernel, lse from the largest weight) against softmax and logsumexp, with masked entries and rows."
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 2e-6)):
        s = (torch.randn(2, 3, 7, 11, generator=g, dtype=dtype) * 20)
        s[0, 1, 2, 3:] = float('-inf'); s[1, 2, 4] = float('-inf')          # a partly and a fully masked row
        p, lse = rm._softmax(s.clone(), masked=True, want_lse=True)
        ok = s.isfinite().any(-1)
        torch.testing.assert_close(p[ok], s[ok].softmax(-1), rtol=0, atol=tol)
        torch.testing.assert_close(lse[ok], s[ok].logsumexp(-1), rtol=tol, atol=0)
        assert (p[~ok] == 0).all() and (lse[~ok] == float('inf')).all()
        assert torch.exp(s - lse[..., None])[~ok].eq(0).all()               # what the recomputing backward relies on
        out = torch.empty_like(s)
        p2, none = rm._softmax(s, out=out, masked=True)
        assert p2.data_ptr() == out.data_ptr() and none is None and torch.equal(p2, p)

"""relpos.shaw against seed 002 (tests/seed_shaw.py, verbatim), its fast path against its readable path, and the
claims of chapter 03 that need more room than a notebook cell: property tests, full gradcheck, compile, dtypes."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import seed_shaw as seed
from relpos.shaw import (RelativePosition, RelationAwareAttentionHead, RelationAwareMultiHeadAttention,
                         relation_aware_attention, relative_buckets)


def rel_err(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def reference(q, k, v, w_k, w_v, scale, keep=None):
    "The readable formulas with `[n_q, n_k, d]` tables (last query aligned with the last key)."
    idx = relative_buckets(q.shape[2], k.shape[2], w_k.shape[0] // 2, k.shape[2] - q.shape[2])
    s = (q @ k.transpose(-1, -2) + torch.einsum('bhid,ijd->bhij', q, w_k[idx])) * scale
    if keep is not None: s = s.masked_fill(~keep, -1e9)
    p = s.softmax(-1)
    return p @ v + torch.einsum('bhij,ijd->bhid', p, w_v[idx])


# ---------------------------------------------------------------- the seed's numbers
@pytest.mark.parametrize("hidden, heads, k, n", [(768, 8, 4, 20), (64, 4, 0, 7), (48, 3, 30, 9)])
def test_same_seed_same_parameters_and_outputs_as_the_seed(hidden, heads, k, n):
    torch.manual_seed(0); theirs = seed.RelationAwareMultiHeadAttention(hidden, heads, k, n)
    torch.manual_seed(0); ours = RelationAwareMultiHeadAttention(hidden, heads, k, n)
    for name in ['query_weights', 'key_weights', 'value_weights']:
        for p in ['weight', 'bias']:
            fused = torch.cat([getattr(getattr(h, name), p) for h in theirs.attention_heads])
            assert torch.equal(getattr(getattr(ours, name), p), fused), f"{name}.{p}"
    for name in ['relative_position_k', 'relative_position_v']:
        assert torch.equal(getattr(ours, name).position_embeddings, getattr(theirs, name).position_embeddings)
    assert torch.equal(ours.fc.weight, theirs.fc.weight)
    x = torch.rand(4, n, hidden)
    mask = torch.ones(4, n); mask[1, n // 2:] = 0; mask[2] = 0
    for m in [None, mask, mask.bool(), mask.long()]:
        ref = theirs(x, x, x, mask=m)
        for need_weights in [False, True]:
            assert rel_err(ours(x, x, x, mask=m, need_weights=need_weights), ref) <= 1e-5


def test_seed_checkpoint_loads_strict_and_keys_are_converted():
    torch.manual_seed(3); theirs = seed.RelationAwareMultiHeadAttention(32, 4, 3, 10)
    ours = RelationAwareMultiHeadAttention(32, 4, 3)
    result = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    x = torch.randn(2, 10, 32); mask = torch.ones(2, 10); mask[0, 7:] = 0
    assert rel_err(ours(x, x, x, mask=mask), theirs(x, x, x, mask=mask)) <= 1e-5
    # relpos's own state_dict round-trips, and it has the DESIGN.md keys
    assert list(ours.state_dict()) == ['relative_position_k.position_embeddings', 'relative_position_v.position_embeddings',
                                       'query_weights.weight', 'query_weights.bias', 'key_weights.weight', 'key_weights.bias',
                                       'value_weights.weight', 'value_weights.bias', 'fc.weight', 'fc.bias']
    with pytest.raises(ValueError, match="holds attention_heads \\[0, 1, 2, 3\\] but this module has num_heads=2"):
        RelationAwareMultiHeadAttention(32, 2, 3).load_state_dict(theirs.state_dict())
    partial = {k: v for k, v in theirs.state_dict().items() if not k.startswith('attention_heads.3.')}
    with pytest.raises(ValueError, match="num_heads=4"):
        ours.load_state_dict(partial)


def test_relative_position_and_head_are_the_seeds():
    torch.manual_seed(0); theirs = seed.RelativePosition(8, 3)
    torch.manual_seed(0); ours = RelativePosition(8, 3)
    assert torch.equal(ours.position_embeddings, theirs.position_embeddings)
    for lq, lk in [(5, 5), (3, 9), (9, 3), (0, 4), (1, 1)]:
        assert torch.equal(ours(lq, lk), theirs(lq, lk))
    torch.manual_seed(1); a_k, a_v = ours(6, 6), ours(6, 6) * 2
    torch.manual_seed(2); h_theirs = seed.RelationAwareAttentionHead(16, 8, a_k, a_v)
    torch.manual_seed(2); h_ours = RelationAwareAttentionHead(16, 8, a_k, a_v)
    x = torch.randn(3, 6, 16); mask = torch.ones(3, 6); mask[0, 4:] = 0
    assert torch.equal(h_ours(x, x, x, mask=mask), h_theirs(x, x, x, mask=mask))


# ---------------------------------------------------------------- fast path == readable path
@settings(max_examples=40, deadline=None)
@given(n_q=st.integers(0, 24), extra=st.integers(0, 16), kk=st.integers(0, 12), chunk=st.sampled_from([None, 1, 3, 7]),
       masked=st.sampled_from(['none', 'keys', 'queries']), seed_=st.integers(0, 2**16))
def test_fast_equals_reference_float64(n_q, extra, kk, chunk, masked, seed_):
    g = torch.Generator().manual_seed(seed_)
    n_k = n_q + extra
    q, k, v = (torch.randn(2, 3, n, 5, generator=g, dtype=torch.float64) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 5, generator=g, dtype=torch.float64) for _ in range(2))
    keep = {'none': None, 'keys': torch.rand(2, 1, 1, n_k, generator=g) > 0.4,
            'queries': torch.rand(2, 1, n_q, n_k, generator=g) > 0.4}[masked]
    out = relation_aware_attention(q, k, v, w_k, w_v, 0.3, keep, chunk)
    torch.testing.assert_close(out, reference(q, k, v, w_k, w_v, 0.3, keep), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_q, n_k, kk, chunk", [(6, 6, 2, None), (5, 9, 3, 2), (7, 7, 0, 3), (4, 6, 9, 1)])
@pytest.mark.parametrize("masked", ['none', 'keys', 'queries'])
def test_gradcheck_float64(n_q, n_k, kk, chunk, masked):
    g = torch.Generator().manual_seed(n_q * 100 + n_k)
    q, k, v = (torch.randn(2, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = {'none': None, 'keys': torch.rand(2, 1, 1, n_k, generator=g) > 0.4,
            'queries': torch.rand(2, 1, n_q, n_k, generator=g) > 0.4}[masked]
    if keep is not None: keep[0] = False   # a batch element whose keys are all masked
    f = lambda *t: relation_aware_attention(*t, 0.5, keep, chunk)
    assert torch.autograd.gradcheck(f, (q, k, v, w_k, w_v))


@settings(max_examples=15, deadline=None)
@given(n_q=st.integers(1, 40), extra=st.integers(0, 30), kk=st.integers(0, 6), seed_=st.integers(0, 2**16))
def test_module_paths_agree_float32_with_gradients(n_q, extra, kk, seed_):
    torch.manual_seed(seed_)
    m = RelationAwareMultiHeadAttention(16, 2, kk)
    q, kv = torch.randn(2, n_q, 16), torch.randn(2, n_q + extra, 16)
    mask = torch.rand(2, n_q + extra) > 0.3
    outs, grads = [], []
    for need_weights in [False, True]:
        m.zero_grad()
        out = m(q, kv, kv, mask=mask, need_weights=need_weights)
        out.square().sum().backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if n != 'key_weights.bias'})
    assert rel_err(outs[0], outs[1]) <= 1e-5
    # gradients that are 0 in exact arithmetic (w^K when k = 0 adds a constant to a row, like the key bias) are
    # rounding noise on both paths: errors are measured against at least 1e-3 of the largest gradient
    floor = 1e-3 * max(g.abs().max().item() for g in grads[1].values())
    for n in grads[0]:
        err = (grads[0][n] - grads[1][n]).abs().max().item() / max(grads[1][n].abs().max().item(), floor)
        assert err <= 1e-4, (n, err)


@settings(max_examples=15, deadline=None)
@given(n_q=st.integers(1, 12), mem=st.integers(1, 10), drop=st.integers(1, 10), kk=st.integers(0, 5), seed_=st.integers(0, 999))
def test_masking_the_oldest_keys_equals_removing_them(n_q, mem, drop, kk, seed_):
    "With the last query aligned to the last key, removing the oldest keys leaves every other distance unchanged."
    drop = min(drop, mem)
    torch.manual_seed(seed_)
    m = RelationAwareMultiHeadAttention(16, 2, kk).eval()
    x = torch.randn(2, n_q + mem, 16)
    mask = torch.ones(2, n_q + mem, dtype=torch.bool); mask[:, :drop] = False
    for need_weights in [False, True]:
        masked = m(x[:, mem:], x, x, mask=mask, need_weights=need_weights)
        removed = m(x[:, mem:], x[:, drop:], x[:, drop:], need_weights=need_weights)
        assert rel_err(masked, removed) <= 1e-5


def test_lengths_far_beyond_seq_len_and_chunk_boundaries():
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(32, 4, 16, seq_len=20)
    for n_q, n_k in [(1, 1), (1, 900), (257, 257), (300, 1100)]:
        q, kv = torch.randn(1, n_q, 32), torch.randn(1, n_k, 32)
        assert rel_err(m(q, kv, kv), m(q, kv, kv, need_weights=True)) <= 1e-5


def test_two_optimizer_steps_same_on_both_paths():
    "The seed's module fails on its second backward; relpos's trains, and both paths take the same steps."
    params = []
    for need_weights in [False, True]:
        torch.manual_seed(0)
        m = RelationAwareMultiHeadAttention(32, 4, 3)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)   # (Adam would blow up the noise of the key bias's zero gradient)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            x = torch.randn(2, 11, 32, generator=g)
            mask = torch.ones(2, 11); mask[1, 8:] = 0
            opt.zero_grad()
            m(x, x, x, mask=mask, need_weights=need_weights).square().mean().backward()
            assert m.relative_position_v.position_embeddings.grad.abs().sum() > 0
            opt.step()
        params.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert rel_err(params[0], params[1]) <= 1e-4
    torch.manual_seed(0)
    s = seed.RelationAwareMultiHeadAttention(32, 4, 3, 11)
    x = torch.randn(2, 11, 32)
    s(x, x, x).sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        s(x, x, x).sum().backward()


def test_fully_padded_rows_finite_with_finite_gradients():
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(16, 2, 2)
    x = torch.randn(3, 7, 16, requires_grad=True)
    mask = torch.ones(3, 7); mask[1] = 0
    for need_weights in [False, True]:
        out = m(x, x, x, mask=mask, need_weights=need_weights)
        assert out.isfinite().all()
        x.grad = None; out.sum().backward()
        assert x.grad.isfinite().all()


# ---------------------------------------------------------------- compile, dtypes, devices
def test_torch_compile_inductor_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(16, 2, 3)
    q, kv = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 8, 16, requires_grad=True)
    mask = torch.ones(2, 8); mask[0, :3] = 0
    ref = m(q, kv, kv, mask=mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, kv))
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True)
    out = compiled(q, kv, kv, mask=mask)
    grads = torch.autograd.grad(out.square().sum(), (q, kv))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_autocast_bf16_cpu():
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(32, 4, 3)
    x = torch.randn(2, 9, 32)
    ref = m(x, x, x)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = m(x, x, x)
    assert out.dtype == torch.bfloat16
    assert rel_err(out.float(), ref) <= 5e-2
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for n, p in m.named_parameters() if n != 'key_weights.bias')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fast_equals_reference():
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(64, 4, 8).cuda()
    q, kv = torch.randn(2, 300, 64, device='cuda'), torch.randn(2, 500, 64, device='cuda')
    mask = torch.rand(2, 500, device='cuda') > 0.2
    assert rel_err(m(q, kv, kv, mask=mask), m(q, kv, kv, mask=mask, need_weights=True)) <= 1e-4


# ---------------------------------------------------------------- memory: never the [n, n, d] tables
def test_fast_path_memory_is_bounded_by_chunks_not_tables():
    "At n = 1024 one float32 [n, n, head_dim] table is 256 MiB; the fast path's largest saved tensor is [b, h, n, d]."
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(64, 1, 16)
    x = torch.randn(1, 1024, 64, requires_grad=True)
    saved = []
    def pack(t):
        saved.append(t.numel() * t.element_size()); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, x, x).sum().backward()
    assert max(saved) <= 1024 * 64 * 4 * 2, max(saved)   # no n x n tensor is kept for backward
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, x, x, need_weights=True)
    assert max(saved) >= 1024 * 1024 * 4   # the readable path keeps n x n (and n x n x d) tensors

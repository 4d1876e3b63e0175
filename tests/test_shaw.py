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


# ---------------------------------------------------------------- skipping the keys a mask hides
import relpos.shaw as shaw_module
from relpos.mha import block_key_ranges


def structured_keep(kind, b, n_q, n_k, g, window=3, empty_row=None):
    "bool `[b|1, 1, n_q|1, n_k]` (True = may attend): causal (with memory when n_k > n_q), padding, both, sliding window."
    i = torch.arange(n_q)[:, None] + (n_k - n_q)             # query i sits at key position i + n_k - n_q
    j = torch.arange(n_k)[None]
    lengths = torch.randint(0, n_k + 1, (b, 1), generator=g)  # keys kept per batch element (0: all padding)
    keep = {'causal': (j <= i)[None, None],
            'padding': (j < lengths)[:, None, None],
            'causal+padding': ((j <= i)[None] & (j < lengths)[:, None])[:, None],
            'window': ((j <= i) & (j > i - window))[None, None]}[kind]
    if empty_row is not None and n_q:                        # one query of one batch element sees no key at all
        keep = keep.expand(b, 1, n_q, n_k).clone(); keep[0, 0, empty_row % n_q] = False
    return keep


def no_skip(mask, n_q, n_k, block_rows):
    "`block_key_ranges` that ignores the mask: every chunk visits every key (the path before key skipping)."
    return block_key_ranges(None, n_q, n_k, block_rows)


@settings(max_examples=60, deadline=None)
@given(n_q=st.integers(1, 30), mem=st.integers(0, 12), kk=st.integers(0, 10), chunk=st.sampled_from([None, 1, 3, 7, 16]),
       kind=st.sampled_from(['causal', 'padding', 'causal+padding', 'window']), window=st.integers(1, 8),
       empty_row=st.one_of(st.none(), st.integers(0, 100)), seed_=st.integers(0, 2**16))
def test_fast_equals_reference_under_structured_masks_float64_values_and_gradients(n_q, mem, kk, chunk, kind, window,
                                                                                   empty_row, seed_):
    g = torch.Generator().manual_seed(seed_)
    n_k = n_q + mem
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = structured_keep(kind, 2, n_q, n_k, g, window, empty_row)
    dout = torch.randn(2, 3, n_q, 4, generator=g, dtype=torch.float64)
    inputs = (q, k, v, w_k, w_v)
    out = relation_aware_attention(*inputs, 0.4, keep, chunk)
    ref = reference(*inputs, 0.4, keep)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for name, a, b in zip(['q', 'k', 'v', 'w_k', 'w_v'], grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("n_q, mem, kk, chunk, kind", [(9, 0, 2, 2, 'causal'), (7, 4, 3, 3, 'causal'), (8, 2, 1, 3, 'window'),
                                                       (6, 3, 5, 4, 'causal+padding')])
def test_gradcheck_float64_under_causal_masks(n_q, mem, kk, chunk, kind):
    g = torch.Generator().manual_seed(n_q * 10 + mem)
    n_k = n_q + mem
    q, k, v = (torch.randn(2, 2, n, 3, generator=g, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = structured_keep(kind, 2, n_q, n_k, g, window=2)
    assert sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in block_key_ranges(keep, n_q, n_k, chunk)) < n_q * n_k  # keys skipped
    assert torch.autograd.gradcheck(lambda *t: relation_aware_attention(*t, 0.5, keep, chunk), (q, k, v, w_k, w_v))


def score_widths(monkeypatch, fn):
    "Run `fn()`; return the `(rows, keys)` of every chunk's scores that `_chunk_scores` computed (forward and backward), once per batch element and head it holds."
    shapes, chunk_scores = [], shaw_module._chunk_scores
    def spy(*args):
        s = chunk_scores(*args); shapes.extend([tuple(s.shape[-2:])] * (s.shape[0] * s.shape[1])); return s
    monkeypatch.setattr(shaw_module, '_chunk_scores', spy)
    fn()
    monkeypatch.undo()
    return shapes


def test_causal_mask_computes_about_half_the_scores(monkeypatch):
    "n = 256 in chunks of c = 32: forward and backward each visit n^2/2 + n c/2 scores instead of n^2."
    n, c = 256, 32
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for _ in range(3))
    w_k, w_v = (torch.randn(2 * 4 + 1, 8, requires_grad=True) for _ in range(2))
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    for keep, scores in [(None, n * n), (causal, n * n // 2 + n * c // 2)]:
        shapes = score_widths(monkeypatch, lambda: relation_aware_attention(q, k, v, w_k, w_v, 0.3, keep, c).sum().backward())
        assert len(shapes) == 2 * 2 * n // c                          # per head (2): one per chunk in forward, one in backward
        assert sum(r * w for r, w in shapes) == 2 * 2 * scores, (keep is None, shapes)
    # a padded tail is skipped too, and a chunk holding a fully masked row visits every key (the seed's uniform row)
    pad = torch.ones(1, 1, 1, n, dtype=torch.bool); pad[..., 200:] = False
    shapes = score_widths(monkeypatch, lambda: relation_aware_attention(q, k, v, w_k, w_v, 0.3, pad, c))
    assert {w for _, w in shapes} == {200}
    empty = causal.clone(); empty[..., 40, :] = False                 # query 40 (chunk 1) sees nothing
    shapes = score_widths(monkeypatch, lambda: relation_aware_attention(q, k, v, w_k, w_v, 0.3, empty, c))
    assert list(dict.fromkeys(w for _, w in shapes))[:3] == [32, n, 96]   # chunks 0, 1, 2 (either layout)


def test_module_causal_skipping_same_numbers_as_visiting_every_key(monkeypatch):
    "The module with a causal mask (memory first), float32 and bf16 autocast: skipping keys changes no number beyond rounding."
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(32, 4, 3)
    n, mem = 70, 10
    x = torch.randn(2, mem + n, 32)
    causal = torch.ones(n, mem + n, dtype=torch.bool).tril(mem)[None]      # [1, seq_q, seq_k], query i sees keys <= i + mem
    widths = []
    def run(skip, autocast=False, need_weights=False):
        monkeypatch.setattr(shaw_module, '_chunk_rows', lambda *args: 16)   # several chunks at this small size
        if not skip: monkeypatch.setattr(shaw_module, 'block_key_ranges', no_skip)
        chunk_scores = shaw_module._chunk_scores
        monkeypatch.setattr(shaw_module, '_chunk_scores', lambda *a: widths.extend([a[1].shape[2]] * (a[1].shape[0] * a[1].shape[1]))
                            or chunk_scores(*a))   # once per batch element and head, in either layout
        m.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            out = m(x[:, mem:], x, x, mask=causal, need_weights=need_weights)
        out.float().square().sum().backward()
        monkeypatch.undo()
        return out, {name: p.grad.clone() for name, p in m.named_parameters() if name != 'key_weights.bias'}
    for autocast, tol in [(False, 1e-6), (True, 1e-2)]:   # bf16: a couple of ulps (2**-8) at most
        widths.clear()
        (out, grads), (out_all, grads_all) = run(True, autocast), run(False, autocast)
        lanes = 2 * 4    # batch x heads
        assert sorted(widths) == sorted([26, 42, 58, 74, 80] * 2 * lanes + [80] * 10 * lanes), widths   # skipped (forward, backward), then every key
        assert rel_err(out.float(), out_all.float()) <= tol, autocast
        for name in grads: assert rel_err(grads[name], grads_all[name]) <= tol, (autocast, name)
    out_readable, _ = run(True, autocast=True, need_weights=True)     # and the readable path, under autocast as before
    assert rel_err(out.float(), out_readable.float()) <= 5e-2


def test_per_bucket_weights_stay_exact_under_skipping():
    "The per-bucket attention weights kept for dW^V: each row sums to 1 and equals the readable path's, in float64."
    g = torch.Generator().manual_seed(0)
    n_q, n_k, kk = 20, 26, 3
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 4, generator=g, dtype=torch.float64) for _ in range(2))
    keep = structured_keep('causal', 2, n_q, n_k, g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        relation_aware_attention(q, k, v, w_k, w_v, 0.5, keep, 3)
    pb = saved[-1]
    assert pb.shape == (2, 2, n_q, 2 * kk + 1)
    idx = relative_buckets(n_q, n_k, kk, n_k - n_q)
    p = ((q * 0.5) @ k.transpose(-1, -2) + (q * 0.5 @ w_k.T).gather(-1, idx.expand(2, 2, n_q, n_k))).masked_fill(~keep, -1e9).softmax(-1)
    ref = torch.zeros_like(pb).scatter_add(-1, idx.expand(2, 2, n_q, n_k), p.detach())
    torch.testing.assert_close(pb, ref, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(pb.sum(-1), torch.ones(2, 2, n_q, dtype=torch.float64), rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------- the two layouts: per head on worker threads (CPU), batched (other devices)
from relpos.mha import head_workers, available_cpus
from mha_module_checks import ops_forward_backward


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), n_q=st.integers(1, 20), mem=st.integers(0, 8), kk=st.integers(0, 6),
       chunk=st.sampled_from([None, 1, 3, 7]), kind=st.sampled_from([None, 'causal', 'padding', 'causal+padding', 'window']),
       seed_=st.integers(0, 2**16))
def test_per_head_and_batched_layouts_same_numbers(b, h, n_q, mem, kk, chunk, kind, seed_):
    "Per batch element and head (the CPU default from PER_HEAD_MIN_KEYS keys) or batched (the default elsewhere): the same values and gradients in float64, dW^K summed over heads included."
    g = torch.Generator().manual_seed(seed_)
    n_k = n_q + mem
    q, k, v = (torch.randn(b, h, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (n_q, n_k, n_k))
    w_k, w_v = (torch.randn(2 * kk + 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = None if kind is None else structured_keep(kind, b, n_q, n_k, g)
    dout = torch.randn(b, h, n_q, 4, generator=g, dtype=torch.float64)
    results = []
    for batched in (False, True):
        out = relation_aware_attention(q, k, v, w_k, w_v, 0.4, keep, chunk, batched=batched)
        results.append((out, *torch.autograd.grad(out, (q, k, v, w_k, w_v), dout)))
    for a, c in zip(*results): torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(results[0][0], reference(q, k, v, w_k, w_v, 0.4, keep), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('batched', [True, False])
def test_ops_per_call_do_not_grow_with_batch_and_heads(batched):
    "The batched layout (the default off CPU) dispatches as many ops for batch 3 x 5 heads as for 2 x 2; the per-head one loops."
    keep = torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    def call(b, h):
        q, k, v = (torch.randn(b, h, 24, 4, requires_grad=True) for _ in range(3))
        w_k, w_v = (torch.randn(2 * 3 + 1, 4, requires_grad=True) for _ in range(2))
        return relation_aware_attention(q, k, v, w_k, w_v, 0.5, keep, 8, batched=batched)
    counts = [ops_forward_backward(lambda: call(b, h)) for b, h in [(2, 2), (3, 5)]]
    if batched: assert counts[0] == counts[1], counts
    else: assert counts[1][0] > 3 * counts[0][0], counts     # a loop over batch x heads


def test_per_head_workers_under_autocast(monkeypatch):
    "Under bf16 autocast the worker threads (which do not inherit autocast) get the inputs in the batched layout's dtype: the results agree to bf16 rounding."
    torch.manual_seed(0)
    m = RelationAwareMultiHeadAttention(64, 4, 3)
    x = torch.randn(2, 1024, 64)                 # 2 x 4 x 1024^2 scores: above head_workers' 2**22, so two workers run
    dtypes, bucket_sums = [], shaw_module._bucket_sums
    monkeypatch.setattr(shaw_module, '_bucket_sums', lambda x, *a: dtypes.append(x.dtype) or bucket_sums(x, *a))
    workers = []
    monkeypatch.setattr(shaw_module, 'head_workers', lambda *a: workers.append(head_workers(*a)) or workers[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for batched in (False, True):
            fast = lambda q, k, v, keep, batched=batched: relation_aware_attention(
                q, k, v, m.relative_position_k.position_embeddings, m.relative_position_v.position_embeddings, m.scale, keep, 256, batched)
            monkeypatch.setattr(m, 'attention_fast', fast)
            with torch.autocast('cpu', dtype=torch.bfloat16): outs.append(m(x, x, x))
    finally: torch.set_num_threads(threads)
    assert workers == [min(2, available_cpus())] and set(dtypes) == {torch.bfloat16}, (workers, set(dtypes))   # per head, on two workers where two CPUs are
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert rel_err(outs[0].float(), outs[1].float()) <= 1e-2

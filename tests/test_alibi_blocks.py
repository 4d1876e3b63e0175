"ALiBi's causal and unmasked fast paths above `ALIBI_WHOLE_BIAS_MAX`: equal to the readable path, and no `[heads, n_q, n_k]` tensor."
from unittest import mock
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import relpos.alibi, relpos.bias
from relpos.alibi import ALiBiMultiHeadAttention


def layer(heads=4, d_model=32, kv_heads=None, bidirectional=False, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return ALiBiMultiHeadAttention(heads, d_model, dropout_prob=0.0, bidirectional=bidirectional, kv_heads=kv_heads).to(dtype).eval()


def blocked(threshold=0, block_scores=None):
    "The fast path's switch moved down to `threshold` bias elements (old code: the attribute is created, unused)."
    patches = [mock.patch.object(relpos.alibi, 'ALIBI_WHOLE_BIAS_MAX', threshold, create=True)]
    if block_scores is not None: patches.append(mock.patch.object(relpos.bias, 'BIAS_BLOCK_SCORES', block_scores))
    class Both:
        def __enter__(self): [p.__enter__() for p in patches]
        def __exit__(self, *a): [p.__exit__(*a) for p in reversed(patches)]
    return Both()


def out_and_grads(m, x, kv, mask, need_weights, create_graph=False):
    m.zero_grad()
    x, kv = x.clone().requires_grad_(), kv.clone().requires_grad_()
    out = m(query=x, key=kv, value=kv, mask=mask, need_weights=need_weights)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    grads = torch.autograd.grad((out * w).sum(), [x, kv] + list(m.parameters()), create_graph=create_graph)
    return out, grads


CASES = [  # (bidirectional, kv_heads, n_q, n_k, causal mask given)
    (False, None, 9, 9, False), (False, 2, 9, 9, False), (False, None, 6, 11, True), (False, 2, 6, 11, True),
    (True, None, 9, 9, False), (True, 2, 6, 11, False), (True, None, 7, 7, True)]


@pytest.mark.parametrize("bidirectional, kv_heads, nq, nk, given_causal", CASES)
def test_blocked_equals_readable_float64(bidirectional, kv_heads, nq, nk, given_causal):
    m = layer(kv_heads=kv_heads, bidirectional=bidirectional)
    torch.manual_seed(1)
    x, kv = torch.randn(nq, 2, 32, dtype=torch.float64), torch.randn(nk, 2, 32, dtype=torch.float64)
    if nq == nk: kv = x
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None] if given_causal else None
    want = out_and_grads(m, x, kv, mask, True)
    with blocked(0), mock.patch.object(relpos.alibi, '_toeplitz_heads', wraps=relpos.alibi._toeplitz_heads) as spy:
        got = out_and_grads(m, x, kv, mask, False)
    assert spy.call_count == 1                       # the distance-table kernel took it
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    for g, w in zip(got[1], want[1]): torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_below_the_threshold_the_whole_bias_path_stays():
    m = layer()
    x = torch.randn(9, 2, 32, dtype=torch.float64)
    with mock.patch.object(relpos.alibi, '_toeplitz_heads', wraps=relpos.alibi._toeplitz_heads) as spy:
        m(query=x, key=x, value=x)
    assert spy.call_count == 0 and m.heads * 9 * 9 <= relpos.alibi.ALIBI_WHOLE_BIAS_MAX


@pytest.mark.parametrize("bidirectional", [False, True])
def test_blocked_gradients_of_gradients_equal_readable(bidirectional):
    m = layer(bidirectional=bidirectional)
    x = torch.randn(8, 2, 32, dtype=torch.float64)
    def second(need_weights):
        out, grads = out_and_grads(m, x, x, None, need_weights, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads[:2]), list(m.parameters()), allow_unused=True)
    want = second(True)
    with blocked(0): got = second(False)
    assert [g is None for g in got] == [w is None for w in want] and any(w is not None for w in want)
    for g, w in zip(got, want):
        if w is not None: torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_blocked_torch_func_equals_readable(bidirectional):
    m = layer(kv_heads=2, bidirectional=bidirectional)
    x = torch.randn(8, 2, 32, dtype=torch.float64)
    f = lambda nw: (lambda x: m(query=x, key=x, value=x, need_weights=nw).square().sum())
    want = torch.func.grad(f(True))(x)
    with blocked(0, block_scores=16): got = torch.func.grad(f(False))(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_blocked_bfloat16_and_dropout(bidirectional):
    "bfloat16 (no fused float kernel for it) and dropout take the blocks of rows; close to float32, gradients finite."
    m32 = layer(bidirectional=bidirectional, dtype=torch.float32)
    x = torch.randn(40, 2, 32)
    want = m32(query=x, key=x, value=x, need_weights=True)
    mb = layer(bidirectional=bidirectional, dtype=torch.bfloat16)
    xb = x.bfloat16().requires_grad_()
    with blocked(0, block_scores=256):
        got = mb(query=xb, key=xb, value=xb)
        got.float().square().sum().backward()
        assert (got.float() - want).abs().max() < 0.05 and xb.grad.isfinite().all()
        md = ALiBiMultiHeadAttention(4, 32, dropout_prob=0.5, bidirectional=bidirectional).train()
        xd = x.clone().requires_grad_()
        md(query=xd, key=xd, value=xd).sum().backward()
        assert xd.grad.isfinite().all()


class StorageSizes(TorchDispatchMode):
    "Records the storage size (elements) of every tensor an op returns: what each allocation holds (a view: its base)."
    def __init__(self):
        super().__init__(); self.sizes = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor): self.sizes.append((t.untyped_storage().nbytes() // t.element_size(), str(func)))
        return out


@pytest.mark.parametrize("bidirectional, kv_heads, dtype, dropout", [
    (False, None, torch.float32, 0.0), (True, None, torch.float32, 0.0), (False, 2, torch.float32, 0.0),
    (False, None, torch.bfloat16, 0.0), (True, None, torch.float32, 0.1)])   # the last two: blocks of rows
def test_no_tensor_of_the_whole_bias(bidirectional, kv_heads, dtype, dropout):
    "n = 1024, 4 heads, batch 2: neither forward nor backward makes a tensor of heads * n * n elements."
    n, heads = 1024, 4
    m = layer(heads, 64, kv_heads=kv_heads, bidirectional=bidirectional, dtype=dtype)
    if dropout: m.dropout.p = dropout; m.train()
    x = torch.randn(n, 2, 64, dtype=dtype, requires_grad=True)
    threads = torch.get_num_threads(); torch.set_num_threads(1)     # the kernels' workers run in this thread
    try:
        with blocked(2**16, block_scores=2**14):
            with StorageSizes() as fwd: out = m(query=x, key=x, value=x)
            with StorageSizes() as both: m(query=x, key=x, value=x).square().sum().backward()
    finally: torch.set_num_threads(threads)
    assert out.shape == (n, 2, 64) and x.grad.isfinite().all()
    for rec in (fwd, both):
        big = [(s, f) for s, f in rec.sizes if s >= heads * n * n]
        assert not big, f"tensors of >= heads * n * n = {heads * n * n} elements: {big[:5]}"

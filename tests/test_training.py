"""Training-grade reliability of the fast paths: higher-order gradients, torch.func, caches that do not depend on the
mode they were built in, dtypes under autocast and `.to()`, bounded memory at large k, and relpos's threads.

Each test compares a fast path with the readable path (or with finite differences, `gradgradcheck` in float64).
The fast paths are `relative_attention` (relpos.relative_mha), `relation_aware_attention` (relpos.shaw) and
`sdpa_bias`'s blockwise backward (relpos.fourier)."""
from functools import partial
import pytest
import torch
from torch.func import functional_call, grad, vmap, jacrev
from relpos.relative_mha import (RelativeMultiHeadAttention, XLRelativeMultiHeadAttention, relative_attention,
                                 TransformerXLModel)
from relpos.shaw import RelationAwareMultiHeadAttention, relation_aware_attention
import relpos.shaw as shaw
from relpos.fourier import FourierMultiHeadAttention, RelativeFourierPositions, sdpa_bias

D, H = 8, 2


def _randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters(): p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m.eval()


# name -> (factory, layout); Fourier's bias gets the blockwise backward (its Function) only from 2**16 scores up,
# so its module tests use 258 keys (256 queries)
MODULES = {
    "relative": (lambda: RelativeMultiHeadAttention(H, D, 0.0, P=16), "labml"),
    "xl": (lambda: XLRelativeMultiHeadAttention(H, D, 0.0), "labml"),
    "fourier": (lambda: FourierMultiHeadAttention(H, D, 0.0, max_number_of_keys=16, position_vector_size=8), "labml"),
    "shaw": (lambda: RelationAwareMultiHeadAttention(D, H, 2), "shaw"),
}


def _call(name, m, x, need_weights):
    "Queries: the last `n - 2` rows of `x`; keys: all of `x`; a mask with a fully masked query (labml) / padding (shaw)."
    if MODULES[name][1] == "shaw":           # x [batch, n, d]
        mask = torch.ones(x.shape[0], x.shape[1]); mask[-1, -2:] = 0
        return m(x[:, 2:], x, x, mask=mask, need_weights=need_weights)
    n, b = x.shape[0], x.shape[1]           # x [n, batch, d]
    mask = (torch.arange(n)[None] <= torch.arange(n - 2)[:, None] + 2)[..., None].expand(n - 2, n, b).clone()
    mask[1, :, -1] = False
    return m(query=x[2:], key=x, value=x, mask=mask, need_weights=need_weights)


def _input(name, n=6, b=2, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (b, n, D) if MODULES[name][1] == "shaw" else (n, b, D)
    return torch.randn(shape, generator=g).to(dtype).requires_grad_()


# ------------------------------------------------------------------ 1. higher-order gradients
@pytest.mark.parametrize("name", ["relative", "xl", "shaw"])
def test_gradgradcheck_modules(name):
    m = _randomize(MODULES[name][0]()).double()
    x = _input(name)
    assert torch.autograd.gradgradcheck(lambda x: _call(name, m, x, False), (x,))


def test_gradgradcheck_relative_attention_with_dropout():
    torch.manual_seed(0)
    b, h, n_q, n_k, d = 2, 2, 4, 6, 3
    qu, qp, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for n in (n_q, n_q, n_k, n_k))
    R = torch.randn(h, n_k + n_q, d, dtype=torch.float64, requires_grad=True)
    S = torch.randn(h, n_k + n_q, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(b, 1, n_q, n_k) > 0.3; mask[1, 0, 2] = False
    def f(*t):
        torch.manual_seed(5)    # the dropout seed comes from the global RNG
        return relative_attention(*t, mask=mask, dropout_p=0.3, chunk_size=3)
    assert torch.autograd.gradgradcheck(f, (qu, qp, k, v, R, S))


def test_gradgradcheck_relation_aware_attention_large_k():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 3, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    w_k, w_v = (torch.randn(2 * 9 + 1, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    keep = torch.rand(1, 1, 1, 7) > 0.3
    assert torch.autograd.gradgradcheck(lambda *t: relation_aware_attention(*t, 0.5, keep, 2), (q, k, v, w_k, w_v))


def test_gradgradcheck_sdpa_bias_blockwise():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (5, 7, 7))
    bias = torch.randn(1, 2, 5, 7, dtype=torch.float64); bias[..., 0, 3] = float('-inf')
    bias.requires_grad_()
    assert torch.autograd.gradgradcheck(lambda q, k, v, b: sdpa_bias(q, k, v, b, 0.3, blockwise=True), (q, k, v, bias))


@pytest.mark.parametrize("name", list(MODULES))
def test_gradient_penalty_fast_equals_readable(name):
    "A gradient penalty |d out / d x|^2 trained on the fast path gets the readable path's parameter gradients."
    m = _randomize(MODULES[name][0]())
    x = _input(name, n=258 if name == "fourier" else 6, b=1 if name == "fourier" else 2, dtype=torch.float32)
    grads = []
    for need_weights in (False, True):
        m.zero_grad()
        out = _call(name, m, x, need_weights)
        gx, = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), x, create_graph=True)
        gx.square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    # some gradients are 0 in exact arithmetic (the value bias: softmax rows sum to 1), rounding noise on both
    # paths: tolerance relative to the largest gradient
    scale = max(b.abs().max().item() for b in grads[1] if b is not None)
    for (pname, _), a, b in zip(m.named_parameters(), *grads):
        assert (a is None) == (b is None), pname    # None on both: the output bias does not reach d out / d x
        if a is not None: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=pname)


# ------------------------------------------------------------------ 2. torch.func
@pytest.mark.parametrize("name", list(MODULES))
def test_func_grad_and_vmap_equal_readable(name):
    m = _randomize(MODULES[name][0]()).double()
    x = _input(name, n=258 if name == "fourier" else 6)
    loss = lambda nw: (lambda x: _call(name, m, x, nw).square().sum())
    torch.testing.assert_close(grad(loss(False))(x), grad(loss(True))(x))
    # per-sample gradients of the parameters: vmap over grad, through functional_call
    params = {k: v.detach() for k, v in m.named_parameters()}
    bdim = 0 if MODULES[name][1] == "shaw" else 1
    def sample_loss(p, xi, nw): return _call_functional(name, m, p, xi.unsqueeze(bdim), nw).square().sum()
    fast = vmap(grad(partial(sample_loss, nw=False)), in_dims=(None, bdim))(params, x.detach())
    slow = vmap(grad(partial(sample_loss, nw=True)), in_dims=(None, bdim))(params, x.detach())
    for k in params: torch.testing.assert_close(fast[k], slow[k], msg=k)


def _call_functional(name, m, params, x, need_weights):
    "`_call` with the module's parameters replaced by `params` (torch.func.functional_call)."
    class Bound(torch.nn.Module):
        def __init__(self): super().__init__(); self.m = m
        def forward(self, x): return _call(name, self.m, x, need_weights)
    return functional_call(Bound(), {f"m.{k}": v for k, v in params.items()}, (x,))


def test_jacrev_relative_attention():
    torch.manual_seed(0)
    m = _randomize(RelativeMultiHeadAttention(H, D, 0.0, P=16)).double()
    x = torch.randn(4, 1, D, dtype=torch.float64)
    j_fast = jacrev(lambda x: m(query=x, key=x, value=x))(x)
    j_ref = jacrev(lambda x: m(query=x, key=x, value=x, need_weights=True))(x)
    torch.testing.assert_close(j_fast, j_ref)


# ------------------------------------------------------------------ 3. Fourier caches and modes
def _fourier_step(m, n):
    x = torch.randn(n, 1, D)
    m(query=x, key=x, value=x).square().sum().backward()


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_fourier_cache_rebuilt_in_a_mode_serves_training(mode):
    torch.manual_seed(0)
    m = FourierMultiHeadAttention(H, D, 0.0, max_number_of_keys=16, position_vector_size=8)
    ctx = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with ctx:
        x = torch.randn(40, 1, D)    # longer than max_number_of_keys: the caches grow
        m(query=x, key=x, value=x)
    for name in ("positions", "distances"):
        t = getattr(m.positions, name)
        assert not t.is_inference() and not t.requires_grad and t.dtype == torch.float32, name
    _fourier_step(m, 40)             # a training step after the inference call
    _fourier_step(m, 60)
    assert m.positions.rotation_matrix.grad is not None
    fresh = RelativeFourierPositions(H, 16, 8)
    fresh.load_state_dict(m.positions.state_dict())
    torch.testing.assert_close(m.positions(30, 50), fresh(30, 50))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fourier_caches_do_not_follow_to_dtype(dtype):
    "`.to(dtype)` changes the compute dtype; the caches stay float32, and a cache rebuilt later equals one never rebuilt."
    r = RelativeFourierPositions(H, 16, 8).to(dtype)
    for name in ("positions", "distances"): assert getattr(r, name).dtype == torch.float32, name
    before = r(4, 16)
    r(8, 80)                          # grows the caches
    torch.testing.assert_close(r(4, 16), before)
    r.float()
    assert r.dtype == torch.float32 and r(4, 16).dtype == torch.float32


# ------------------------------------------------------------------ 4. Fourier dtypes
def test_fourier_to_float64_computes_in_float64():
    r = RelativeFourierPositions(H, 16, 8)
    with torch.no_grad(): r.rotation_matrix.normal_()
    r = r.to(torch.float64)
    assert r.dtype == torch.float64 and r(3, 30).dtype == torch.float64 and r(3, 30, fast=False).dtype == torch.float64
    w = r.rotation_matrix.detach().clone().requires_grad_()
    for fast in (True, False):
        assert torch.autograd.gradcheck(lambda w: functional_call(r, {"rotation_matrix": w}, (3, 30), {"fast": fast}), (w,))


def test_fourier_autocast_keeps_float32_bias_and_gradient():
    torch.manual_seed(0)
    r = RelativeFourierPositions(4, 256, 64)
    with torch.no_grad(): r.rotation_matrix.normal_()
    w = torch.randn(1, 4, 512, 512)
    (r(512, 512) * w).sum().backward()
    want = r.rotation_matrix.grad.clone(); r.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias = r(512, 512)
    assert bias.dtype == torch.float32
    (bias * w).sum().backward()
    torch.testing.assert_close(r.rotation_matrix.grad, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# ------------------------------------------------------------------ 5. Shaw memory at large k
@pytest.mark.parametrize("kk", [3, 64, 300])
def test_shaw_one_hot_never_larger_than_the_chunk(kk, monkeypatch):
    "The per-bucket one-hot matrices never hold more numbers than the chunk's scores; large k sums by scatter_add_."
    built, one_hot = [], shaw._one_hot_strip
    monkeypatch.setattr(shaw, "_one_hot_strip", lambda idx, n, dtype: built.append(idx.shape[0] * idx.shape[1] * n) or one_hot(idx, n, dtype))
    torch.manual_seed(0)
    b, h, n, d, c = 1, 2, 256, 4, 32
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    w_k, w_v = (torch.randn(2 * kk + 1, d, requires_grad=True) for _ in range(2))
    out = relation_aware_attention(q, k, v, w_k, w_v, 0.5, chunk_size=c)
    out.square().sum().backward()
    assert all(x <= b * h * c * n for x in built), (max(built), b * h * c * n)
    if kk == 3: assert built, "small k should still use the one-hot matmul"
    # same numbers as the readable formulas
    idx = shaw.relative_buckets(n, n, kk)
    ref = lambda q, k, v, w_k, w_v: ((q @ k.transpose(-1, -2) + torch.einsum('bhid,ijd->bhij', q, w_k[idx])) * 0.5).softmax(-1)
    p = ref(q, k, v, w_k, w_v)
    torch.testing.assert_close(out, p @ v + torch.einsum('bhij,ijd->bhid', p, w_v[idx]), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ 6. Shaw batch 0
def test_shaw_batch_zero_fast_path():
    m = RelationAwareMultiHeadAttention(D, H, 2)
    x = torch.randn(0, 5, D, requires_grad=True)
    out = m(x, x, x)
    assert out.shape == (0, 5, D)
    out.sum().backward()
    assert x.grad.shape == x.shape


# ------------------------------------------------------------------ 7. arguments (the matrix in test_reliability.py has more)
@pytest.mark.parametrize("bad", [-1, 0])
def test_chunk_size_refused(bad):
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        relative_attention(x, x, x, x, torch.randn(2, 8, 8), torch.randn(2, 8), chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size"):
        relation_aware_attention(x, x, x, torch.randn(5, 8), torch.randn(5, 8), 0.5, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size"): RelativeMultiHeadAttention(H, D, chunk_size=bad)


def test_transformer_xl_arguments():
    with pytest.raises(ValueError, match="mem_len"): TransformerXLModel(11, d_model=D, heads=H, mem_len=-1)
    m = TransformerXLModel(11, d_model=D, heads=H, d_ff=16, n_layers=2, mem_len=4, max_seq_len=6).double()
    x = torch.randint(0, 11, (5, 2))
    _, mem = m(x)
    with pytest.raises(TypeError, match=r"mem\[0\]"): m(x, [t.float() for t in mem])


# ------------------------------------------------------------------ 9. torch.compile
@pytest.mark.parametrize("name", ["relative", "xl"])
def test_compile_fullgraph_across_lengths(name):
    "One graph (fullgraph: no graph break), at most one recompile (to dynamic shapes) over five lengths; eager's numbers and gradients."
    from torch._dynamo.utils import counters
    m = _randomize(MODULES[name][0]()).float()
    torch._dynamo.reset(); counters.clear()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for n in (6, 8, 10, 12, 14):
        x = _input(name, n=n, dtype=torch.float32)
        out = _call(name, compiled, x, False)
        gx, = torch.autograd.grad(out.square().sum(), x)
        want = _call(name, m, x, False)
        want_gx, = torch.autograd.grad(want.square().sum(), x)
        # float32, another order of summation (the reference's full scores vs the blocks): relative to the largest value
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-6 * want_gx.abs().max().item())
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


# ------------------------------------------------------------------ 10. relpos's own threads
_THREADS_CHILD = r"""
import os, threading, torch
from relpos.relative_mha import relative_attention
from relpos.fourier import sdpa_bias
started, set_calls = [], []
_start, _set = threading.Thread.start, torch.set_num_threads
threading.Thread.start = lambda self: (started.append(self.name), _start(self))[1]
torch.set_num_threads = lambda n: (set_calls.append(n), _set(n))[1]
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})     # this process may run on one CPU
b, h, n, d = 1, 4, 1024, 8                                         # 2**22 scores: big enough for a pool
def step():
    qu, qp, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(4))
    R, S = torch.randn(h, 2 * n, d, requires_grad=True), torch.randn(h, 2 * n, requires_grad=True)
    relative_attention(qu, qp, k, v, R, S).sum().backward()
    bias = torch.randn(1, h, n, n, requires_grad=True)
    sdpa_bias(qu, k, v, bias, 0.3, blockwise=True).sum().backward()
for threads in (4, 1):
    _set(threads); started.clear(); set_calls.clear()
    step()
    print(threads, len(started), torch.get_num_threads(), set_calls)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_no_more_workers_than_usable_cpus():
    "On one usable CPU relpos starts no thread, whatever torch's thread count; with one thread it never touches the count."
    import os, subprocess, sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _THREADS_CHILD], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": root}, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = dict(l.split(" ", 1) for l in r.stdout.strip().splitlines())
    assert lines["4"].startswith("0 4 "), lines["4"]      # no worker thread; the caller's thread count restored
    assert lines["1"] == "0 1 []", lines["1"]             # one thread: no pool and no set_num_threads call


# ------------------------------------------------------------------ higher-order gradients: work or name the way out
@pytest.mark.parametrize("name", ["mha", "rotary", "alibi", "t5", "relative", "xl", "fourier"])
@pytest.mark.parametrize("masked", [False, True])
def test_double_backward_works_or_names_need_weights(name, masked):
    "gradgradcheck passes on the default path, or it stops with an error naming need_weights=True, with which it passes."
    from relpos.mha import MultiHeadAttention
    from relpos.rotary import RotaryMultiHeadAttention
    from relpos.alibi import ALiBiMultiHeadAttention
    from relpos.t5 import T5MultiHeadAttention
    from relpos.relative_mha import RelativeMultiHeadAttention, XLRelativeMultiHeadAttention
    from relpos.fourier import FourierMultiHeadAttention
    make = {"mha": MultiHeadAttention, "rotary": RotaryMultiHeadAttention, "alibi": ALiBiMultiHeadAttention,
            "t5": T5MultiHeadAttention, "relative": lambda *a, **k: RelativeMultiHeadAttention(*a, P=16, **k),
            "xl": XLRelativeMultiHeadAttention,
            "fourier": lambda *a, **k: FourierMultiHeadAttention(*a, max_number_of_keys=16, position_vector_size=8, **k)}[name]
    torch.manual_seed(0)
    m = make(2, 8, dropout_prob=0.0).double()
    with torch.no_grad():
        for p in m.parameters(): p.normal_(std=0.3)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    mask = (torch.arange(5)[None, :] <= torch.arange(5)[:, None])[..., None] if masked else None
    f = lambda need_weights: (lambda x: m(query=x, key=x, value=x, mask=mask, need_weights=need_weights))
    try:
        assert torch.autograd.gradgradcheck(f(False), (x,))
    except RuntimeError as e:
        assert "need_weights=True" in str(e), str(e)[:300]
        assert torch.autograd.gradgradcheck(f(True), (x,))

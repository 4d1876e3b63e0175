"Tests of `relpos.fourier` that would clutter the chapter: meliad parity, gradcheck, compile, bf16, state, errors, training."
import copy, io, os, pickle
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from relpos.fourier import position_encoding, RelativeFourierPositions, FourierMultiHeadAttention, sdpa_bias
from relpos.mha import MultiHeadAttention

REF = np.load(os.path.join(os.path.dirname(__file__), 'data', 'fourier_meliad.npz'))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def meliad_np(rot, nq, nk, offset, p, max_keys):
    "A NumPy transcription of meliad's RelativeFourierPositions.__call__ (float32), independent of relpos."
    def pe(n, off):
        t = np.arange(0, p // 2, dtype=np.float32) / (p // 2)
        w = (float(2 * max_keys) ** t).reshape(1, -1)
        k = np.arange(off, n + off, dtype=np.float32).reshape(n, 1)
        a = np.array(np.pi, dtype=np.float32) * k / w
        return np.concatenate([np.cos(a, dtype=np.float32), np.sin(a, dtype=np.float32)], axis=1)
    if offset is None: offset = nk - nq
    ks, qs = pe(nk, 0), pe(nq, offset)
    qx, qy = np.split(qs, 2, axis=-1)
    qs_xs, qs_ys = np.concatenate([qx, qx], -1), np.concatenate([qy, qy], -1)
    rm_a, rm_b = np.split(rot, 2, axis=-1)
    rmat2 = np.concatenate([-rm_b, rm_a], -1)
    rot_qs = rot[:, None] * qs_xs[None] + rmat2[:, None] * qs_ys[None]
    return np.einsum('hqd,kd->hqk', rot_qs, ks)[None]


# ---------------------------------------------------------------- parity with meliad (JAX/flax numbers)
@pytest.mark.parametrize("name", ['pe_default', 'pe_offset', 'pe_large', 'pe_odd_wl'])
def test_position_encoding_matches_meliad(name):
    n, d, off, mw = REF[name + '_args']
    ours = position_encoding(int(n), int(d), offset=int(off), max_wavelength=int(mw) if mw == int(mw) else float(mw))
    assert ours.dtype == torch.float32
    assert rel_err(ours, REF[name]) <= 1e-6


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("name", ['default_square', 'default_memory', 'inside', 'before', 'after', 'q_longer',
                                  'q_longer_neg', 'far'])
def test_bias_matches_meliad(name, fast):
    m = RelativeFourierPositions(4, 64, 32)
    with torch.no_grad(): m.rotation_matrix.copy_(torch.from_numpy(REF['small_rotation']))
    nq, nk, off = (int(x) for x in REF[f'small_{name}_args'])
    off = None if off == -10**9 else off
    out = m(nq, nk, off, fast=fast).detach()
    assert out.shape == REF[f'small_{name}'].shape
    # fast path: within 1e-5 while positions stay small; 'far' (positions ~500) is meliad's float32 angle rounding
    tol = 1e-6 if not fast else (1e-4 if name == 'far' else 1e-5)
    assert rel_err(out, REF[f'small_{name}']) <= tol


def test_default_module_matches_meliad():
    m = RelativeFourierPositions()
    assert rel_err(m(64, 128, fast=False).detach(), REF['big_init']) <= 1e-6
    with torch.no_grad(): m.rotation_matrix.copy_(torch.from_numpy(REF['big_rotation']))
    for fast in (False, True):
        assert rel_err(m(64, 128, fast=fast).detach(), REF['big_random']) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(nq=st.integers(0, 20), nk=st.integers(0, 20), offset=st.one_of(st.none(), st.integers(-40, 40)),
       p=st.sampled_from([2, 8, 16]), max_keys=st.integers(1, 40), seed=st.integers(0, 10))
def test_property_matches_numpy_transcription(nq, nk, offset, p, max_keys, seed):
    if offset is None and nk < nq:
        with pytest.raises(ValueError, match="num_keys"): RelativeFourierPositions(3, max_keys, p)(nq, nk, offset)
        return
    rot = np.random.default_rng(seed).standard_normal((3, p)).astype(np.float32)
    m = RelativeFourierPositions(3, max_keys, p)
    with torch.no_grad(): m.rotation_matrix.copy_(torch.from_numpy(rot))
    ref = meliad_np(rot, nq, nk, offset, p, max_keys)
    for fast in (False, True):
        out = m(nq, nk, offset, fast=fast).detach().numpy()
        assert out.shape == ref.shape == (1, 3, nq, nk)
        if ref.size: np.testing.assert_allclose(out, ref, atol=1e-5 * max(1.0, np.abs(rot).sum(-1).max()))


def test_bidirectional_is_ignored_like_meliad():
    m = RelativeFourierPositions(2, 16, 8)
    assert torch.equal(m(5, 7, bidirectional=False), m(5, 7, bidirectional=True))


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("fast", [False, True])
def test_gradcheck_rotation_matrix(fast):
    m = RelativeFourierPositions(2, 16, 8, dtype=torch.float64).double()
    rot = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    def f(r):
        return torch.func.functional_call(m, {'rotation_matrix': r}, (4, 6), {'offset': -2, 'fast': fast})
    assert torch.autograd.gradcheck(f, (rot,))


def test_gradcheck_sdpa_bias():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    bias = torch.randn(1, 2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: sdpa_bias(*a, 0.5, blockwise=True), (q, k, v, bias))


def test_fast_and_einsum_gradients_agree():
    m = RelativeFourierPositions(4, 32, 16)
    with torch.no_grad(): m.rotation_matrix.normal_()
    g = torch.randn(1, 4, 9, 12)
    grads = [torch.autograd.grad((m(9, 12, 1, fast=f) * g).sum(), m.rotation_matrix)[0] for f in (False, True)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- compile, dtypes, devices
def test_torch_compile_bias_and_layer():
    m = RelativeFourierPositions(2, 16, 8)
    eager = m(5, 7)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=False)
    torch.testing.assert_close(compiled(5, 7), eager)
    layer = FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=16, position_vector_size=8)
    x = torch.randn(6, 2, 16)
    ref = layer(query=x, key=x, value=x)
    out = torch.compile(layer, backend="aot_eager")(query=x, key=x, value=x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    assert layer.positions.rotation_matrix.grad is not None


def test_inductor_compile_bias():
    m = RelativeFourierPositions(2, 16, 8)
    f = torch.compile(lambda n: m(n, n))
    torch.testing.assert_close(f(6), m(6, 6))


def test_bf16_dtype():
    m = RelativeFourierPositions(2, 32, 16, dtype=torch.bfloat16)
    out = m(8, 8)
    assert out.dtype == torch.bfloat16
    ref = RelativeFourierPositions(2, 32, 16)(8, 8)
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)
    assert m.rotation_matrix.dtype == torch.float32   # the parameter stays float32, as in meliad


def test_buffers_follow_to_and_grow():
    m = RelativeFourierPositions(2, 8, 8)
    m.to(torch.float64)
    assert m(3, 20).shape == (1, 2, 3, 20)            # beyond max_number_of_keys: the distance table grows
    assert m.distances.shape[0] >= 22
    assert m(3, 20, fast=False).shape == (1, 2, 3, 20)
    assert m.positions.shape[0] >= 20
    tables = m.positions, m.distances
    m(3, 20); m(3, 20, fast=False)                    # not rebuilt for the same size
    assert m.positions is tables[0] and m.distances is tables[1]


# ---------------------------------------------------------------- state
def test_state_dict_has_only_the_parameter_and_round_trips():
    a, b = RelativeFourierPositions(2, 16, 8), RelativeFourierPositions(2, 16, 8)
    with torch.no_grad(): a.rotation_matrix.normal_()
    assert list(a.state_dict()) == ['rotation_matrix']   # caches are non-persistent
    a(3, 40)                                             # grow a's caches: still only the parameter
    assert list(a.state_dict()) == ['rotation_matrix']
    b.load_state_dict(a.state_dict(), strict=True)
    assert torch.equal(a(4, 6), b(4, 6))
    buf = io.BytesIO(); torch.save(a.state_dict(), buf); buf.seek(0)
    b.load_state_dict(torch.load(buf)); assert torch.equal(a(4, 6), b(4, 6))
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert torch.equal(c(4, 6), a(4, 6))


def test_layer_state_dict_keys():
    layer = FourierMultiHeadAttention(4, 32)
    base = MultiHeadAttention(4, 32)
    assert list(layer.state_dict()) == list(base.state_dict()) + ['positions.rotation_matrix']
    assert layer.state_dict()['positions.rotation_matrix'].shape == (4, 128)


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call, match", [
    (lambda: position_encoding(10, 7), "input_dim must be even"),
    (lambda: position_encoding(0, 8), "max_wavelength must be > 1"),
    (lambda: position_encoding(5, 8, max_wavelength=0.5), "max_wavelength must be > 1"),
    (lambda: position_encoding(-2, 8, max_wavelength=4), "num_positions must be >= 0"),
    (lambda: RelativeFourierPositions(position_vector_size=5), "position_vector_size must be even"),
    (lambda: RelativeFourierPositions(max_number_of_keys=0), "max_number_of_keys must be >= 1"),
    (lambda: RelativeFourierPositions(num_heads=0), "num_heads must be >= 1"),
    (lambda: RelativeFourierPositions(2, 8, 8)(6, 4), r"num_keys \(4\) must be >= num_queries \(6\)"),
    (lambda: RelativeFourierPositions(2, 8, 8)(-1, 4), "num_queries must be >= 0"),
    (lambda: RelativeFourierPositions(2, 8, 8)(3, -4, offset=0), "num_keys must be >= 0"),
])
def test_bad_values(call, match):
    with pytest.raises(ValueError, match=match): call()


@pytest.mark.parametrize("call, match", [
    (lambda: position_encoding(4.0, 8), "num_positions must be an int"),
    (lambda: RelativeFourierPositions(2, 8, 8)(3, 4, offset=1.5), "offset must be an int"),
    (lambda: RelativeFourierPositions(2, 8, 8)(True, 4), "num_queries must be an int"),
    (lambda: RelativeFourierPositions(dtype=torch.int32), "dtype must be a floating-point"),
])
def test_bad_types(call, match):
    with pytest.raises(TypeError, match=match): call()


def test_layer_refuses_queries_longer_than_keys():
    layer = FourierMultiHeadAttention(2, 16, max_number_of_keys=16, position_vector_size=8)
    with pytest.raises(ValueError, match="key must be at least as long as query"):
        layer(query=torch.randn(5, 1, 16), key=torch.randn(3, 1, 16), value=torch.randn(3, 1, 16))


def test_empty_sequences():
    m = RelativeFourierPositions(2, 8, 8)
    assert m(0, 5).shape == (1, 2, 0, 5) and m(3, 0, offset=-3).shape == (1, 2, 3, 0)


# ---------------------------------------------------------------- the attention layer
def test_layer_paths_agree_with_dropout_in_eval():
    torch.manual_seed(0)
    layer = FourierMultiHeadAttention(4, 32, max_number_of_keys=32, position_vector_size=16).eval()
    x = torch.randn(7, 2, 32)
    torch.testing.assert_close(layer(query=x, key=x, value=x, need_weights=True), layer(query=x, key=x, value=x))


def test_layer_dropout_training_path_runs():
    torch.manual_seed(0)
    layer = FourierMultiHeadAttention(4, 32, dropout_prob=0.5, max_number_of_keys=32, position_vector_size=16).train()
    x = torch.randn(7, 2, 32)
    layer(query=x, key=x, value=x).sum().backward()
    assert layer.positions.rotation_matrix.grad.abs().sum() > 0


def test_layer_trains_on_copy_back_task():
    "y_i = x_{i-2} under a causal mask: impossible without positions; the loss must fall well below plain MHA's."
    def train(model, steps=120, n=16, batch=8, d=16, shift=2):
        torch.manual_seed(1)
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
        for _ in range(steps):
            x = torch.randn(n, batch, d)
            loss = F.mse_loss(model(query=x, key=x, value=x, mask=causal)[shift:], x[:-shift])
            opt.zero_grad(); loss.backward(); opt.step()
        return loss.item()
    torch.manual_seed(0)
    fourier = train(FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=16, position_vector_size=16))
    torch.manual_seed(0)
    plain = train(MultiHeadAttention(2, 16, dropout_prob=0.0))
    assert fourier < 0.6 * plain, (fourier, plain)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias_shape", [(1, 3, 6, 9), (2, 3, 6, 9), (1, 1, 6, 9), (2, 1, 6, 9)])
def test_sdpa_bias_matches_math_path(bias_shape, threads):
    "The blockwise backward (thread pool over heads) against SDPA's math path, every bias broadcast; threads restored."
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 3, n, 8, generator=g, requires_grad=True) for n in (6, 9, 9))
        bias = torch.randn(*bias_shape, generator=g)
        bias[..., 1, 3] = float('-inf')
        bias.requires_grad_()
        go = torch.randn(2, 3, 6, 8, generator=g)
        res = []
        for f in (lambda *a: sdpa_bias(*a, blockwise=True), lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], scale=a[4])):
            out = f(q, k, v, bias, 0.4)
            res.append([out, *torch.autograd.grad((out * go).sum(), (q, k, v, bias))])
        for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("heads_bias", [4, 1])
def test_sdpa_bias_thread_pool_path(heads_bias):
    "Large enough (batch*heads*q*k >= 2**22) for the worker pool; per-head and head-shared bias."
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 1024, 8, generator=g, requires_grad=True) for _ in range(3))
        bias = torch.randn(1, heads_bias, 1024, 1024, generator=g, requires_grad=True)
        res = []
        for f in (lambda *a: sdpa_bias(*a), lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], scale=a[4])):
            out = f(q, k, v, bias, 0.3)
            res.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v, bias))])
        for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- masks: the keys a mask hides are skipped
import relpos.fourier as fourier_mod
from unittest import mock
from torch.utils._python_dispatch import TorchDispatchMode
from relpos.mha import block_key_ranges

MASK_KINDS = ['causal', 'causal_memory', 'padding', 'causal_padding', 'random_empty_rows']


def make_mask(kind, batch, nq, nk, g):
    "bool `[batch|1, 1, nq, nk]`, True = may attend, as `FourierMultiHeadAttention.sdpa` builds it (fully masked rows kept)."
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None]
    lengths = torch.randint(1, nk + 1, (batch, 1, 1, 1), generator=g)
    if kind == 'causal': return (j <= i)[None, None]                        # needs nq == nk
    if kind == 'causal_memory': return (j <= i + nk - nq)[None, None]
    if kind == 'padding': return j[None, None] < lengths
    if kind == 'causal_padding': return ((j <= i + nk - nq)[None, None] & (j[None, None] < lengths))
    m = torch.rand(batch, 1, nq, nk, generator=g) > 0.4
    m[:, :, torch.randint(0, nq, (2,), generator=g)] = False                # fully masked rows
    return m


def masked_reference(q, k, v, bias, scale, mask):
    "SDPA's math path with the mask as -inf in the bias; fully masked rows attend to every key (the layer zeroes them)."
    mask = mask | ~mask.any(-1, keepdim=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~mask, float('-inf')), scale=scale)


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(MASK_KINDS), nq=st.integers(1, 70), mem=st.integers(0, 20), batch=st.integers(1, 2),
       batch_bias=st.booleans(), heads_bias=st.sampled_from([1, 2]), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 1000))
def test_property_sdpa_bias_mask_matches_math_path(kind, nq, mem, batch, batch_bias, heads_bias, dtype, seed):
    "Blocks of 16 rows (many blocks at small sizes), each over its own keys: output and all gradients as SDPA's math path."
    nk = nq if kind == 'causal' else nq + mem
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 2, n, 4, generator=g, dtype=dtype).requires_grad_() for n in (nq, nk, nk))
    bias = torch.randn(batch if batch_bias else 1, heads_bias, nq, nk, generator=g, dtype=dtype).requires_grad_()
    mask = make_mask(kind, batch, nq, nk, g)
    go = torch.randn(batch, 2, nq, 4, generator=g, dtype=dtype)
    res = []
    with mock.patch.object(fourier_mod, '_BLOCK_SCORES', 1):
        for f in (lambda *a: sdpa_bias(*a[:5], blockwise=True, mask=a[5] | ~a[5].any(-1, keepdim=True)), masked_reference):
            out = f(q, k, v, bias, 0.4, mask)
            res.append([out, *torch.autograd.grad((out * go).sum(), (q, k, v, bias))])
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(MASK_KINDS), n=st.integers(256, 300), mem=st.integers(0, 40), batch=st.integers(1, 2),
       seed=st.integers(0, 1000))
def test_property_layer_masked_fast_matches_readable(kind, n, mem, batch, seed):
    "The layer under every kind of mask: fast path (blocks of 16 rows) == readable path, the rotation matrix's gradient included."
    nk = n if kind == 'causal' else n + mem
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=64, position_vector_size=8)
    with torch.no_grad(): layer.positions.rotation_matrix.normal_()
    x, mem_x = torch.randn(n, batch, 16, generator=g), torch.randn(nk, batch, 16, generator=g)
    mask = make_mask(kind, batch, n, nk, g)[:, 0].permute(1, 2, 0)           # layer layout [nq, nk, batch]
    w = torch.randn(n, batch, 16, generator=g)
    res = []
    with mock.patch.object(fourier_mod, '_BLOCK_SCORES', 1):
        for need_weights in (True, False):
            layer.zero_grad()
            out = layer(query=x, key=mem_x, value=mem_x, mask=mask, need_weights=need_weights)
            (out * w).sum().backward()
            res.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ['causal', 'causal_memory', 'padding'])
def test_gradcheck_sdpa_bias_with_mask(kind):
    g = torch.Generator().manual_seed(0)
    nq, nk = 33, 33 if kind == 'causal' else 37
    q, k, v = (torch.randn(2, 1, n, 2, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    bias = torch.randn(1, 1, nq, nk, generator=g, dtype=torch.float64, requires_grad=True)
    mask = make_mask(kind, 2, nq, nk, g)
    with mock.patch.object(fourier_mod, '_BLOCK_SCORES', 1):            # blocks of 16 rows: 3 blocks, 3 key ranges
        assert torch.autograd.gradcheck(lambda *a: sdpa_bias(*a, 0.5, blockwise=True, mask=mask), (q, k, v, bias))
        assert torch.autograd.gradgradcheck(lambda *a: sdpa_bias(*a, 0.5, blockwise=True, mask=mask), (q, k, v, bias))


class _CountScores(TorchDispatchMode):
    "Sums the output sizes of `aten.mm` (the backward's score-sized products) and records each flash call's is_causal."
    def __init__(self):
        super().__init__(); self.mm_out, self.is_causal = 0, []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.is_causal.append(args[4] if len(args) > 4 else kwargs.get('is_causal', False))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out):
            self.mm_out += args[0].shape[0] * args[1].shape[1]
        return out


@pytest.mark.parametrize("kind", ['causal', 'causal_memory', None])
def test_masked_keys_are_skipped(kind):
    "Counted, not timed: under a causal mask the backward's matrix products cover about half the scores, and the forward's flash call skips the upper blocks."
    batch, heads, n, mem, d = 2, 2, 512, 64, 8
    nk = n if kind != 'causal_memory' else n + mem
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, m, d, generator=g, requires_grad=True) for m in (n, nk, nk))
    bias = torch.randn(1, heads, n, nk, generator=g, requires_grad=True)
    mask = None if kind is None else make_mask(kind, batch, n, nk, g)
    with mock.patch.object(fourier_mod, '_BLOCK_SCORES', 2**14):        # blocks of 32 rows
        out = sdpa_bias(q, k, v, bias, 0.3, mask=mask)
        with _CountScores() as count:
            out.sum().backward()
    c = max(16, 2**14 // nk)
    visited = sum((i1 - i0) * (k1 - k0) for i0, i1, k0, k1 in block_key_ranges(mask, n, nk, c))
    # per (batch, head) and block: P = [q | -lse] @ [k | 1]^T and dP = [dO | -D] @ [v | 1]^T ([rows, keys]: the
    # visited scores), and dQ = dS @ K ([rows, d]); dV and dK are addmm_, not counted
    assert count.mm_out == batch * heads * (2 * visited + n * d)
    full = n * nk
    if kind is None: assert visited == full
    else: assert visited < (0.56 if kind == 'causal' else 0.6) * full     # about half, plus the diagonal blocks
    with _CountScores() as count:
        sdpa_bias(q, k, v, bias, 0.3, mask=mask)
    assert count.is_causal == [kind == 'causal']


def test_sdpa_bias_mask_under_torch_func_and_bad_masks():
    "torch.func takes the readable reference, mask included; a mask of the wrong shape or dtype is refused by name."
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 4, generator=g) for n in (300, 300, 300))
    bias = torch.randn(1, 2, 300, 300, generator=g)
    mask = make_mask('causal', 2, 300, 300, g)
    want = torch.autograd.grad(masked_reference(q, k, v, bias.requires_grad_(), 0.3, mask).square().sum(), bias)[0]
    got = torch.func.grad(lambda b: sdpa_bias(q, k, v, b, 0.3, mask=mask).square().sum())(bias.detach())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"mask must have shape \[batch or 1, 1, seq_q or 1, seq_k\]"):
        sdpa_bias(q, k, v, bias, 0.3, mask=mask[0])
    with pytest.raises(TypeError, match="mask must be a bool"):
        sdpa_bias(q, k, v, bias, 0.3, mask=mask.float())


@pytest.mark.parametrize("mode", ['no_grad', 'inference_mode', 'frozen'])
@pytest.mark.parametrize("kind", ['causal', 'causal_padding', 'causal_memory', 'random_empty_rows'])
def test_layer_forward_only_under_masks(mode, kind):
    "Nothing to differentiate (evaluation, inference): a causal mask with padding runs the flash kernel with is_causal, the plain causal one the Toeplitz kernel; any mask gives the readable path's numbers."
    n, batch = 64, 2
    nk = n if kind in ('causal', 'causal_padding') else n + 16
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=64, position_vector_size=8)
    with torch.no_grad(): layer.positions.rotation_matrix.normal_()
    x, kv = torch.randn(n, batch, 16, generator=g), torch.randn(nk, batch, 16, generator=g)
    if kind == 'causal_padding':
        mask = make_mask('causal', batch, n, nk, g) & (torch.arange(nk) < torch.tensor([50, 64])[:, None, None, None])
    else:
        mask = make_mask(kind, batch, n, nk, g)
    mask = mask[:, 0].permute(1, 2, 0)                                       # layer layout [nq, nk, batch]
    want = layer(query=x, key=kv, value=kv, mask=mask, need_weights=True).detach()
    if mode == 'frozen': layer.requires_grad_(False)
    ctx = {'no_grad': torch.no_grad, 'inference_mode': torch.inference_mode, 'frozen': torch.enable_grad}[mode]
    with ctx(), _CountScores() as count:
        got = layer(query=x, key=kv, value=kv, mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if kind == 'causal':   # the distance table to relpos.t5's Toeplitz kernel: flash calls over bias blocks, no is_causal
        assert count.is_causal and not any(count.is_causal), count.is_causal
    else:
        assert count.is_causal == ([True] if kind == 'causal_padding' else [False] * len(count.is_causal))


def test_empty_sequences_with_mask_do_not_reach_the_kernel():
    "The flash kernel divides by zero on an empty sequence (SIGFPE kills the process): run in a child process."
    import subprocess, sys
    code = """
import torch
from relpos.fourier import FourierMultiHeadAttention, sdpa_bias
layer = FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=16, position_vector_size=8).eval()
for nq, nk in [(0, 5), (0, 0)]:
    for ctx in (torch.no_grad, torch.enable_grad):
        x, kv = torch.randn(nq, 2, 16), torch.randn(nk, 2, 16)
        with ctx(): assert layer(query=x, key=kv, value=kv, mask=torch.ones(nq, nk, 1, dtype=torch.bool)).shape == (nq, 2, 16)
for nq, nk in [(0, 5), (3, 0)]:
    q, k, v = torch.randn(1, 2, nq, 4, requires_grad=True), torch.randn(1, 2, nk, 4), torch.randn(1, 2, nk, 4)
    b = torch.randn(1, 2, nq, nk, requires_grad=True)
    for m in (None, torch.ones(1, 1, nq, nk, dtype=torch.bool)):
        sdpa_bias(q, k, v, b, 0.3, blockwise=True, mask=m).sum().backward()
print('ok')
"""
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ})
    assert r.returncode == 0 and r.stdout.strip() == 'ok', (r.returncode, r.stderr[-2000:])


@settings(max_examples=15, deadline=None)
@given(causal=st.booleans(), nq=st.integers(1, 40), mem=st.integers(0, 12), batch=st.integers(1, 2),
       seed=st.integers(0, 1000))
def test_property_layer_toeplitz_path_matches_readable(causal, nq, mem, batch, seed):
    "No mask or the causal one: the layer hands the distance table to relpos.bias's Toeplitz kernel; float64 values and every gradient equal the readable path's."
    from relpos import bias as bias_mod
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = FourierMultiHeadAttention(2, 16, dropout_prob=0.0, max_number_of_keys=64, position_vector_size=8).double()
    with torch.no_grad(): layer.positions.rotation_matrix.normal_()
    x, kv = torch.randn(nq, batch, 16, generator=g, dtype=torch.float64), torch.randn(nk, batch, 16, generator=g, dtype=torch.float64)
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[:, :, None] if causal else None
    w = torch.randn(nq, batch, 16, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (True, False):
        layer.zero_grad()
        with mock.patch.object(bias_mod, 'toeplitz_attention', wraps=bias_mod.toeplitz_attention) as spy:
            out = layer(query=x, key=kv, value=kv, mask=mask, need_weights=need_weights)
        assert spy.call_count == (0 if need_weights else 1)
        (out * w).sum().backward()
        res.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_layer_toeplitz_path(causal):
    "float64 gradcheck of the layer's Toeplitz path: inputs and the rotation matrix."
    torch.manual_seed(0)
    layer = FourierMultiHeadAttention(2, 8, dropout_prob=0.0, max_number_of_keys=16, position_vector_size=4).double()
    x = torch.randn(5, 1, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(7, 1, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)[:, :, None] if causal else None
    rot = layer.positions.rotation_matrix
    def f(x, kv, r):
        return torch.func.functional_call(layer, {'positions.rotation_matrix': r}, (), dict(query=x, key=kv, value=kv, mask=mask))
    assert torch.autograd.gradcheck(f, (x, kv, rot.detach().clone().requires_grad_()))



@pytest.mark.parametrize('fast', [True, False])
@pytest.mark.parametrize('mode', ['bfloat16 module', 'autocast'])
def test_bf16_rotation_matrix_gradient_close_to_float32(fast, mode):
    "At n = 2048 the gradient sums over diagonals of up to 2048 terms: they run in float32, only the bias is bf16."
    import copy
    torch.manual_seed(0)
    pos = RelativeFourierPositions(2, 1024, 32)
    with torch.no_grad(): pos.rotation_matrix.normal_()
    m = pos if mode == 'autocast' else copy.deepcopy(pos).to(torch.bfloat16)
    g = torch.randn(1, 2, 2048, 2048)
    for loss in (lambda b: (b.float() * g).sum(), lambda b: b.float().square().sum()):
        ref = torch.autograd.grad(loss(pos(2048, 2048, fast=fast)), pos.rotation_matrix)[0]
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=mode == 'autocast'):
            out = m(2048, 2048, fast=fast)
        assert out.dtype == (torch.float32 if mode == 'autocast' else torch.bfloat16)
        got = torch.autograd.grad(loss(out), m.rotation_matrix)[0].float()
        # bf16 keeps 8 significant bits: the parameters (square loss) and the gradient are rounded by up to 2**-9 each
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


@pytest.mark.parametrize('mask', ['none', 'causal'])
@pytest.mark.parametrize('mode', ['bfloat16 module', 'autocast'])
def test_bf16_layer_rotation_matrix_gradient_close_to_float32(mask, mode):
    "The layer's Toeplitz path in bf16: the table's gradient (diagonal sums of n = 2048 terms) is summed in float32."
    torch.manual_seed(0)
    n = 2048
    att = FourierMultiHeadAttention(2, 32, 0.0, max_number_of_keys=1024, position_vector_size=32)
    with torch.no_grad(): att.positions.rotation_matrix.normal_()
    m = att if mode == 'autocast' else copy.deepcopy(att).to(torch.bfloat16)
    x = torch.randn(n, 1, 32)
    mk = None if mask == 'none' else torch.ones(n, n, dtype=torch.bool).tril()[..., None]
    def grad(layer, dtype, autocast, need_weights=False):
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            y = layer(query=x.to(dtype), key=x.to(dtype), value=x.to(dtype), mask=mk, need_weights=need_weights)
        return torch.autograd.grad((y.float() * x).sum(), layer.positions.rotation_matrix)[0].float()
    ref = grad(att, torch.float32, False)
    err = {nw: ((grad(m, torch.float32 if mode == 'autocast' else torch.bfloat16, mode == 'autocast', nw) - ref).norm()
                / ref.norm()).item() for nw in (False, True)}
    # what bf16 justifies: the readable path's error (the attention's own gradient in bf16, about 1% here);
    # the Toeplitz path summed its diagonals in bf16 before and came out 3 to 8 times further off
    assert err[False] < 1.5 * err[True] and err[True] < 3e-2, err

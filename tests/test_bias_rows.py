"""The bias methods' blocked path for position ids and any mask (`relpos.bias.bias_rows_attention`, chapter 3b): ALiBi,
T5, KERPLE and FIRE with batch or shared ids, packed documents, padding masks and several blocks of query rows give the
readable path's values and gradients (float64, hypothesis; gradcheck); gradients of gradients and `torch.func` give the
readable path's too; and autograd keeps no tensor of n_q x n_k elements for a forward with grad, in a layer and in a
DecoderLM training step."""
from unittest import mock
import pytest
import torch
from hypothesis import given, settings, strategies as st

import relpos.bias as bias_mod
from relpos.bias import bias_rows_attention
from relpos.mha import packed_causal_mask, packed_position_ids
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.t5 import T5MultiHeadAttention
from relpos.kerple import KerpleMultiHeadAttention
from relpos.fire import FireMultiHeadAttention
from relpos.models import DecoderLM

METHODS = ('alibi', 'alibi_bidirectional', 't5', 't5_bidirectional', 'kerple_log', 'kerple_power', 'fire')


def layer(method, heads=3, d_model=24, seed=0, kv_heads=None):
    "A float64 layer of `method` whose every parameter is moved off its initial value."
    torch.manual_seed(seed)
    gqa = {} if kv_heads is None else {'kv_heads': kv_heads}
    if method.startswith('alibi'):
        m = ALiBiMultiHeadAttention(heads, d_model, dropout_prob=0.0, bidirectional=method.endswith('bidirectional'), **gqa)
    elif method.startswith('t5'):
        m = T5MultiHeadAttention(heads, d_model, dropout_prob=0.0, num_buckets=8, max_distance=12,
                                 bidirectional=method.endswith('bidirectional'), **gqa)
    elif method.startswith('kerple'):
        m = KerpleMultiHeadAttention(heads, d_model, dropout_prob=0.0, kernel=method.split('_')[1], **gqa)
    else:
        m = FireMultiHeadAttention(heads, d_model, dropout_prob=0.0, init_L=3.0)   # the normaliser acts from position 3
    m = m.double()
    with torch.no_grad():
        for p in m.parameters(): p.add_(0.2 * torch.randn_like(p))
    positions = getattr(m, 'positions', None)
    if hasattr(positions, 'project_'): positions.project_()   # KERPLE: back inside its bounds
    return m


def ordered(method):
    "Whether the layer needs ids that grow along what a query sees (causal ALiBi, decoder T5)."
    return method in ('alibi', 't5')


def inputs(method, b, nq, nk, ids_kind, mask_kind, seed):
    "`(position_ids or None, mask [sq|1, sk, b|1] or None)` of the kinds asked for."
    g = torch.Generator().manual_seed(seed)
    ids = mask = None
    if ids_kind == 'packed':   # documents of random lengths, each row its own split; ids restart at 0
        docs = torch.stack([torch.randint(0, 3, (nk,), generator=g).sort().values for _ in range(b)])
        ids = packed_position_ids(docs)
        mask = packed_causal_mask(docs, nq, causal=ordered(method) or bool(seed % 2))
    elif ids_kind in ('batch', 'one'):   # growing ids with gaps (padding between tokens), per row or shared
        rows = b if ids_kind == 'batch' else 1
        ids = torch.randint(0, 3, (rows, nk), generator=g).cumsum(-1)
    if mask_kind == 'padding':   # random keys hidden, one query that sees nothing
        pad = torch.rand(nq, nk, b, generator=g) > 0.3
        pad[nq // 2, :, b - 1] = False
        if ordered(method): pad &= torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None]
        mask = pad if mask is None else mask & pad
    elif mask_kind == 'causal' and mask is None:
        mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None]
    if mask is None and ordered(method): mask = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None]
    return ids, mask


def run(m, x, kv, mask, ids, need_weights, block_scores=None):
    "Output and the gradients of x, kv and every parameter, for a fixed cotangent."
    x, kv = x.detach().requires_grad_(), kv.detach().requires_grad_()
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', block_scores or bias_mod.BIAS_BLOCK_SCORES):
        out = m(query=x, key=kv, value=kv, mask=mask, position_ids=ids, need_weights=need_weights)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    params = [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * w).sum(), [x, kv] + params, allow_unused=True)
    return [out.detach()] + [None if g is None else g.detach() for g in grads]


def assert_same(a, b, tol=1e-9):
    for u, v in zip(a, b):
        if u is None or v is None:   # a parameter the output does not depend on (FIRE's b2 under a softmax: ~0)
            w = v if u is None else u
            assert w is None or w.abs().max() <= tol
            continue
        assert (u - v).abs().max() <= tol * (1 + v.abs().max()), (u - v).abs().max()


@settings(max_examples=60, deadline=None)
@given(method=st.sampled_from(METHODS), b=st.integers(1, 3), nq=st.integers(1, 9), memory=st.integers(0, 5),
       ids_kind=st.sampled_from(['none', 'batch', 'one', 'packed']), mask_kind=st.sampled_from(['none', 'causal', 'padding']),
       rows=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_fast_equals_readable(method, b, nq, memory, ids_kind, mask_kind, rows, seed):
    "Fast path (blocks of `rows` query rows) == readable path: values and the gradients of the inputs and every parameter."
    nk = nq + memory
    ids, mask = inputs(method, b, nq, nk, ids_kind, mask_kind, seed)
    m = layer(method, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x, kv = torch.randn(nq, b, 24, generator=g, dtype=torch.float64), torch.randn(nk, b, 24, generator=g, dtype=torch.float64)
    kv[memory:] = x   # self-attention after a memory
    with mock.patch.object(bias_mod, 'bias_rows_attention', wraps=bias_mod.bias_rows_attention) as spy:
        fast = run(m, x, kv, mask, ids, False, rows * nk)
    if ids is not None or mask_kind == 'padding': assert spy.call_count == 1   # the blocked path ran
    assert_same(fast, run(m, x, kv, mask, ids, True))


@pytest.mark.parametrize('method', METHODS)
def test_without_the_fused_kernel(method):
    "Where the fused CPU kernel is missing (or off CPU), the blocks run SDPA and autograd's backward: the same values and gradients."
    m = layer(method)
    ids, mask = inputs(method, 2, 9, 12, 'packed', 'padding', 5)
    x = torch.randn(9, 2, 24, dtype=torch.float64); kv = torch.randn(12, 2, 24, dtype=torch.float64); kv[3:] = x
    with mock.patch.object(bias_mod, '_flash_cpu', None):
        fast = run(m, x, kv, mask, ids, False, 2 * 12)
    assert_same(fast, run(m, x, kv, mask, ids, True))


@pytest.mark.parametrize('method', ['alibi', 't5', 'kerple_power'])
def test_grouped_query_heads(method):
    "kv_heads < heads on the blocked path (packed ids, padding): the readable path's values and gradients."
    m = layer(method, heads=4, d_model=32, kv_heads=2)
    ids, mask = inputs(method, 2, 8, 11, 'packed', 'padding', 3)
    x = torch.randn(8, 2, 32, dtype=torch.float64); kv = torch.randn(11, 2, 32, dtype=torch.float64); kv[3:] = x
    assert_same(run(m, x, kv, mask, ids, False, 2 * 11), run(m, x, kv, mask, ids, True))


@pytest.mark.parametrize('method', METHODS)
def test_bias_rows_are_rows_of_the_whole_bias(method):
    "Each layer's `bias_rows(ids, n_q, i0, i1, k0, k1)` equals rows i0:i1, columns k0:k1 of the bias the readable path builds, for batch and shared ids."
    m = layer(method)
    for ids in (torch.randint(0, 3, (2, 10)).cumsum(-1), torch.arange(10)[None] * 2):
        whole = m.position_bias(6, 10, ids).detach()
        owner = m if method.startswith('alibi') else m.positions
        for i0, i1, k0, k1 in [(0, 6, 0, 10), (0, 1, 0, 10), (2, 5, 3, 8), (5, 6, 9, 10)]:
            with torch.no_grad(): got = owner.bias_rows(ids, 6, i0, i1, k0, k1)
            assert got.shape == (ids.shape[0], 3, i1 - i0, k1 - k0)
            assert (got - whole[:, :, i0:i1, k0:k1]).abs().max() <= 1e-12


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('kind', ['packed', 'padding'])
def test_gradcheck(method, kind):
    "float64 gradcheck of `bias_rows_attention` with the layer's `bias_rows` (blocks of 2 rows): q, k, v and the bias's parameters."
    m = layer(method, heads=2, d_model=8)
    nq, nk, b = 5, 7, 2
    ids, mask = inputs(method, b, nq, nk, 'packed' if kind == 'packed' else 'batch', 'padding' if kind == 'padding' else 'none', 1)
    owner = m if method.startswith('alibi') else m.positions
    params = tuple(p.detach().clone().requires_grad_() for p in owner.bias_params())
    if method == 'fire': params = tuple(p if n not in (2, 6) else p.detach() for n, p in enumerate(params))   # init_L fixed; b2: no effect
    rows = lambda i0, i1, k0, k1, *ps: owner.bias_rows(ids, nq, i0, i1, k0, k1, *ps)
    msk = mask.permute(2, 0, 1).unsqueeze(1)                     # [b|1, 1, sq|1, sk]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    f = lambda q, k, v, *ps: bias_rows_attention(q, k, v, rows, ps, 0.5, msk)
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 2 * nk):
        assert torch.autograd.gradcheck(f, (q, k, v) + params)


def _grads_of_grads(m, x, kv, mask, ids, need_weights):
    x = x.detach().requires_grad_()
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 2 * kv.shape[0]):
        out = m(query=x, key=kv, value=kv, mask=mask, position_ids=ids, need_weights=need_weights)
        gx, = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        params = [p for p in m.parameters() if p.requires_grad]
        return torch.autograd.grad(gx.pow(2).sum(), [x] + params, allow_unused=True)


@pytest.mark.parametrize('method', METHODS)
def test_gradients_of_gradients(method):
    "backward(create_graph=True) through the blocked path: second derivatives equal the readable path's."
    m = layer(method)
    ids, mask = inputs(method, 2, 6, 9, 'packed', 'padding', 2)
    x, kv = torch.randn(6, 2, 24, dtype=torch.float64), torch.randn(9, 2, 24, dtype=torch.float64)
    assert_same(_grads_of_grads(m, x, kv, mask, ids, False), _grads_of_grads(m, x, kv, mask, ids, True), 1e-8)


@pytest.mark.parametrize('method', METHODS)
def test_torch_func(method):
    "torch.func.grad through the fast path with position ids and a padding mask: the readable path's gradient."
    m = layer(method)
    ids, mask = inputs(method, 2, 6, 9, 'batch', 'padding', 4)
    x, kv = torch.randn(6, 2, 24, dtype=torch.float64), torch.randn(9, 2, 24, dtype=torch.float64)
    params = {k: v.detach() for k, v in m.named_parameters()}
    def loss(params, need_weights):
        out = torch.func.functional_call(m, params, (), dict(query=x, key=kv, value=kv, mask=mask, position_ids=ids,
                                                             need_weights=need_weights))
        return out.pow(2).sum()
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 2 * 9):
        got = torch.func.grad(loss)(params, False)
    want = torch.func.grad(loss)(params, True)
    for k in params: assert (got[k] - want[k]).abs().max() <= 1e-9 * (1 + want[k].abs().max()), k


# ---------------------------------------------------------------- memory
def saved_float_sizes(fn):
    "`fn()` under a hook that records the elements of every floating-point tensor autograd saves; returns (result, sizes)."
    sizes = []
    def pack(t):
        if t.is_floating_point(): sizes.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sizes


@pytest.mark.parametrize('method', METHODS)
@pytest.mark.parametrize('kind', ['packed', 'padding', 'ids'])
def test_no_saved_tensor_holds_the_scores_of_a_head(method, kind):
    "A forward with grad at n = 512, blocks of 16 rows: no tensor autograd saves holds n_q x n_k elements (one head's bias)."
    n, b = 512, 2
    m = layer(method, heads=4, d_model=32).float().train()
    ids, mask = inputs(method, b, n, n, {'packed': 'packed', 'padding': 'none', 'ids': 'batch'}[kind],
                       'padding' if kind == 'padding' else 'none', 0)
    x = torch.randn(n, b, 32, requires_grad=True)
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 16 * n):
        out, sizes = saved_float_sizes(lambda: m(query=x, key=x, value=x, mask=mask, position_ids=ids))
        out.pow(2).mean().backward()   # the backward runs (and builds the blocks again)
    assert max(sizes) < n * n, f"autograd keeps a tensor of {max(sizes)} elements (n_q x n_k = {n * n})"
    assert x.grad.isfinite().all()


def test_dropout_keeps_memory_bounded():
    "Dropout in training (each block checkpointed): no saved tensor of n_q x n_k elements, and the backward runs."
    n = 256
    m = T5MultiHeadAttention(4, 32, dropout_prob=0.1).train()
    ids, mask = inputs('t5', 2, n, n, 'packed', 'none', 0)
    x = torch.randn(n, 2, 32, requires_grad=True)
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 16 * n):
        out, sizes = saved_float_sizes(lambda: m(query=x, key=x, value=x, mask=mask, position_ids=ids))
        out.sum().backward()
    assert max(sizes) < n * n and x.grad.isfinite().all()


@pytest.mark.parametrize('position', ['alibi', 't5', 'kerple', 'fire'])
def test_decoder_training_step_with_packed_documents_keeps_memory_bounded(position):
    "A DecoderLM training step at n = 512: packed documents through its layers (packed mask, restarted ids), and left padding through `forward`; no saved tensor holds n x n elements."
    n, b = 512, 2
    torch.manual_seed(0)
    lm = DecoderLM(n_vocab=17, d_model=32, heads=4, n_layers=2, position=position, max_len=n, dropout=0.0)
    tokens = torch.randint(0, 17, (b, n))
    docs = torch.tensor([[0] * 200 + [1] * 150 + [2] * 162, [0] * 300 + [1] * 212])
    ids, mask = packed_position_ids(docs), packed_causal_mask(docs).permute(2, 0, 1)   # [b, n, n]

    def packed_step():
        x = lm._embed(tokens)
        for blk in lm.layers: x = blk(x, None, mask, position_ids=ids)
        return torch.nn.functional.cross_entropy(lm._logits(x)[:, :-1].reshape(-1, 17), tokens[:, 1:].reshape(-1))

    keep = torch.ones(b, n, dtype=torch.bool); keep[1, :40] = False                    # row 1: left padding
    padded_step = lambda: lm(input_ids=tokens, attention_mask=keep, position_ids=(keep.cumsum(-1) - 1).clamp(min=0),
                             labels=tokens).loss
    for step in (packed_step, padded_step):
        lm.zero_grad()
        with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 16 * n):
            loss, sizes = saved_float_sizes(step)
            loss.backward()
        assert max(sizes) < n * n, f"{step.__name__}: autograd keeps a tensor of {max(sizes)} elements (n x n = {n * n})"
        assert all(p.grad is None or p.grad.isfinite().all() for p in lm.parameters())


def test_torch_compile():
    "Under torch.compile the blocks are checkpointed: the readable path's values and gradient (packed ids, several blocks)."
    m = layer('t5').float()
    ids, mask = inputs('t5', 1, 32, 32, 'packed', 'none', 0)
    x = torch.randn(32, 1, 24)
    w = torch.linspace(-1, 1, x.numel()).view(x.shape)
    def out_and_grad(f):
        xg = x.clone().requires_grad_()
        out = f(xg)
        return out.detach(), torch.autograd.grad((out * w).sum(), xg)[0]
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 8 * 32):
        want = out_and_grad(lambda x: m(query=x, key=x, value=x, mask=mask, position_ids=ids, need_weights=True))
        got = out_and_grad(torch.compile(lambda x: m(query=x, key=x, value=x, mask=mask, position_ids=ids)))
    assert (got[0] - want[0]).abs().max() <= 1e-5 and (got[1] - want[1]).abs().max() <= 1e-4


# ---------------------------------------------------------------- `toeplitz_attention` where its CPU kernel does not run
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('nq, nk', [(37, 37), (23, 41)])
def test_toeplitz_attention_without_its_kernel_goes_by_blocks(causal, nq, nk):
    "No fused CPU kernel (as on a GPU without FlexAttention): blocks of rows, the readable path's values and gradients (float64)."
    g = torch.Generator().manual_seed(nq + nk)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    table = torch.randn(3, nq + nk - 1, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, nq, 8, generator=g, dtype=torch.float64)
    want_out = bias_mod._toeplitz_attention_reference(q, k, v, table, 0.3, causal)
    want = torch.autograd.grad((want_out * w).sum(), (q, k, v, table))
    with mock.patch.object(bias_mod, '_flash_cpu', None), mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 4 * nk), \
         mock.patch.object(bias_mod, 'bias_rows_attention', wraps=bias_mod.bias_rows_attention) as rows:
        out = bias_mod.toeplitz_attention(q, k, v, table, 0.3, causal)
        got = torch.autograd.grad((out * w).sum(), (q, k, v, table))
    assert rows.called and (out - want_out).abs().max() < 1e-12
    for a, b in zip(got, want): assert (a - b).abs().max() < 1e-12


@pytest.mark.parametrize('method', ['t5', 'kerple_log'])
@pytest.mark.parametrize('dtype, dropout', [(torch.float32, 0.1), (torch.bfloat16, 0.0)])
def test_toeplitz_methods_with_dropout_or_bfloat16_keep_memory_bounded(method, dtype, dropout):
    "T5 and KERPLE, causal, where the Toeplitz CPU kernel does not run (dropout, bfloat16): no saved tensor of n_q x n_k elements per head."
    n = 256
    m = layer(method, heads=4, d_model=32).to(dtype)
    if dropout: m.dropout.p = dropout; m.train()
    mask = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
    x = torch.randn(n, 2, 32, dtype=dtype, requires_grad=True)
    with mock.patch.object(bias_mod, 'BIAS_BLOCK_SCORES', 16 * n):
        out, sizes = saved_float_sizes(lambda: m(query=x, key=x, value=x, mask=mask))
        out.float().sum().backward()
    assert max(sizes) < n * n, f"autograd keeps a tensor of {max(sizes)} elements (n_q x n_k = {n * n})"
    assert x.grad.isfinite().all()

"""Tests for relpos.memorizing (chapter nbs/10_memorizing.ipynb): KNNMemory against brute-force top-k (eviction,
partial resets, chunk merges), refused calls, state_dict round trips, modes; MemorizingAttention's gradients,
memory handling and layouts."""
import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.memorizing import KNNMemory, MemorizingAttention, knn_attention
from relpos.relative_mha import RelativeMultiHeadAttention
from relpos.context_choice import ContextChoiceLinear


def brute_force(memory, queries, top_k):
    "Reference top-k: for each (b, h) one matmul over the filled slots 0..size-1 and topk; scores too."
    b, h, n_q, d = queries.shape
    index = torch.zeros(b, h, n_q, top_k, dtype=torch.long)
    valid = torch.zeros(b, h, n_q, top_k, dtype=torch.bool)
    scores = torch.full((b, h, n_q, top_k), float('-inf'), dtype=queries.dtype)
    for bb in range(b):
        n = int(memory.size[bb]); k = min(n, top_k)
        if k == 0: continue
        s, i = (queries[bb] @ memory.keys[bb, :, :n].transpose(-1, -2)).topk(k, dim=-1)
        index[bb, ..., :k], valid[bb, ..., :k], scores[bb, ..., :k] = i, True, s
    return index, valid, scores


def check_against_brute_force(memory, queries, top_k):
    keys, values, valid = memory.search(queries, top_k)
    _, ref_valid, ref_scores = brute_force(memory, queries, top_k)
    assert torch.equal(valid, ref_valid)
    # compare scores, not indices: equal scores (ties) may come back in either order
    scores = torch.einsum('bhqd,bhqkd->bhqk', queries, keys)
    torch.testing.assert_close(scores[valid], ref_scores[ref_valid], rtol=1e-5, atol=1e-5)
    assert (keys[~valid] == 0).all() and (values[~valid] == 0).all()
    # each retrieved key is stored with its own value (values = 3 * keys below)
    torch.testing.assert_close(values, 3 * keys)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), d=st.integers(1, 6), capacity=st.integers(1, 40),
       chunk=st.one_of(st.none(), st.integers(1, 17)), top_k=st.integers(1, 50),
       ops=st.lists(st.tuples(st.sampled_from(['add', 'reset', 'clear']), st.integers(0, 60), st.integers(0, 7)),
                    min_size=1, max_size=8),
       seed=st.integers(0, 2 ** 16))
def test_search_equals_brute_force(batch, heads, d, capacity, chunk, top_k, ops, seed):
    "Random add/reset/clear sequences (wrap-around, n > capacity, partial resets), any chunking: exact top-k."
    g = torch.Generator().manual_seed(seed)
    memory = KNNMemory(batch, heads, d, capacity, chunk_size=chunk, dtype=torch.float64)
    for op, n, bits in ops:
        if op == 'add':
            k = torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64)
            memory.add(k, 3 * k)
        elif op == 'reset':
            memory.reset(torch.tensor([(bits >> i) & 1 == 1 for i in range(batch)]))
        else:
            memory.clear()
        q = torch.randn(batch, heads, 4, d, generator=g, dtype=torch.float64)
        check_against_brute_force(memory, q, top_k)


def test_eviction_keeps_the_newest():
    m = KNNMemory(1, 1, 1, capacity=5)
    for t in range(12):   # one entry at a time: values t
        m.add(torch.full((1, 1, 1, 1), float(t)), torch.full((1, 1, 1, 1), float(t)))
    assert sorted(m.values.flatten().tolist()) == [7., 8., 9., 10., 11.]
    keys, values, valid = m.search(torch.ones(1, 1, 1, 1), top_k=5)
    assert values.flatten().tolist() == [11., 10., 9., 8., 7.] and valid.all()


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), capacity=st.integers(1, 12), faiss=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(['add', 'add', 'reset', 'clear']), st.integers(0, 30), st.integers(0, 7)),
                    min_size=1, max_size=8))
def test_slot_rule(batch, capacity, faiss, ops):
    "The documented rule, for any sequence of adds (more than capacity at once too): pair t since the reset is in slot t mod capacity."
    if faiss:
        pytest.importorskip('faiss')
        from relpos.memorizing import FaissKNNMemory
        m = FaissKNNMemory(batch, 2, 1, capacity, nlist=1, nprobe=1, train_size=1)
    else:
        m = KNNMemory(batch, 2, 1, capacity)
    count = [0] * batch                              # pairs added to each batch element since its reset
    for op, n, bits in ops:
        if op == 'add':                              # pair t of element b holds the number 1000 * b + t
            t = torch.tensor([[1000. * b + count[b] + i for i in range(n)] for b in range(batch)]).view(batch, 1, n, 1)
            m.add(t.expand(batch, 2, n, 1), -t.expand(batch, 2, n, 1))
            count = [c + n for c in count]
        else:
            which = [(bits >> b) & 1 == 1 or op == 'clear' for b in range(batch)]
            m.reset(torch.tensor(which)) if op == 'reset' else m.clear()
            count = [0 if w else c for c, w in zip(count, which)]
        assert m.next_slot.tolist() == [c % capacity for c in count]
        assert m.size.tolist() == [min(c, capacity) for c in count]
        for b in range(batch):
            for t in range(max(0, count[b] - capacity), count[b]):   # the pairs held
                assert m.keys[b, :, t % capacity, 0].tolist() == [1000. * b + t] * 2, (b, t)
                assert m.values[b, :, t % capacity, 0].tolist() == [-1000. * b - t] * 2, (b, t)
        q = torch.ones(batch, 2, 1, 1)
        if min(count) > 0:                           # and the search still finds the newest (largest) pair first
            keys, _, valid = m.search(q, 1)
            assert keys[:, 0, 0, 0, 0].tolist() == [1000. * b + count[b] - 1 for b in range(batch)]


@pytest.mark.parametrize('backend', ['exact', 'faiss'])
@pytest.mark.parametrize('where', ['keys', 'values'])
@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
def test_non_finite_pairs_refused(backend, where, bad):
    "NaN or inf in a key or value: ValueError naming it and the batch element, nothing written (also past capacity)."
    if backend == 'faiss':
        pytest.importorskip('faiss')
        from relpos.memorizing import FaissKNNMemory
        m = FaissKNNMemory(2, 2, 4, 10, nlist=1, nprobe=1, train_size=3)
    else:
        m = KNNMemory(2, 2, 4, capacity=10)
    torch.manual_seed(0)
    m.add(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4))
    q = torch.randn(2, 2, 3, 4)
    before, found = {n: t.clone() for n, t in m.state_dict().items()}, m.search(q, 4)
    for n in (3, 25):                                 # within capacity, and more than capacity in one call
        pair = {'keys': torch.randn(2, 2, n, 4), 'values': torch.randn(2, 2, n, 4)}
        pair[where][1, 0, n - 1, 2] = bad
        with pytest.raises(ValueError, match=rf'{where} hold NaN or inf in batch elements \[1\]'):
            m.add(pair['keys'], pair['values'])
        for k, t in m.state_dict().items(): assert torch.equal(t, before[k]), k
        for a, b in zip(m.search(q, 4), found): assert torch.equal(a, b)


def test_large_search_crosses_blocks(monkeypatch):
    "Blocks that split both the memories (group) and the slots (chunk) give the brute-force answer."
    import relpos.memorizing as mz
    monkeypatch.setattr(mz, 'SEARCH_BLOCK', 4096)
    torch.manual_seed(0)
    m = KNNMemory(3, 4, 16, capacity=3000)
    k = torch.randn(3, 4, 2500, 16); m.add(k, 3 * k)
    m.reset(torch.tensor([False, True, False])); k = torch.randn(3, 4, 700, 16); m.add(k, 3 * k)
    check_against_brute_force(m, torch.randn(3, 4, 37, 16), 32)


@pytest.mark.parametrize('call, match', [
    (lambda m: m.add(torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8)), 'batch=2'),
    (lambda m: m.add(torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)), 'heads=2'),
    (lambda m: m.add(torch.randn(2, 2, 4, 7), torch.randn(2, 2, 4, 7)), 'head_dim=8'),
    (lambda m: m.add(torch.randn(2, 2, 4, 8).half(), torch.randn(2, 2, 4, 8).half()), 'dtype'),
    (lambda m: m.add(torch.randn(2, 2, 4, 8), torch.randn(2, 2, 3, 8)), 'same shape'),
    (lambda m: m.add(torch.randn(2, 2, 4, 8), None), 'values'),
    (lambda m: m.add(torch.randn(2, 2, 8), torch.randn(2, 2, 8)), 'shape'),
    (lambda m: m.search(torch.randn(2, 2, 4, 7), 3), 'head_dim=8'),
    (lambda m: m.search(torch.randn(2, 2, 4, 8), 0), 'top_k'),
    (lambda m: m.search(torch.randn(2, 2, 4, 8), 2.0), 'top_k'),
    (lambda m: m.search(torch.randn(2, 2, 4, 8), True), 'top_k'),
    (lambda m: m.reset(torch.tensor([True])), 'batch=2'),
    (lambda m: m.reset([True, False]), 'bool'),
])
def test_refused_calls_leave_contents(call, match):
    torch.manual_seed(0)
    m = KNNMemory(2, 2, 8, capacity=10)
    m.add(torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))
    before = {n: t.clone() for n, t in m.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match=match): call(m)
    for n, t in m.state_dict().items(): assert torch.equal(t, before[n]), n


@pytest.mark.parametrize('kwargs, match', [
    (dict(capacity=0), 'capacity'), (dict(capacity=2.5), 'capacity'), (dict(heads=0), 'heads'),
    (dict(batch_size=True), 'batch_size'), (dict(dtype=torch.int64), 'dtype'), (dict(chunk_size=0), 'chunk_size')])
def test_bad_construction(kwargs, match):
    args = dict(batch_size=2, heads=2, head_dim=4, capacity=8)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        KNNMemory(args.pop('batch_size'), args.pop('heads'), args.pop('head_dim'), args.pop('capacity'), **args)


def test_state_dict_round_trip_and_modes():
    torch.manual_seed(0)
    with torch.inference_mode():   # built in inference mode, still writable in training afterwards
        m = KNNMemory(2, 3, 4, capacity=7)
        m.add(torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4))
    m.add(torch.randn(2, 3, 2, 4, requires_grad=True), torch.randn(2, 3, 2, 4))
    assert not m.keys.requires_grad and not m.keys.is_inference()
    m.reset(torch.tensor([False, True]))
    m2 = KNNMemory(2, 3, 4, capacity=7)
    m2.load_state_dict(copy.deepcopy(m.state_dict()))
    q = torch.randn(2, 3, 5, 4)
    for a, b in zip(m.search(q, 9), m2.search(q, 9)): assert torch.equal(a, b)
    m.add(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)); m2.add(*(t for t in [m.keys[:, :, :1].clone()] * 2))
    assert m.size.tolist() == m2.size.tolist() == [7, 1]


def test_knn_attention_empty_rows_are_zero_and_finite():
    q = torch.randn(1, 1, 2, 3, requires_grad=True)
    out, w = knn_attention(q, torch.zeros(1, 1, 2, 4, 3), torch.zeros(1, 1, 2, 4, 3),
                           torch.zeros(1, 1, 2, 4, dtype=torch.bool), 1.0)
    assert (out == 0).all() and (w == 0).all()
    out.sum().backward(); assert q.grad.isfinite().all()


def _mask(n_q, n_k): return (torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q)[..., None]


def _run(layer, xs, starts=None):
    outs = []
    for i, x in enumerate(xs):
        outs.append(layer(query=x, key=x, value=x, mask=_mask(len(x), len(x)),
                          start_of_document=None if starts is None else starts[i]))
    return outs


@pytest.mark.parametrize('gate', ['constant', 'linear'])
@pytest.mark.parametrize('normalize', [True, False])
def test_gradients_reach_queries_and_gate_not_memory(gate, normalize):
    torch.manual_seed(0)
    layer = MemorizingAttention(2, 16, 0.0, knn_capacity=50, top_k=4, gate=gate, normalize=normalize)
    xs = [torch.randn(6, 3, 16, requires_grad=True) for _ in range(3)]
    out = _run(layer, xs)
    (out[-1].sum() + layer.get_loss_component()).backward()
    gate_params = [p for p in layer.gate.parameters()]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gate_params)
    assert layer.local.query.linear.weight.grad.abs().sum() > 0
    assert xs[0].grad is None or (xs[0].grad == 0).all()   # earlier segments reach the output only through memory
    assert not any(t.requires_grad for t in layer.memory.state_dict().values())
    # the kNN side's gradient to its queries
    q = torch.randn(3, 2, 6, 8, requires_grad=True)
    out_knn, _ = layer.knn_side(q, layer.memory)
    out_knn.square().sum().backward()
    assert q.grad.abs().sum() > 0


def test_layer_memory_lifecycle():
    torch.manual_seed(0)
    layer = MemorizingAttention(2, 16, 0.0, knn_capacity=8, top_k=3, local=RelativeMultiHeadAttention(2, 16, 0.0, P=64),
                                gate=ContextChoiceLinear(2, 16))
    xs = [torch.randn(5, 2, 16) for _ in range(3)]
    _run(layer, xs, starts=[torch.tensor([True, True]), torch.tensor([False, False]), torch.tensor([False, True])])
    assert layer.memory.size.tolist() == [8, 5]    # capacity 8 for element 0; element 1 restarted at segment 3
    saved = copy.deepcopy(layer.memory_state_dict())
    sd = layer.state_dict()
    fresh = MemorizingAttention(2, 16, 0.0, knn_capacity=8, top_k=3, local=RelativeMultiHeadAttention(2, 16, 0.0, P=64),
                                gate=ContextChoiceLinear(2, 16))
    fresh.load_state_dict(sd)                      # parameters only: loads before any forward
    fresh.load_memory_state_dict(saved)
    x = torch.randn(5, 2, 16)
    torch.testing.assert_close(fresh(query=x, key=x, value=x, mask=_mask(5, 5)), layer(query=x, key=x, value=x, mask=_mask(5, 5)))
    layer.double()                                 # the memory follows the parameters
    assert layer.memory.dtype == torch.float64
    with pytest.raises(ValueError, match='release_memory'):
        layer(query=x[:, :1].double(), key=x[:, :1].double(), value=x[:, :1].double())
    layer.release_memory()
    layer(query=x[:, :1].double(), key=x[:, :1].double(), value=x[:, :1].double())
    assert layer.memory.batch_size == 1
    with pytest.raises(ValueError, match='knn_capacity'): MemorizingAttention(2, 16, knn_capacity=0)
    with pytest.raises(ValueError, match='heads'): MemorizingAttention(4, 16, local=RelativeMultiHeadAttention(2, 16))
    with pytest.raises(TypeError, match='bool'):
        layer(query=x[:, :1].double(), key=x[:, :1].double(), value=x[:, :1].double(), start_of_document=torch.tensor([1]))


def test_layer_non_finite_segment_refused_before_reset():
    "The layer checks what it will store before `start_of_document` empties anything: a refused call changes no memory."
    torch.manual_seed(0)
    layer = MemorizingAttention(2, 16, 0.0, knn_capacity=20, top_k=3).eval()
    xs = [torch.randn(4, 3, 16) for _ in range(2)]
    _run(layer, xs)
    before = copy.deepcopy(layer.memory_state_dict())
    x = torch.randn(4, 3, 16); x[2, 2, 5] = float('inf')
    with pytest.raises(ValueError, match=r'MemorizingAttention: (keys|values) hold NaN or inf in batch elements \[2\].*`key`'):
        layer(query=x, key=x, value=x, mask=_mask(4, 4), start_of_document=torch.tensor([True, False, True]))
    for k, t in layer.memory_state_dict().items(): assert torch.equal(t, before[k]), k


def test_layer_state_independent_of_mode():
    "Memory built under inference_mode or autocast is still the parameters' dtype and writable in training."
    torch.manual_seed(0)
    layer = MemorizingAttention(2, 16, 0.0, knn_capacity=20, top_k=3)
    x = torch.randn(4, 2, 16)
    with torch.inference_mode():
        layer(query=x, key=x, value=x, mask=_mask(4, 4))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        layer(query=x, key=x, value=x, mask=_mask(4, 4))
    assert layer.memory.dtype == torch.float32 and layer.memory.size.tolist() == [8, 8]
    y = layer(query=x.requires_grad_(), key=x, value=x, mask=_mask(4, 4))
    y.sum().backward()
    assert x.grad is not None and layer.memory.size.tolist() == [12, 12]


def test_torch_func_refused():
    layer = MemorizingAttention(2, 16, 0.0, knn_capacity=20, top_k=3)
    x = torch.randn(4, 2, 16)
    with pytest.raises(RuntimeError, match='torch.func'):
        torch.func.grad(lambda x: layer(query=x, key=x, value=x).sum())(x)


@settings(max_examples=15, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(['add', 'add', 'reset', 'clear']), st.integers(0, 300), st.integers(0, 3)),
                    min_size=1, max_size=6), seed=st.integers(0, 2 ** 16))
def test_faiss_exhaustive_equals_exact(ops, seed):
    "With nprobe = nlist the IVF search scans every cell: after any add/evict/reset sequence it must match exact search."
    pytest.importorskip('faiss')
    from relpos.memorizing import FaissKNNMemory
    g = torch.Generator().manual_seed(seed)
    approx = FaissKNNMemory(2, 2, 8, capacity=400, nlist=4, nprobe=4, train_size=50)
    for op, n, bits in ops:
        if op == 'add':
            k = torch.randn(2, 2, n, 8, generator=g)
            approx.add(k, 3 * k)
        elif op == 'reset':
            approx.reset(torch.tensor([bits & 1 == 1, bits & 2 == 2]))
        else:
            approx.clear()
        check_against_brute_force(approx, torch.randn(2, 2, 5, 8, generator=g), 20)


def test_faiss_refuses_and_round_trips():
    pytest.importorskip('faiss')
    from relpos.memorizing import FaissKNNMemory
    with pytest.raises(TypeError, match='float32'): FaissKNNMemory(1, 1, 4, 10, dtype=torch.float64)
    with pytest.raises(ValueError, match='nprobe'): FaissKNNMemory(1, 1, 4, 10, nprobe=0)
    torch.manual_seed(0)
    m = FaissKNNMemory(1, 2, 4, 100, nlist=2, nprobe=2, train_size=10)
    k = torch.randn(1, 2, 60, 4); m.add(k, k)
    m2 = FaissKNNMemory(1, 2, 4, 100, nlist=2, nprobe=2, train_size=10)
    m2.load_state_dict(m.state_dict())
    q = torch.randn(1, 2, 3, 4)
    for a, b in zip(m.search(q, 5), m2.search(q, 5)): assert torch.equal(a, b)   # exhaustive: same answer


# ---------------------------------------------------------------- DecoderLM(memorizing_layers=...)
import pickle
import torch.nn.functional as F
from relpos.models import DecoderLM, POSITIONS, KNN_LOCAL_POSITIONS

V = 13


def knn_lm(position='xl', seed=0, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(d_model=16, heads=2, n_layers=2, max_len=8, mem_len=8, memorizing_layers=(1,), knn_capacity=40,
                   top_k=4), **kw)
    lm = DecoderLM(V, position=position, **kw).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # perturb every parameter: XL's zero tables and the gate's zero bias make checks vacuous
        for p in lm.parameters(): p.add_(0.3 * torch.randn(p.shape, generator=g))
    return lm


def fill(lm, batch=3, calls=2, n=8, seed=0):
    "Read `calls` segments of `n` tokens per row (the first flagged as document start); return the XL memory."
    g, memory = torch.Generator().manual_seed(seed), None
    with torch.no_grad():
        for c in range(calls):
            _, memory = lm(torch.randint(0, V, (batch, n), generator=g), memory,
                           doc_start=torch.full((batch,), c == 0))
    return memory


def test_decoder_knn_positions_cover_the_registry():
    "Every position with keys longer than queries in labml's dialect can be a kNN layer's local side; the others refuse."
    assert set(KNN_LOCAL_POSITIONS) | {'absolute', 'shaw', 'fox'} == set(POSITIONS)
    for p in KNN_LOCAL_POSITIONS:
        lm = knn_lm(p)
        memory = fill(lm)
        assert lm.memorizing[0].memory.size.tolist() == [16, 16, 16]
        logits, _ = lm(torch.randint(0, V, (3, 8)), memory)
        assert torch.isfinite(logits).all(), p
    for p in ('absolute', 'shaw', 'fox'):
        with pytest.raises(ValueError, match='local side'): knn_lm(p, mem_len=0)


def test_decoder_knn_trains_and_loss_falls():
    "A DecoderLM with a kNN layer trains over consecutive segments (loss + the gate's auxiliary loss) and its loss falls."
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, max_len=16, mem_len=16, memorizing_layers=(1,),
                   knn_capacity=64, top_k=8)
    opt, g = torch.optim.AdamW(lm.parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    losses, memory, start = [], None, torch.randint(0, V, (4, 1), generator=g)
    for step in range(20):
        doc_start = torch.full((4,), step % 5 == 0)   # documents of 5 segments
        if step % 5 == 0: start = torch.randint(0, V, (4, 1), generator=g)
        x = (start + torch.arange(16) + 16 * (step % 5)) % V
        logits, memory = lm(x, memory, doc_start=doc_start)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        aux = lm.get_loss_component()
        assert aux.requires_grad and torch.isfinite(aux)
        opt.zero_grad(); (loss + aux).backward(); opt.step(); losses.append(loss.item())
        mem = lm.memorizing[0].memory
        assert not mem.keys.requires_grad and mem.keys.grad is None and mem.keys.grad_fn is None
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert lm.get_loss_component().item() == 0                  # taken: nothing pending
    assert lm.layers[1].self_attn.module.gate.bias.grad.abs().sum() > 0
    assert not any('memory' in k and 'keys' in k for k in lm.state_dict())   # state_dict: parameters only


def test_decoder_doc_start_resets_exactly_the_flagged_rows():
    "Against brute force: unflagged rows go on as if nothing happened; a flagged row equals the same row read alone from an empty memory."
    lm = knn_lm()
    fill(lm)
    untouched = copy.deepcopy(lm)                    # the same state, no reset
    alone = copy.deepcopy(lm); alone.release_knn_memory()
    x = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(5))
    flags = torch.tensor([False, True, False])
    with torch.no_grad():
        got, _ = lm(x, doc_start=flags)
        want_kept, _ = untouched(x)
        want_new, _ = alone(x[1:2], doc_start=torch.tensor([True]))
    torch.testing.assert_close(got[[0, 2]], want_kept[[0, 2]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:2], want_new, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1], want_kept[1], atol=1e-3)   # the reset changed the flagged row
    for mem, ref_kept, ref_new in zip([a.memory for a in lm.memorizing], [a.memory for a in untouched.memorizing],
                                      [a.memory for a in alone.memorizing]):
        assert mem.size.tolist() == [24, 8, 24]
        torch.testing.assert_close(mem.keys[[0, 2], :, :24], ref_kept.keys[[0, 2], :, :24])
        torch.testing.assert_close(mem.keys[1, :, :8], ref_new.keys[0, :, :8], rtol=1e-5, atol=1e-6)
    lm.reset_knn_memory(torch.tensor([True, False, True]))
    assert lm.memorizing[0].memory.size.tolist() == [0, 8, 0]


def test_decoder_knn_bad_input():
    for kw, err, match in [(dict(memorizing_layers=(2,)), ValueError, 'n_layers=2'),
                           (dict(memorizing_layers=(-1,)), ValueError, 'memorizing_layers'),
                           (dict(memorizing_layers=(0, 0)), ValueError, 'twice'),
                           (dict(memorizing_layers=1), TypeError, 'tuple'),
                           (dict(memorizing_layers=(True,)), ValueError, 'memorizing_layers'),
                           (dict(top_k=0), ValueError, 'top_k'),
                           (dict(top_k=2.0), TypeError, 'top_k'),
                           (dict(knn_capacity=0), ValueError, 'knn_capacity'),
                           (dict(position='shaw'), ValueError, "position='shaw'"),
                           (dict(position='absolute', mem_len=0), ValueError, 'local side')]:
        with pytest.raises(err, match=match): knn_lm(**kw)
    lm = knn_lm()
    fill(lm)
    before = copy.deepcopy(lm.knn_memory_state_dict())
    x = torch.randint(0, V, (3, 8))
    for call, err, match in [(lambda: lm(x, doc_start=torch.ones(2, dtype=torch.bool)), ValueError, r'\[batch=3\]'),
                             (lambda: lm(x, doc_start=torch.ones(3, dtype=torch.long)), TypeError, 'bool'),
                             (lambda: lm(x, doc_start=[True] * 3), TypeError, 'bool'),
                             (lambda: lm(x + V, doc_start=torch.ones(3, dtype=torch.bool)), ValueError, 'n_vocab'),
                             (lambda: lm(x[:2]), ValueError, 'release_knn_memory'),
                             (lambda: lm(x[:2], doc_start=torch.tensor([True, False])), ValueError, 'release_knn_memory'),
                             (lambda: lm.generate(x[:2], 2), ValueError, 'release_knn_memory')]:
        with pytest.raises(err, match=match): call()
        after = lm.knn_memory_state_dict()       # a refused call changes no memory
        assert all(torch.equal(after[i][k], before[i][k]) for i in before for k in before[i])
    lm(x[:2], doc_start=torch.ones(2, dtype=torch.bool))   # every row starts: rebuilt for batch 2
    assert lm.memorizing[0].memory.batch_size == 2 and lm.memorizing[0].memory.size.tolist() == [8, 8]


def test_decoder_knn_non_finite_keys_refused():
    "A segment whose keys turn NaN (here: one token's embedding) is refused by the kNN layer before its memory changes."
    lm = knn_lm()
    memory = fill(lm)
    before = copy.deepcopy(lm.knn_memory_state_dict())
    with torch.no_grad(): lm.src_embed.weight[5] = float('nan')
    x = torch.randint(0, 5, (3, 8)); x[1, 3] = 5     # row 1 reads token 5 once
    # without doc_start, with some rows starting, with every row starting, and with every row starting at a new batch
    # size (the memories would be rebuilt): each call is refused and leaves every memory as it was
    for call in [lambda: lm(x, memory), lambda: lm(x, memory, doc_start=torch.tensor([True, False, True])),
                 lambda: lm(x, memory, doc_start=torch.ones(3, dtype=torch.bool)),
                 lambda: lm(x[1:], doc_start=torch.ones(2, dtype=torch.bool)),
                 lambda: lm.generate(x, 2, doc_start=torch.tensor([False, True, False]))]:
        with pytest.raises(ValueError, match=r'MemorizingAttention: keys hold NaN or inf in batch elements \[[01]\]'):
            call()
        after = lm.knn_memory_state_dict()
        assert all(torch.equal(after[i][k], before[i][k]) for i in before for k in before[i])
        assert lm.memorizing[0].memory.batch_size == 3
    logits, _ = lm(torch.randint(0, 5, (3, 8)), memory)        # the memory is clean: later segments are finite
    assert torch.isfinite(logits).all()


def test_decoder_knn_copies_and_checkpoint():
    "deepcopy, pickle, and state_dict + knn_memory_state_dict all continue with the same numbers."
    lm = knn_lm()
    memory = fill(lm)
    state, knn_state = lm.state_dict(), copy.deepcopy(lm.knn_memory_state_dict())
    resumed = knn_lm(seed=1)
    resumed.load_state_dict(state, strict=True)
    resumed.load_knn_memory_state_dict(knn_state)
    x = torch.randint(0, V, (3, 8))
    with torch.no_grad():
        others = [copy.deepcopy(lm), pickle.loads(pickle.dumps(lm)), resumed]
        want, _ = lm(x, memory)
        for other in others: torch.testing.assert_close(other(x, memory)[0], want, rtol=0, atol=0)
    with pytest.raises(ValueError, match='memorizing_layers'): resumed.load_knn_memory_state_dict({0: {}})


def test_decoder_knn_generate_equals_segment_by_segment_reading():
    "generate reads and writes the kNN memories: greedy tokens equal feeding the prompt, then one token per call."
    lm = knn_lm(mem_len=64)
    fill(lm)
    twin = copy.deepcopy(lm)
    prompt = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(3))
    flags = torch.tensor([False, True, False])
    out = lm.generate(prompt, 6, temperature=0, doc_start=flags)
    tokens = [prompt]
    with torch.no_grad():
        logits, memory = twin(prompt, doc_start=flags)
        for _ in range(5):
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            logits, memory = twin(tokens[-1], memory)
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
    assert torch.equal(out, torch.cat(tokens, 1))
    for a, b in zip(lm.memorizing, twin.memorizing):
        assert a.memory.size.tolist() == b.memory.size.tolist() == [16 + 10, 10, 16 + 10]   # prompt + 5 fed-back tokens
        torch.testing.assert_close(a.memory.keys, b.memory.keys, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- knn_memory=FaissKNNMemory (the approximate backend)
def faiss_lm(seed=0, **kw):
    from relpos.memorizing import FaissKNNMemory
    return knn_lm(seed=seed, knn_memory=FaissKNNMemory, **kw)


def test_decoder_faiss_exhaustive_forward_equals_exact():
    "nprobe = nlist scans every cell: a DecoderLM with the faiss backend computes what the exact one does, segment after segment."
    pytest.importorskip('faiss')
    exact = knn_lm()
    approx = faiss_lm(knn_memory_kwargs=dict(nlist=3, nprobe=3, train_size=12))
    approx.load_state_dict(exact.state_dict())
    g, mem_e, mem_a = torch.Generator().manual_seed(3), None, None
    with torch.no_grad():
        for step in range(7):   # 56 pairs per row into capacity 40: the indexes are trained, then the ring wraps
            x = torch.randint(0, V, (3, 8), generator=g)
            flags = torch.tensor([step == 0, step == 4, step == 0])       # row 1 restarts its document mid-way
            (le, mem_e), (la, mem_a) = exact(x, mem_e, doc_start=flags), approx(x, mem_a, doc_start=flags)
            torch.testing.assert_close(la, le, rtol=1e-5, atol=1e-5)
    memory = approx.memorizing[0].memory
    assert all(ix is not None for ix in memory._indexes)                 # the faiss path ran, not the exact fallback
    assert memory.size.tolist() == [40, 24, 40]


def test_decoder_faiss_trains_and_copies():
    "Training with the faiss backend: the loss falls; deepcopy, pickle and the memory state dict continue it."
    pytest.importorskip('faiss')
    from relpos.memorizing import FaissKNNMemory
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, max_len=16, mem_len=16, memorizing_layers=(1,), knn_capacity=64,
                   top_k=8, knn_memory=FaissKNNMemory, knn_memory_kwargs=dict(nlist=4, nprobe=2, train_size=32))
    assert 'knn_memory=FaissKNNMemory' in lm.extra_repr()
    opt, g = torch.optim.AdamW(lm.parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    losses, memory = [], None
    for step in range(20):
        if step % 5 == 0: start = torch.randint(0, V, (4, 1), generator=g)
        x = (start + torch.arange(16) + 16 * (step % 5)) % V
        logits, memory = lm(x, memory, doc_start=torch.full((4,), step % 5 == 0))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(); (loss + lm.get_loss_component()).backward(); opt.step(); losses.append(loss.item())
    mem = lm.memorizing[0].memory
    assert isinstance(mem, FaissKNNMemory) and all(ix is not None for ix in mem._indexes) and not mem.keys.requires_grad
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    lm.eval()
    x = torch.randint(0, V, (4, 16), generator=g)
    twins = [copy.deepcopy(lm), pickle.loads(pickle.dumps(lm))]          # indexes copied: the same approximate answers
    with torch.no_grad():
        want, _ = lm(x, memory)
        for twin in twins:
            assert isinstance(twin.memorizing[0].memory, FaissKNNMemory)
            torch.testing.assert_close(twin(x, memory)[0], want, rtol=0, atol=0)
    # the memory state dict holds the buffers: an exact model loads it (a faiss one retrains its indexes from it)
    exact = DecoderLM(V, d_model=16, heads=2, n_layers=2, max_len=16, mem_len=16, memorizing_layers=(1,),
                      knn_capacity=64, top_k=8)
    exact.load_state_dict(lm.state_dict()); exact.load_knn_memory_state_dict(lm.knn_memory_state_dict())
    assert torch.equal(exact.memorizing[0].memory.keys, lm.memorizing[0].memory.keys)
    with pytest.raises(TypeError, match='float32'): lm.double()            # faiss stores float32: refused
    layer = lm.memorizing[0]                                               # the kNN layer itself did not move
    assert layer.memory.dtype == layer.local.output.weight.dtype == torch.float32


def test_knn_memory_argument_refused():
    from relpos.memorizing import FaissKNNMemory
    for kw, err, match in [(dict(knn_memory='faiss'), TypeError, 'KNNMemory or a subclass'),
                           (dict(knn_memory=torch.nn.Linear), TypeError, 'KNNMemory or a subclass'),
                           (dict(knn_memory=KNNMemory(1, 1, 1, 1)), TypeError, 'KNNMemory or a subclass'),
                           (dict(knn_memory_kwargs=[('nprobe', 8)]), TypeError, 'dict'),
                           (dict(knn_memory_kwargs=dict(nprobe=8)), TypeError, 'nprobe'),          # exact takes no nprobe
                           (dict(knn_memory=FaissKNNMemory, knn_memory_kwargs=dict(nprob=8)), TypeError, 'nprob'),
                           (dict(knn_memory_kwargs=dict(capacity=8)), ValueError, 'capacity')]:
        with pytest.raises(err, match=match): knn_lm(**kw)
        with pytest.raises(err, match=match): MemorizingAttention(2, 16, **kw)
    with pytest.raises(ValueError, match='chunk_size'):
        MemorizingAttention(2, 16, chunk_size=64, knn_memory_kwargs=dict(chunk_size=32))
    lm = knn_lm(knn_memory_kwargs=dict(chunk_size=5))        # the exact memory's own options go through too
    fill(lm)
    assert lm.memorizing[0].memory.chunk_size == 5


@settings(max_examples=300, deadline=None)
@given(pairs=st.integers(1, 4096), n_q=st.integers(1, 1 << 16), filled=st.integers(1, 1 << 22),
       top_k=st.integers(1, 512), chunk=st.one_of(st.none(), st.integers(1, 1 << 20)))
def test_search_blocks_are_bounded_and_prefer_whole_memories(pairs, n_q, filled, top_k, chunk):
    "Scores held at once stay within SEARCH_BLOCK (or one minimal chunk of one memory); a memory that fits is never cut."
    import relpos.memorizing as mz
    c, group = mz._search_blocks(pairs, n_q, filled, top_k, chunk)
    assert 1 <= c <= filled and 1 <= group <= pairs
    held = group * n_q * c
    assert held <= max(mz.SEARCH_BLOCK, n_q * min(filled, chunk or max(32 * top_k, 1024)))
    if chunk is None and n_q * filled <= mz.SEARCH_BLOCK: assert c == filled   # one topk per row, no merges


def test_faiss_nprobe_default_scans_an_eighth_of_the_lists():
    pytest.importorskip('faiss')
    from relpos.memorizing import FaissKNNMemory
    for capacity, nlist, nprobe in ((65536, 256, 32), (8192, 90, 11), (100, 10, 1), (4, 2, 1)):
        m = FaissKNNMemory(1, 1, 4, capacity)
        assert (m.nlist, m.nprobe) == (nlist, nprobe), capacity
    assert FaissKNNMemory(1, 1, 4, 8192, nprobe=5).nprobe == 5


@pytest.mark.parametrize('backend', ['exact', 'faiss'])
def test_decoder_later_knn_layer_refusing_leaves_every_memory(backend):
    "Two kNN layers, NaN appearing between them: the later one refuses, and the earlier one's memory (resets included) is unchanged."
    kw = dict(n_layers=3, memorizing_layers=(0, 2))
    if backend == 'faiss':
        pytest.importorskip('faiss')
        from relpos.memorizing import FaissKNNMemory
        kw.update(knn_memory=FaissKNNMemory, knn_memory_kwargs=dict(nlist=2, nprobe=2, train_size=8))   # exhaustive
    lm, ref = knn_lm(**kw), knn_lm(**kw)
    memory, ref_memory = fill(lm), fill(ref)
    before = copy.deepcopy(lm.knn_memory_state_dict())
    saved = copy.deepcopy(lm.layers[1].feed_forward.state_dict())
    with torch.no_grad():   # layer 1 turns every hidden state NaN: layer 0 stores finite pairs, layer 2 refuses
        for p in lm.layers[1].feed_forward.parameters(): p.fill_(float('nan'))
    x = torch.randint(0, V, (3, 8))
    for doc_start in (None, torch.tensor([True, False, True])):
        with pytest.raises(ValueError, match=r'MemorizingAttention: keys hold NaN or inf'):
            lm(x, memory, doc_start=doc_start)
        after = lm.knn_memory_state_dict()
        assert all(torch.equal(after[i][k], before[i][k]) for i in before for k in before[i]), doc_start
    lm.layers[1].feed_forward.load_state_dict(saved)
    # the same next segments give the same logits as a model that never saw the refused calls
    for c in range(2):
        y = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(10 + c))
        start = torch.tensor([c == 1, False, False])
        (a, memory), (b, ref_memory) = lm(y, memory, doc_start=start), ref(y, ref_memory, doc_start=start)
        torch.testing.assert_close(a, b, rtol=0, atol=0)

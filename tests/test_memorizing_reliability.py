"""FaissKNNMemory's promises under refusal and batching (chapter nbs/10_memorizing.ipynb): a refused segment leaves
the memory exactly as it was (indexes and their trained cells too), and each row's search depends on that row alone."""
import copy

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

pytest.importorskip('faiss')
from relpos.memorizing import FaissKNNMemory
from test_memorizing import V, fill, knn_lm

# nprobe < nlist everywhere below: the answers are approximate, so they depend on how each index was trained
KW = dict(nlist=8, nprobe=1, train_size=40)


def answers(memory, queries, top_k=6):
    "What a later call can observe of the memory: its search, and the slots behind it (those of valid neighbours)."
    index, valid = memory._top_k_slots(queries, top_k)
    return (*memory.search(queries, top_k), index.masked_fill(~valid, -1))


def assert_same(a, b, msg=''):
    for x, y in zip(a, b): assert torch.equal(x, y), msg


# ---------------------------------------------------------------- a refused segment changes nothing
def test_restored_counters_restore_the_trained_indexes():
    "reset, then `_restore_counters` (what DecoderLM does when a later kNN layer refuses): the same answers as before."
    g = torch.Generator().manual_seed(0)
    m = FaissKNNMemory(3, 2, 8, 200, **KW)
    q = torch.randn(3, 2, 20, 8, generator=g)
    for _ in range(5):   # trained on the first 50 pairs per row (the first search), then 200 more: the ring wraps
        k = torch.randn(3, 2, 50, 8, generator=g); m.add(k, 2 * k); m.search(q, 6)
    before, state = answers(m, q), copy.deepcopy(m.state_dict())
    for which in ([True, False, False], [True, True, True]):
        counters = m._counters()
        m.reset(torch.tensor(which))
        m.search(q, 6)                                     # searched while reset, as the refused call's first layer does
        m._restore_counters(counters)
        assert_same(answers(m, q), before, which)
        for k, t in m.state_dict().items(): assert torch.equal(t, state[k]), k
    # and the next segment is stored and found as if nothing had happened
    twin, g = FaissKNNMemory(3, 2, 8, 200, **KW), torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 20, 8, generator=g)
    for _ in range(5): k = torch.randn(3, 2, 50, 8, generator=g); twin.add(k, 2 * k); twin.search(q, 6)
    k = torch.randn(3, 2, 30, 8, generator=g); m.add(k, 2 * k); twin.add(k, 2 * k)
    assert_same(answers(m, q), answers(twin, q))


def test_decoder_refused_segment_keeps_faiss_indexes():
    "A later kNN layer refuses a segment that starts row 0's document: the next calls equal a copy taken before it."
    kw = dict(n_layers=3, memorizing_layers=(0, 2), knn_capacity=64,
              knn_memory=FaissKNNMemory, knn_memory_kwargs=dict(nlist=4, nprobe=1, train_size=16))
    lm = knn_lm(**kw)
    memory = fill(lm, calls=4)                             # 32 pairs per row: every index trained
    assert all(ix is not None for a in lm.memorizing for ix in a.memory._indexes)
    twin, twin_memory = copy.deepcopy(lm), [m.clone() for m in memory]
    saved = copy.deepcopy(lm.layers[1].feed_forward.state_dict())
    with torch.no_grad():   # layer 1 turns every hidden state NaN: layer 0 resets row 0 and stores nothing, layer 2 refuses
        for p in lm.layers[1].feed_forward.parameters(): p.fill_(float('nan'))
    x = torch.randint(0, V, (3, 8))
    for doc_start in (torch.tensor([True, False, False]), torch.ones(3, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r'MemorizingAttention: keys hold NaN or inf'):
            lm(x, memory, doc_start=doc_start)
    lm.layers[1].feed_forward.load_state_dict(saved)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for start in (None, torch.tensor([False, True, False]), None):
            y = torch.randint(0, V, (3, 8), generator=g)
            (a, memory), (b, twin_memory) = lm(y, memory, doc_start=start), twin(y, twin_memory, doc_start=start)
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- rows are independent
def run_rows(ops, batch, seed):
    "Apply `ops` to a batch memory and to one batch-1 memory per row (that row's keys and resets); compare every search."
    g = torch.Generator().manual_seed(seed)
    m = FaissKNNMemory(batch, 2, 8, 120, **KW)
    alone = [FaissKNNMemory(1, 2, 8, 120, **KW) for _ in range(batch)]
    for op, n, bits in ops:
        if op == 'add':
            k = torch.randn(batch, 2, n, 8, generator=g)
            m.add(k, 2 * k)
            for b, a in enumerate(alone): a.add(k[b:b + 1], 2 * k[b:b + 1])
        else:
            which = torch.tensor([(bits >> b) & 1 == 1 for b in range(batch)])
            m.reset(which)
            for b, a in enumerate(alone): a.reset(which[b:b + 1])
        q = torch.randn(batch, 2, 10, 8, generator=g)
        got = answers(m, q)
        for b, a in enumerate(alone):
            assert_same([t[b:b + 1] for t in got], answers(a, q[b:b + 1]), (b, m.size.tolist()))


def test_rows_below_train_size_do_not_switch_the_others_to_exact():
    """Row 1 restarts its document before its index is trained: rows 0 and 2 reach train_size and use their indexes,
    row 1 is searched exactly until it does too, each as if alone; then again after every row restarts."""
    run_rows([('add', 30, 0), ('reset', 0, 0b010), ('add', 20, 0), ('add', 15, 0), ('reset', 0, 0b111), ('add', 30, 0),
              ('add', 30, 0)], batch=3, seed=0)


@settings(max_examples=20, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(['add', 'add', 'reset']), st.integers(0, 70), st.integers(0, 7)),
                    min_size=1, max_size=6), seed=st.integers(0, 2 ** 16))
@example(ops=[('add', 30, 0), ('reset', 0, 1), ('add', 20, 0)], seed=1)
def test_each_row_searches_as_if_alone(ops, seed):
    "Any adds and partial resets: every row's neighbours equal those of a memory holding that row alone."
    run_rows(ops, batch=3, seed=seed)

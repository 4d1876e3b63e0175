"""Benchmark for `relpos.memorizing` (nbs/10_memorizing.ipynb): exact `KNNMemory.search` against the bare [queries, capacity]
matmul it is built on; a DecoderLM training step with one kNN layer against the same model without it."""
import statistics, time
import torch
import torch.nn.functional as F
from relpos.memorizing import KNNMemory
from relpos.bench import bench_table

def _memory(capacity, heads, head_dim, batch=1):
    torch.manual_seed(0)
    m = KNNMemory(batch, heads, head_dim, capacity)
    for c0 in range(0, capacity, 8192):   # filled in pieces, as a training run would
        n = min(8192, capacity - c0)
        m.add(torch.randn(batch, heads, n, head_dim), torch.randn(batch, heads, n, head_dim))
    return m

def make_matmul(n_q=512, heads=8, capacity=65536, head_dim=64, top_k=32):
    "Baseline: the full [queries, capacity] score matrix, one matmul (no top-k)."
    m = _memory(capacity, heads, head_dim)
    q = torch.randn(1, heads, n_q, head_dim)
    keys = m.keys
    return (lambda q: torch.matmul(q, keys.transpose(-1, -2))), (q,)

def make_search(n_q=512, heads=8, capacity=65536, head_dim=64, top_k=32):
    "KNNMemory.search: chunked matmul + topk, merged; returns keys, values and validity of the top_k."
    m = _memory(capacity, heads, head_dim)
    q = torch.randn(1, heads, n_q, head_dim)
    return (lambda q: m.search(q, top_k)[0]), (q,)

def search_table(reps=5, capacities=(65536,)):
    configs = [dict(n_q=512, heads=8, capacity=c, head_dim=64, top_k=32) for c in capacities]
    return bench_table({'matmul': 'bench.memorizing:make_matmul', 'search': 'bench.memorizing:make_search'},
                       configs, baseline='matmul', backward=False, reps=reps,
                       title='Exact top-32 search vs the bare score matmul (batch 1, 8 heads, 512 queries, head_dim 64)')

def make_train_step(knn, capacity=65536, batch=1, n=512, d_model=256, heads=4, layers=4, n_vocab=256, top_k=32, seed=0,
                    position='xl', mem_len=None):
    """One training step (forward, backward, AdamW) of a DecoderLM(position, mem_len=n unless given) over a segment of n tokens; with `knn`,
    its middle layer is a kNN layer whose memory is full (`capacity` entries per batch element and head) before timing;
    `knn='search'`: that layer's `KNNMemory.search` alone, for one segment's queries; `knn='faiss'`: the kNN layer with
    `knn_memory=FaissKNNMemory` (its defaults: nlist about sqrt(capacity), nprobe an eighth of nlist), its indexes trained
    on the full memory by the warm-up step."""
    from relpos.models import DecoderLM
    torch.manual_seed(seed)
    extra = dict(memorizing_layers=(layers // 2,), knn_capacity=capacity, top_k=top_k) if knn else {}
    if knn == 'faiss':   # the approximate backend with its defaults
        from relpos.memorizing import FaissKNNMemory
        extra.update(knn_memory=FaissKNNMemory)
    lm = DecoderLM(n_vocab, d_model, heads, layers, position=position, mem_len=n if mem_len is None else mem_len,
                   max_len=n, **extra)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    tokens = torch.randint(0, n_vocab, (batch, n))
    state = dict(memory=None)
    def step():
        logits, state['memory'] = lm(tokens, state['memory'])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + lm.get_loss_component()
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    step()                                   # builds the kNN memory for this batch size
    for a in lm.memorizing:                  # then fills it: normalised keys, as the layer stores them
        m, g = a.memory, torch.Generator().manual_seed(seed)
        for c0 in range(0, capacity, 8192):
            k = torch.randn(batch, heads, min(8192, capacity - c0), d_model // heads, generator=g)
            m.add(F.normalize(k, dim=-1), torch.randn(k.shape, generator=g))
        assert m.size.tolist() == [capacity] * batch
    if knn == 'search':
        q = F.normalize(torch.randn(batch, heads, n, d_model // heads), dim=-1)
        return lambda: lm.memorizing[0].memory.search(q, top_k)
    return step

TRAIN_CONFIGS = (dict(capacity=65536, batch=1, n=512, d_model=256, heads=4, layers=4),   # DecoderLM's default sizes
                 dict(capacity=65536, batch=1, n=512, d_model=512, heads=8, layers=8))   # twice as wide, twice as deep

# Memory of 64x the segment (the cost target: <= 2x the step without memory with faiss, <= 3x exact): the
# defaults' sizes on a 512-token segment, and the sizes of the long-document study (bench/memorizing_study.py)
TRAIN_CONFIGS_64X = (dict(capacity=64 * 512, batch=1, n=512, d_model=256, heads=4, layers=4),
                     dict(capacity=64 * 128, batch=8, n=128, d_model=128, heads=4, layers=4, position='xl_paper', mem_len=0))

def train_step_table(reps=5, configs=TRAIN_CONFIGS):
    "Markdown table (bench_table's columns): median time of a training step with and without one kNN layer, repeats interleaved."
    rows = []
    for config in configs:
        steps = {'DecoderLM': make_train_step(False, **config), 'DecoderLM + kNN layer': make_train_step(True, **config),
                 'kNN search alone': make_train_step('search', **config),
                 'DecoderLM + kNN layer (faiss)': make_train_step('faiss', **config)}
        times = {name: [] for name in steps}
        for step in steps.values(): step()   # warm-up (the kNN memory is already full)
        for _ in range(reps):                # interleaved: a slow moment of the machine hits both cases alike
            for name, step in steps.items():
                t0 = time.perf_counter(); step(); times[name].append(time.perf_counter() - t0)
        base = statistics.median(times['DecoderLM'])
        cfg = ' '.join(f"{k}={v}" for k, v in config.items())
        for name, ts in times.items():
            t = statistics.median(ts)
            rows.append(f"| {cfg} | {name} | {t * 1e3:.1f} | {t / base:.2f}× |")
        del steps
    # time only: the cases run interleaved in one process, where peak memory is not per case (relpos.bench measures
    # peaks in a fresh process per case)
    head = "| config | case | time (ms) | time / DecoderLM |\n|---|---|---|---|"
    note = (f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads; forward+backward+AdamW step, "
            f"median of {reps} interleaved runs; position 'xl' and mem_len = n unless the config says otherwise, kNN layer "
            f"in the middle, top-32; faiss: FaissKNNMemory's defaults (nlist about sqrt(capacity), nprobe nlist / 8)")
    return "\n".join(["**DecoderLM training step with one kNN layer (memory full) vs without**", "", head, *rows, "", note])

def main(reps=5, capacities=(65536,), tables=('search', 'train', 'train64')):
    "The chapter's tables: 'search' (exact search vs matmul), 'train' (training step with vs without a kNN layer), 'train64' (the same with 64x the segment in memory)."
    out = []
    if 'search' in tables: out.append(search_table(reps, capacities))
    if 'train' in tables: out.append(train_step_table(reps))
    if 'train64' in tables: out.append(train_step_table(reps, TRAIN_CONFIGS_64X))
    return "\n\n".join(out)

def _keys(n, head_dim, clustered, generator):
    "Random keys: isotropic Gaussian (an IVF index's worst case), or around 4096 centres (closer to trained keys)."
    if not clustered: return torch.randn(1, 1, n, head_dim, generator=generator)
    centres = torch.randn(4096, head_dim, generator=torch.Generator().manual_seed(1))
    pick = torch.randint(0, 4096, (n,), generator=generator)
    return (centres[pick] + 0.5 * torch.randn(n, head_dim, generator=generator))[None, None]

def faiss_recall(capacity=2 ** 20, n_q=512, head_dim=64, top_k=32, nlist=1024, nprobes=(16, 32, 64), reps=3):
    "Markdown table: FaissKNNMemory against exact KNNMemory.search (one head): time, speed-up and recall@top_k."
    import statistics, time
    from relpos.memorizing import FaissKNNMemory
    def median_time(fn):
        fn(); ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    rows = []
    for clustered in (True, False):
        g = torch.Generator().manual_seed(0)
        keys, queries = _keys(capacity, head_dim, clustered, g), _keys(n_q, head_dim, clustered, g)
        exact = KNNMemory(1, 1, head_dim, capacity); exact.add(keys, keys)
        approx = FaissKNNMemory(1, 1, head_dim, capacity, nlist=nlist); approx.add(keys, keys)
        t0 = time.perf_counter(); approx.search(queries[:, :, :1], 1); build = time.perf_counter() - t0
        truth = exact._top_k_slots(queries, top_k)[0]
        t_exact = median_time(lambda: exact.search(queries, top_k))
        for nprobe in nprobes:
            approx.nprobe = nprobe
            found = approx._top_k_slots(queries, top_k)[0]
            recall = (found[..., :, None] == truth[..., None, :]).any(-2).float().mean().item()
            t = median_time(lambda: approx.search(queries, top_k))
            rows.append(f"| {'clustered' if clustered else 'isotropic'} | {nprobe}/{nlist} | {recall:.3f} | "
                        f"{t * 1e3:.0f} | {t_exact * 1e3:.0f} | {t_exact / t:.1f}× | {build:.1f} |")
        del exact, approx
    head = ("| keys | nprobe/nlist | recall@%d | faiss (ms) | exact (ms) | speed-up | train + fill (s) |\n"
            "|---|---|---|---|---|---|---|" % top_k)
    note = (f"capacity {capacity:,}, 1 head, {n_q} queries, head_dim {head_dim}, top-{top_k}; torch {torch.__version__}, "
            f"cpu, {torch.get_num_threads()} threads; median of {reps} searches")
    return "\n".join([f"**FaissKNNMemory (IndexIVFFlat) against exact search**", "", head, *rows, "", note])

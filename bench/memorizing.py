"Benchmark for `relpos.memorizing` (nbs/10_memorizing.ipynb): exact `KNNMemory.search` against the bare [queries, capacity] matmul it is built on."
import torch
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

def main(reps=5, capacities=(65536,)):
    configs = [dict(n_q=512, heads=8, capacity=c, head_dim=64, top_k=32) for c in capacities]
    return bench_table({'matmul': 'bench.memorizing:make_matmul', 'search': 'bench.memorizing:make_search'},
                       configs, baseline='matmul', backward=False, reps=reps,
                       title='Exact top-32 search vs the bare score matmul (batch 1, 8 heads, 512 queries, head_dim 64)')

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

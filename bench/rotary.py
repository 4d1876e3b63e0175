"""Benchmark for `relpos.rotary` (nbs/06_rotary.ipynb): the attention layer forward+backward against plain SDPA, without and with a causal mask.
The grouped-query table (`gqa`) is run several times and stored in nbs/data/rotary_gqa_bench.json with the load average of each run."""
import json, os, time
from pathlib import Path
import torch
import torch.nn.functional as F
from relpos.mha import MultiHeadAttention
from relpos.rotary import RotaryMultiHeadAttention
from relpos.bench import bench_table, parse_tables

OUT = Path(__file__).resolve().parent.parent / 'nbs' / 'data' / 'rotary_gqa_bench.json'


class CausalSDPA(MultiHeadAttention):
    "Baseline for causal cases: the same projections, then `F.scaled_dot_product_attention(is_causal=True)`."
    def attention_fast(self, query, key, value, mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                              enable_gqa=k.shape[1] != q.shape[1]).permute(2, 0, 1, 3)


def layer_case(cls, n, batch=4, heads=8, d_model=512, device='cpu', causal=False, need_weights=False, **kw):
    "A training step of `cls` on self-attention over `x [n, batch, d_model]` (x requires grad), causal bool mask or none."
    torch.manual_seed(0)
    m = cls(heads, d_model, dropout_prob=0.0, **kw).to(device)
    x = torch.randn(n, batch, d_model, device=device, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None] if causal else None
    return (lambda x: m(query=x, key=x, value=x, mask=mask, need_weights=need_weights)), (x,)


def make_sdpa(n, causal=False, **kw):
    "Plain SDPA layer (no position term); causal: `is_causal=True`."
    return layer_case(CausalSDPA if causal else MultiHeadAttention, n, **kw)


def make_rotary(n, causal=False, **kw):
    "`RotaryMultiHeadAttention` as shipped (halves layout, all d_k features rotated)."
    return layer_case(RotaryMultiHeadAttention, n, causal=causal, **kw)


def make_rotary_interleaved(n, causal=False, **kw):
    "Interleaved pairs (RoFormer/GPT-J layout)."
    return layer_case(RotaryMultiHeadAttention, n, causal=causal, interleaved=True, **kw)


def make_rotary_readable(n, causal=False, **kw):
    "The readable path (`need_weights=True`): explicit scores and softmax."
    return layer_case(RotaryMultiHeadAttention, n, causal=causal, need_weights=True, **kw)


def make_sdpa_gqa(n, causal=False, **kw):
    "Plain SDPA with grouped-query heads (8 query heads, 2 key/value heads, `enable_gqa=True`)."
    return layer_case(CausalSDPA if causal else MultiHeadAttention, n, kv_heads=2, **kw)


def make_rotary_gqa(n, causal=False, **kw):
    "`RotaryMultiHeadAttention(kv_heads=2)`: rotation, then SDPA with `enable_gqa=True`."
    return layer_case(RotaryMultiHeadAttention, n, causal=causal, kv_heads=2, **kw)


def make_rotary_gqa_llama3(n, causal=False, **kw):
    "Grouped-query rotary with Llama 3.1's `rope_scaling` (its cos/sin tables cached like the default ones)."
    rope = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
            'original_max_position_embeddings': 256}
    return layer_case(RotaryMultiHeadAttention, n, causal=causal, kv_heads=2, rope_scaling=rope, **kw)


GQA_TITLE = ("Grouped-query heads (8 query, 2 key/value heads), causal mask "
             "(baseline: SDPA with is_causal=True, enable_gqa=True)")
GQA_CASES = {'sdpa gqa': 'bench.rotary:make_sdpa_gqa', 'rotary gqa': 'bench.rotary:make_rotary_gqa',
             'rotary gqa llama3': 'bench.rotary:make_rotary_gqa_llama3'}


def _gqa_runs(sizes, reps, runs, clock, memory):
    out = []
    for r in range(runs):
        load_before = os.getloadavg()[0]
        table = bench_table(GQA_CASES, [dict(n=n, causal=True) for n in sizes], baseline='sdpa gqa', reps=reps,
                            memory=memory and r == 0, clock=clock,
                            title=f"{GQA_TITLE}, {'CPU time, ' if clock == 'cpu' else ''}run {r + 1} of {runs}")
        out.append(dict(run=r + 1, load_before=load_before, load_after=os.getloadavg()[0], markdown=table,
                        threads=torch.get_num_threads(), clock=clock, rows=parse_tables(table)[0]['rows']))
    return out


def gqa(sizes=(512, 2048), reps=5, runs=3, cpu_runs=2, store=True):
    """The grouped-query table `runs` times in wall-clock time with torch's default threads (as `make bench`), then
    `cpu_runs` times in CPU time on one thread (what a machine shared with other jobs distorts least: their time slices
    are not counted); each run interleaves its cases, and the 1-minute load average before and after it is kept.
    Stored in nbs/data/rotary_gqa_bench.json."""
    wall = _gqa_runs(sizes, reps, runs, 'wall', memory=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try: cpu = _gqa_runs(sizes, reps, cpu_runs, 'cpu', memory=False)
    finally: torch.set_num_threads(before)
    result = dict(title=GQA_TITLE, cpus=os.cpu_count(), torch=torch.__version__,
                  date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), runs=wall, cpu_runs=cpu)
    if store: OUT.write_text(json.dumps(result, indent=1))
    return result


def gqa_markdown(result:dict) -> str:
    "The stored runs as Markdown: each run's table, followed by its load averages."
    return '\n\n'.join(f"{r['markdown']}\n\n1-minute load average on the {result['cpus']} CPUs: {r['load_before']:.2f} before, "
                        f"{r['load_after']:.2f} after the run" for r in result['runs'] + result.get('cpu_runs', []))


def main(sizes=(512, 2048), reps=5, readable_up_to=512, gqa_runs=3):
    out = []
    for causal in (False, True):
        cases = {'sdpa': 'bench.rotary:make_sdpa', 'rotary': 'bench.rotary:make_rotary',
                 'rotary interleaved': 'bench.rotary:make_rotary_interleaved'}
        configs = [dict(n=n, causal=causal) for n in sizes]
        out.append(bench_table(cases, configs, baseline='sdpa', reps=reps,
                               title=f"Attention layer, batch 4, 8 heads, d_model 512, dropout 0, "
                                     f"{'causal mask (baseline: is_causal=True)' if causal else 'no mask'}"))
    out.append(gqa_markdown(gqa(sizes, reps, gqa_runs)))
    small = [dict(n=n, causal=True) for n in sizes if n <= readable_up_to]
    if small:
        out.append(bench_table({'sdpa': 'bench.rotary:make_sdpa', 'rotary readable': 'bench.rotary:make_rotary_readable'},
                               small, baseline='sdpa', reps=reps, title='Readable path (need_weights=True), causal'))
    return '\n\n'.join(out)

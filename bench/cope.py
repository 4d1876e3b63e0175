"""Benchmark for `relpos.cope` (nbs/08e_cope.ipynb): a causal training step of the CoPE layer against the same projections
around SDPA with `is_causal=True` and beside the rotary layer; then the peak memory of one step at a longer length."""
import os
import torch
from relpos.rotary import RotaryMultiHeadAttention
from relpos.cope import CoPEMultiHeadAttention
from relpos.bench import bench_table, peak_memory
from bench.rotary import CausalSDPA, layer_case

TITLE = 'Causal: attention layer, batch 4, 8 heads, d_model 512, dropout 0 (baseline: is_causal=True)'
CASES = {'sdpa': 'bench.cope:make_sdpa', 'rotary': 'bench.cope:make_rotary', 'cope': 'bench.cope:make_cope'}


def make_sdpa(n, causal=True, **kw):
    "Baseline: the same projections, then `F.scaled_dot_product_attention(is_causal=True)` (no position term, no mask tensor)."
    return layer_case(CausalSDPA, n, **kw)


def make_rotary(n, causal=True, **kw):
    "`RotaryMultiHeadAttention` given the causal bool mask (SDPA with `is_causal=True` after the rotation)."
    return layer_case(RotaryMultiHeadAttention, n, causal=True, **kw)


def make_cope(n, causal=True, **kw):
    "`CoPEMultiHeadAttention` given the causal bool mask, as a decoder passes it: the blocked path (`BlockedCoPE`), each block computed again in the backward."
    return layer_case(CoPEMultiHeadAttention, n, causal=True, **kw)


def memory_table(sizes=(8192,)) -> str:
    "Peak memory of one training step of every case (no timing: at these lengths a step of CoPE takes minutes on a CPU)."
    device = os.environ.get('RELPOS_BENCH_DEVICE') or None
    extra = {} if device is None else {'device': device}
    rows = []
    for n in sizes:
        peaks = {name: peak_memory(spec, n=n, causal=True, **extra) for name, spec in CASES.items()}
        for name, m in peaks.items():
            rows.append(f"| n={n} causal=True | {name} |  |  | {m / 2**20:.0f} | {m / peaks['sdpa']:.2f}× |")
    head = ['| config | case | time (ms) | time / sdpa | peak (MiB) | peak / sdpa |', '|---|---|---|---|---|---|']
    dev = f"cuda: {torch.cuda.get_device_name()}" if device and device.startswith('cuda') else f"cpu, {torch.get_num_threads()} threads"
    return '\n'.join([f"**Peak memory, {TITLE[len('Causal: '):]}**", ''] + head + rows + ['',
                      f"torch {torch.__version__}, {dev}; forward+backward, one step, peak memory only"])


def main(sizes=(512, 2048), reps=5, memory_sizes=(8192,)):
    table = bench_table(CASES, [dict(n=n, causal=True) for n in sizes], baseline='sdpa', reps=reps, title=TITLE)
    return table + ('\n\n' + memory_table(memory_sizes) if memory_sizes else '')

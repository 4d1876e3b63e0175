"Benchmark for `relpos.xpos` (nbs/06b_xpos.ipynb): a causal training step of the layer against the same projections around SDPA with `is_causal=True`, and against the rotary layer with the same (interleaved) pairs."
from relpos.rotary import RotaryMultiHeadAttention
from relpos.xpos import XPosMultiHeadAttention
from relpos.bench import bench_table
from bench.rotary import CausalSDPA, layer_case


def make_sdpa(n, causal=True, **kw):
    "Baseline: the same projections, then `F.scaled_dot_product_attention(is_causal=True)`."
    return layer_case(CausalSDPA, n, **kw)


def make_rotary(n, causal=True, **kw):
    "`RotaryMultiHeadAttention(interleaved=True)` given the causal mask (SDPA with `is_causal=True` after the rotation)."
    return layer_case(RotaryMultiHeadAttention, n, causal=True, interleaved=True, **kw)


def make_xpos(n, causal=True, **kw):
    "`XPosMultiHeadAttention` as a decoder calls it (it masks the future itself; no mask passed)."
    return layer_case(XPosMultiHeadAttention, n, **kw)


def main(sizes=(512, 2048), reps=5,
         clock='wall',   # 'cpu': CPU time of the process, which other jobs on a shared machine distort least
         threads=None):  # torch threads for the run (None: torch's default)
    "The table; with `clock='cpu', threads=1` every case is timed in CPU time on one thread, each time also divided by rotary's."
    return bench_table({'sdpa': 'bench.xpos:make_sdpa', 'rotary': 'bench.xpos:make_rotary', 'xpos': 'bench.xpos:make_xpos'},
                       [dict(n=n, causal=True) for n in sizes], baseline='sdpa', reps=reps, clock=clock, also='rotary',
                       threads=threads, title='Causal: attention layer, batch 4, 8 heads, d_model 512, dropout 0 (baseline: is_causal=True)')

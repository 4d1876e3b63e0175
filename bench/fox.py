"Benchmark for `relpos.fox` (nbs/08d_fox.ipynb): a causal training step of the FoX layer against the same projections around SDPA with `is_causal=True`, and beside the rotary layer in the same run."
from relpos.rotary import RotaryMultiHeadAttention
from relpos.fox import ForgettingMultiHeadAttention
from relpos.bench import bench_table
from bench.rotary import CausalSDPA, layer_case


def make_sdpa(n, causal=True, **kw):
    "Baseline: the same projections, then `F.scaled_dot_product_attention(is_causal=True)` (no position term, no mask tensor)."
    return layer_case(CausalSDPA, n, **kw)


def make_rotary(n, causal=True, **kw):
    "`RotaryMultiHeadAttention` given the causal bool mask (SDPA with `is_causal=True` after the rotation): the usual position method's cost."
    return layer_case(RotaryMultiHeadAttention, n, causal=True, **kw)


def make_fox(n, causal=True, **kw):
    "`ForgettingMultiHeadAttention` given the causal bool mask, as a decoder passes it: SDPA `is_causal=True` on `fox_operands`."
    return layer_case(ForgettingMultiHeadAttention, n, causal=True, **kw)


def main(sizes=(512, 2048), reps=5,
         clock='wall',   # 'cpu': CPU time of the process, which other jobs on a shared machine distort least
         threads=None):  # torch threads for the run (None: torch's default)
    "The table; with `clock='cpu', threads=1` every case is timed in CPU time on one thread, each time also divided by rotary's."
    return bench_table({'sdpa': 'bench.fox:make_sdpa', 'rotary': 'bench.fox:make_rotary', 'fox': 'bench.fox:make_fox'},
                       [dict(n=n, causal=True) for n in sizes], baseline='sdpa', reps=reps, clock=clock, also='rotary',
                       threads=threads, title='Causal: attention layer, batch 4, 8 heads, d_model 512, dropout 0 (baseline: is_causal=True)')

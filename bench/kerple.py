"Benchmark for `relpos.kerple` (nbs/08c_kerple.ipynb): a causal training step of the layer, both kernels, against the same projections around SDPA with `is_causal=True`."
from relpos.kerple import KerpleMultiHeadAttention
from relpos.bench import bench_table
from bench.rotary import CausalSDPA, layer_case


def make_sdpa(n, causal=True, **kw):
    "Baseline: the same projections, then `F.scaled_dot_product_attention(is_causal=True)` (no position term, no mask tensor)."
    return layer_case(CausalSDPA, n, **kw)


def make_kerple_log(n, causal=True, **kw):
    "`KerpleMultiHeadAttention(kernel='log')` given the causal bool mask, as a decoder passes it: `toeplitz_attention`."
    return layer_case(KerpleMultiHeadAttention, n, causal=True, kernel='log', **kw)


def make_kerple_power(n, causal=True, **kw):
    "`KerpleMultiHeadAttention(kernel='power')` given the causal bool mask."
    return layer_case(KerpleMultiHeadAttention, n, causal=True, kernel='power', **kw)


def main(sizes=(512, 2048), reps=5):
    return bench_table({'sdpa': 'bench.kerple:make_sdpa', 'kerple log': 'bench.kerple:make_kerple_log',
                        'kerple power': 'bench.kerple:make_kerple_power'},
                       [dict(n=n, causal=True) for n in sizes], baseline='sdpa', reps=reps,
                       title='Causal: attention layer, batch 4, 8 heads, d_model 512, dropout 0 (baseline: is_causal=True)')

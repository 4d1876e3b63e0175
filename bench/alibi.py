"Benchmark for `relpos.alibi` (nbs/07_alibi.ipynb): the attention layer forward+backward against plain SDPA, causal and bidirectional."
from relpos.mha import MultiHeadAttention
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.bench import bench_table
from bench.rotary import CausalSDPA, layer_case


def make_sdpa(n, causal=False, **kw):
    "Plain SDPA layer (no position term); causal: `is_causal=True`."
    return layer_case(CausalSDPA if causal else MultiHeadAttention, n, **kw)


def make_alibi_causal(n, causal=True, **kw):
    "Causal ALiBi as shipped (it masks later keys itself; no mask passed)."
    return layer_case(ALiBiMultiHeadAttention, n, **kw)


def make_alibi_causal_masked(n, causal=True, **kw):
    "Causal ALiBi given the causal bool mask too (as a decoder passes it)."
    return layer_case(ALiBiMultiHeadAttention, n, causal=True, **kw)


def make_alibi_bidirectional(n, causal=False, **kw):
    "Bidirectional ALiBi, -m|j - i|, no mask."
    return layer_case(ALiBiMultiHeadAttention, n, bidirectional=True, **kw)


def main(sizes=(512, 2048), reps=5):
    causal = bench_table({'sdpa': 'bench.alibi:make_sdpa', 'alibi': 'bench.alibi:make_alibi_causal',
                          'alibi + mask': 'bench.alibi:make_alibi_causal_masked'},
                         [dict(n=n, causal=True) for n in sizes], baseline='sdpa', reps=reps,
                         title='Causal: attention layer, batch 4, 8 heads, d_model 512, dropout 0 (baseline: is_causal=True)')
    bidir = bench_table({'sdpa': 'bench.alibi:make_sdpa', 'alibi bidirectional': 'bench.alibi:make_alibi_bidirectional'},
                        [dict(n=n) for n in sizes], baseline='sdpa', reps=reps,
                        title='Bidirectional: attention layer, batch 4, 8 heads, d_model 512, dropout 0, no mask')
    return causal + '\n\n' + bidir

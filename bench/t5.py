"Benchmark for `relpos.t5` (nbs/08_t5.ipynb): the attention layer with T5's bucket bias against plain SDPA, without and with a causal mask."
import torch
from relpos.mha import MultiHeadAttention
from relpos.t5 import T5MultiHeadAttention
from relpos.bench import bench_table


class BiasAsMask(T5MultiHeadAttention):
    "The common recipe (x-transformers, Hugging Face T5): the `[1, heads, n, n]` bias built, handed to SDPA as a float mask."
    def attention_fast(self, query, key, value, mask):
        return MultiHeadAttention.sdpa(self, query, key, value, mask, self.position_bias(query.shape[0], key.shape[0]))


def _layer(cls, n, causal, batch, heads, d_model, device):
    torch.manual_seed(0)
    m = cls(heads, d_model, dropout_prob=0.0).to(device)
    x = torch.randn(n, batch, d_model, device=device, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None] if causal else None  # [n, n, 1]
    return (lambda x: m(query=x, key=x, value=x, mask=mask)), (x,)


def make_sdpa(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "Baseline: relpos.mha.MultiHeadAttention on its SDPA path (same projections, no position term), same mask."
    return _layer(MultiHeadAttention, n, causal, batch, heads, d_model, device)

def make_t5(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "T5MultiHeadAttention as shipped: `toeplitz_attention` (Hankel view of the bias, diagonal-sum backward)."
    return _layer(T5MultiHeadAttention, n, causal, batch, heads, d_model, device)

def make_bias_as_mask(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "The `[1, heads, n, n]` bias requiring grad, through plain SDPA (its math path on CPU)."
    return _layer(BiasAsMask, n, causal, batch, heads, d_model, device)


CASES = {name: f'bench.t5:make_{name}' for name in ['sdpa', 't5', 'bias_as_mask']}

def main(ns=(512, 1024, 2048), reps=3, cases=None, causal=(False, True)):
    cases = {c: CASES[c] for c in (cases or CASES)}
    configs = [dict(n=n, causal=c) for c in causal for n in ns]
    return bench_table(cases, configs, baseline='sdpa', reps=reps,
                       title='Attention layer, batch 4, 8 heads, d_model 512, dropout 0 (causal: ratio to SDPA with the same mask)')

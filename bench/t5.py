"Benchmark for `relpos.t5` (nbs/08_t5.ipynb): the attention layer with T5's bucket bias against plain SDPA, without and with a causal mask."
import torch
import torch.nn.functional as F
from relpos.mha import MultiHeadAttention
from relpos.t5 import T5MultiHeadAttention
from relpos.bench import bench_table


class BiasAsMask(T5MultiHeadAttention):
    "The common recipe (x-transformers, Hugging Face T5): the `[1, heads, n, n]` bias built, handed to SDPA as a float mask."
    def attention_fast(self, query, key, value, mask):
        return MultiHeadAttention.sdpa(self, query, key, value, mask, self.position_bias(query.shape[0], key.shape[0]))


class IsCausalSDPA(MultiHeadAttention):
    "Plain SDPA told `is_causal=True` (square self-attention only): its fused kernel skips the blocks above the diagonal."
    def attention_fast(self, query, key, value, mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).permute(2, 0, 1, 3)


def _layer(cls, n, causal, batch, heads, d_model, device):
    torch.manual_seed(0)
    m = cls(heads, d_model, dropout_prob=0.0).to(device)
    x = torch.randn(n, batch, d_model, device=device, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None] if causal else None  # [n, n, 1]
    return (lambda x: m(query=x, key=x, value=x, mask=mask)), (x,)


def make_sdpa(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "Baseline: relpos.mha.MultiHeadAttention on its SDPA path (same projections, no position term), same mask."
    return _layer(MultiHeadAttention, n, causal, batch, heads, d_model, device)

def make_sdpa_is_causal(n, causal=True, batch=4, heads=8, d_model=512, device='cpu'):
    "Causal rows only: `F.scaled_dot_product_attention(is_causal=True)` with the same projections (no mask tensor)."
    if not causal: raise ValueError("sdpa_is_causal is a causal case")
    return _layer(IsCausalSDPA, n, False, batch, heads, d_model, device)

def make_t5(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "T5MultiHeadAttention as shipped: `toeplitz_attention` (Hankel view of the bias, diagonal-sum backward)."
    return _layer(T5MultiHeadAttention, n, causal, batch, heads, d_model, device)

def make_bias_as_mask(n, causal=False, batch=4, heads=8, d_model=512, device='cpu'):
    "The `[1, heads, n, n]` bias requiring grad, through plain SDPA (its math path on CPU)."
    return _layer(BiasAsMask, n, causal, batch, heads, d_model, device)


CASES = {name: f'bench.t5:make_{name}' for name in ['sdpa', 'sdpa_is_causal', 't5', 'bias_as_mask']}

def main(ns=(512, 1024, 2048), reps=3):
    full = {c: CASES[c] for c in ['sdpa', 't5', 'bias_as_mask']}
    title = 'Attention layer, batch 4, 8 heads, d_model 512, dropout 0'
    plain = bench_table(full, [dict(n=n) for n in ns], baseline='sdpa', reps=reps, title=title + ', no mask')
    causal = bench_table(CASES, [dict(n=n, causal=True) for n in ns], baseline='sdpa', reps=reps,
                         title=title + ', causal mask [n, n, 1] (sdpa_is_causal: no mask, is_causal=True)')
    return plain + '\n\n' + causal

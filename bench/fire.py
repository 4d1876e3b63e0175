"Benchmark for `relpos.fire` (nbs/08b_fire.ipynb): the attention layer with FIRE's bias against causal SDPA, causal self-attention."
import torch
import torch.nn.functional as F
from relpos.mha import MultiHeadAttention
from relpos.fire import FireMultiHeadAttention
from relpos.bench import bench_table


class BiasAsMask(FireMultiHeadAttention):
    "The readable recipe: the `[1, heads, n, n]` bias built with the MLP, handed to SDPA as a float mask (with the causal mask)."
    def attention_fast(self, query, key, value, mask):
        return MultiHeadAttention.sdpa(self, query, key, value, mask, self.position_bias(query.shape[0], key.shape[0]))


class IsCausalSDPA(MultiHeadAttention):
    "Plain SDPA told `is_causal=True`: its fused kernel skips the blocks above the diagonal."
    def attention_fast(self, query, key, value, mask):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale).permute(2, 0, 1, 3)


def _layer(cls, n, batch, heads, d_model, device):
    torch.manual_seed(0)
    m = cls(heads, d_model, dropout_prob=0.0).to(device)
    x = torch.randn(n, batch, d_model, device=device, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None]   # [n, n, 1]: causal
    return (lambda x: m(query=x, key=x, value=x, mask=mask)), (x,)


def make_sdpa_is_causal(n, batch=4, heads=8, d_model=512, device='cpu'):
    "Baseline: the same projections around `F.scaled_dot_product_attention(is_causal=True)`, no position term."
    return _layer(IsCausalSDPA, n, batch, heads, d_model, device)

def make_fire(n, batch=4, heads=8, d_model=512, device='cpu'):
    "FireMultiHeadAttention as shipped, causal mask: `fire_attention` on CPU (FlexAttention on CUDA)."
    return _layer(FireMultiHeadAttention, n, batch, heads, d_model, device)

def make_bias_as_mask(n, batch=4, heads=8, d_model=512, device='cpu'):
    "The built `[1, heads, n, n]` bias requiring grad, through plain SDPA (its math path on CPU)."
    return _layer(BiasAsMask, n, batch, heads, d_model, device)


CASES = {name: f'bench.fire:make_{name}' for name in ['sdpa_is_causal', 'fire', 'bias_as_mask']}

def main(ns=(1024, 2048), reps=3):
    return bench_table(CASES, [dict(n=n) for n in ns], baseline='sdpa_is_causal', reps=reps,
                       title='Attention layer, batch 4, 8 heads, d_model 512, dropout 0, causal self-attention, forward + backward')

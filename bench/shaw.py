"""Benchmark of chapter 03 (Shaw et al. relation-aware attention): forward+backward of one attention call,
batch 4, 8 heads, hidden 512, k=16, against plain `scaled_dot_product_attention` with the same projections; with a
causal mask against SDPA with `is_causal=True`; and forward only under `torch.inference_mode`."""
from functools import partial
import torch
import torch.nn.functional as F
from relpos.bench import bench_table
from relpos.fourier import sdpa_bias
from relpos.shaw import RelationAwareMultiHeadAttention
from bench.mha import causal_mask   # the causal and inference tables use bench.mha's shared baselines too


class PlainSDPA(RelationAwareMultiHeadAttention):
    "The same projections and output layer, no position term: one `F.scaled_dot_product_attention` call."
    def attention_fast(self, q, k, v, keep): return F.scaled_dot_product_attention(q, k, v)


class KeyTermSDPA(RelationAwareMultiHeadAttention):
    "The key term only (value term dropped) as a trainable additive bias to the fused kernel (`relpos.fourier.sdpa_bias`)."
    def attention_fast(self, q, k, v, keep):
        n_q, n_k = q.shape[2], k.shape[2]
        idx = self.relative_position_k.buckets(n_q, n_k, n_k - n_q).expand(*q.shape[:2], n_q, n_k)
        bias = (q @ self.relative_position_k.position_embeddings.T * self.scale).gather(-1, idx)  # [b, h, n_q, n_k]
        return sdpa_bias(q, k, v, bias, self.scale)


def _make(cls, n, batch=4, heads=8, hidden=512, k=16, device='cpu', mem=0, causal=False, inference=False, **call):
    """One step of `cls(hidden, heads, k)` on `n` queries over `mem + n` keys; `causal`: query i sees keys up to `mem + i`
    (Shaw's mask layout `[batch|1, seq_q, seq_k]`); `inference`: forward only under `torch.inference_mode`."""
    torch.manual_seed(0)
    module = cls(hidden, heads, k).to(device).train()
    x = torch.randn(batch, mem + n, hidden, device=device, requires_grad=not inference)
    mask = causal_mask(mem + n, device)[-n:, :, 0][None] if causal else None   # relpos's [n, n, 1] -> [1, n, mem + n]
    def fn(x):
        with torch.inference_mode(inference):
            return module(x[:, -n:], x, x, mask=mask, **call)
    return fn, (x,)


make_sdpa = partial(_make, PlainSDPA)                                  # baseline: same projections, no position term
make_fast = partial(_make, RelationAwareMultiHeadAttention)            # fast path (`relation_aware_attention`)
make_key_only_sdpa = partial(_make, KeyTermSDPA)                       # key term only, fused kernel
make_readable = partial(_make, RelationAwareMultiHeadAttention, need_weights=True)  # readable path, `[n, n, d]` tables
make_fast_causal = partial(_make, RelationAwareMultiHeadAttention, causal=True)  # fast path, causal mask: hidden keys skipped


def make_seed(n, batch=4, heads=8, hidden=512, k=16, device='cpu', mem=0):
    "Seed 002's module, built for this length (its tables are rebuilt per step here, as training would need)."
    from tests.seed_shaw import RelationAwareMultiHeadAttention as Seed, RelativePosition
    if mem: raise ValueError("the seed's module supports only seq_len_q == seq_len_k")
    torch.manual_seed(0)
    module = Seed(hidden, heads, k, n).to(device).train()
    def fn(x):  # fresh tables from the parameters each step (the seed's __init__ graph works once)
        a_k, a_v = module.relative_position_k(n, n), module.relative_position_v(n, n)
        for head in module.attention_heads: head.k_bias_matrix, head.v_bias_matrix = a_k, a_v
        return module(x, x, x)
    return fn, (torch.randn(batch, n, hidden, device=device, requires_grad=True),)


CASES = {name: f'bench.shaw:make_{name}' for name in ['sdpa', 'fast', 'key_only_sdpa', 'readable', 'seed']}


def main(ns=(128, 512, 1024, 2048), reps=3, cases=None, mem=(0,), causal_ns=(1024, 2048), inference_ns=(2048,),
         long_ns=(1024, 2048, 4096, 8192)):
    "The table of every case, a causal table (baseline: SDPA with `is_causal=True`), a forward-only inference table, and long sequences at batch 1."
    cases = {c: CASES[c] for c in (cases or CASES)}
    configs = [dict(n=n, mem=m) for n in ns for m in mem]
    tables = [bench_table(cases, configs, baseline='sdpa', reps=reps,
                          title='shaw: forward+backward, batch 4, 8 heads, hidden 512, k=16' + (' (mem: extra keys before the queries)' if any(mem) else ''))]
    if causal_ns:
        tables.append(bench_table({'sdpa causal': 'bench.mha:make_sdpa_causal', 'fast causal': 'bench.shaw:make_fast_causal',
                                   'fast': 'bench.shaw:make_fast'},
                                  [dict(n=n) for n in causal_ns], baseline='sdpa causal', reps=reps,
                                  title='shaw, causal mask: forward+backward, batch 4, 8 heads, hidden 512, k=16 '
                                        '(baseline: the same projections, SDPA with is_causal=True; fast: no mask)'))
    if inference_ns:
        tables.append(bench_table({'sdpa': 'bench.mha:make_sdpa_plain', 'sdpa causal': 'bench.mha:make_sdpa_causal',
                                   'fast': 'bench.shaw:make_fast', 'fast causal': 'bench.shaw:make_fast_causal'},
                                  [dict(n=n, inference=True) for n in inference_ns], baseline='sdpa', backward=False, reps=reps,
                                  title='shaw, inference: forward only under torch.inference_mode, batch 4, 8 heads, hidden 512, k=16 '
                                        '(baseline: the same projections, SDPA, no mask)'))
    if long_ns:
        tables.append(bench_table({'sdpa': 'bench.shaw:make_sdpa', 'fast': 'bench.shaw:make_fast'},
                                  [dict(n=n, batch=1) for n in long_ns], baseline='sdpa', reps=2,
                                  title='shaw, long sequences: forward+backward, batch 1, 8 heads, hidden 512, k=16, no mask'))
    return '\n\n'.join(tables)

"Benchmark of `relpos.mha.MultiHeadAttention`: fast path, readable path and labml_nn against plain SDPA."
import torch
import torch.nn.functional as F


def _inputs(n, batch, d_model, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, batch, d_model, generator=g).to(device).requires_grad_()
    kv = torch.randn(n, batch, d_model, generator=g).to(device).requires_grad_()
    mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None]   # causal, [n, n, 1]
    return q, kv, mask


def make_sdpa(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "Plain `scaled_dot_product_attention` on `[batch, heads, n, d_k]` tensors, causal, no projections."
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d_model // heads, generator=g).to(device).requires_grad_()
               for _ in range(3))
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), (q, k, v)


def _module_case(module, n, batch, d_model, device, **call_kw):
    module = module.to(device)
    q, kv, mask = _inputs(n, batch, d_model, device)
    return (lambda q, kv: module(query=q, key=kv, value=kv, mask=mask, **call_kw)), (q, kv)


def make_fast(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "relpos `MultiHeadAttention`, fast path (SDPA), causal bool mask."
    from relpos.mha import MultiHeadAttention
    torch.manual_seed(0)
    return _module_case(MultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device)


def make_readable(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "relpos `MultiHeadAttention`, readable path (`need_weights=True`)."
    from relpos.mha import MultiHeadAttention
    torch.manual_seed(0)
    return _module_case(MultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device,
                        need_weights=True)


def make_labml(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "labml_nn 0.5.1 `MultiHeadAttention` (dev-only reference)."
    from labml_nn.transformers.mha import MultiHeadAttention
    torch.manual_seed(0)
    return _module_case(MultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device)


def make_torch_mha(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "`torch.nn.MultiheadAttention` (same projections, SDPA inside), causal, `need_weights=False`."
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(d_model, heads, dropout=0.0).to(device)
    q, kv, mask = _inputs(n, batch, d_model, device)
    blocked = ~mask[..., 0]                          # torch's bool attn_mask: True = may NOT attend
    return (lambda q, kv: module(q, kv, kv, attn_mask=blocked, need_weights=False)[0]), (q, kv)


def main(ns=(256, 1024), **kw):
    from relpos.bench import bench_table
    cases = {'sdpa': 'bench.mha:make_sdpa', 'relpos fast': 'bench.mha:make_fast',
             'relpos readable': 'bench.mha:make_readable', 'labml_nn': 'bench.mha:make_labml',
             'torch.nn.MultiheadAttention': 'bench.mha:make_torch_mha'}
    return bench_table(cases, [dict(n=n, **kw) for n in ns], baseline='sdpa',
                       title='MultiHeadAttention, causal mask, batch 4, 8 heads, d_model 512')


# ---- shared by the causal and inference rows of every chapter's benchmark (issue: compare causal with causal SDPA)

class CausalSDPA(torch.nn.Module):
    "Baseline of the causal rows: `MultiHeadAttention`'s projections around SDPA with `is_causal=True` (skips the masked half)."
    def __init__(self, heads, d_model):
        super().__init__()
        from relpos.mha import MultiHeadAttention
        self.mha = MultiHeadAttention(heads, d_model, dropout_prob=0.0)
    def forward(self, *, query, key, value, mask=None):
        m = self.mha
        if query.shape[0] != key.shape[0]: raise ValueError("CausalSDPA: is_causal needs as many queries as keys")
        q, k, v = (p(x).permute(1, 2, 0, 3) for p, x in ((m.query, query), (m.key, key), (m.value, value)))
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.scale)
        return m.output(x.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1))


def causal_mask(n, device='cpu'):
    "`[n, n, 1]` bool, True = may attend: query i sees keys 0..i (relpos's mask layout)."
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()[..., None]


def self_attention_case(module, n, batch, d_model, device, causal=False, inference=False, **call):
    """`(fn, inputs)` of self-attention over `x [n, batch, d_model]`; `causal`: with `causal_mask`; `inference`: forward
    only under `torch.inference_mode` (time it with `bench_table(..., backward=False)`)."""
    torch.manual_seed(0)
    module = module.to(device)
    x = torch.randn(n, batch, d_model, device=device, requires_grad=not inference)
    mask = causal_mask(n, device) if causal else None
    def fn(x):
        with torch.inference_mode(inference):
            return module(query=x, key=x, value=x, **({'mask': mask} if mask is not None else {}), **call)
    return fn, (x,)


def make_sdpa_causal(n, batch=4, heads=8, d_model=512, device='cpu', inference=False, **kw):
    "The causal baseline: the same projections, `F.scaled_dot_product_attention(..., is_causal=True)`."
    return self_attention_case(CausalSDPA(heads, d_model), n, batch, d_model, device, inference=inference)


def make_sdpa_plain(n, batch=4, heads=8, d_model=512, device='cpu', inference=False, **kw):
    "The non-causal baseline: `MultiHeadAttention` (the same projections, SDPA), no mask."
    from relpos.mha import MultiHeadAttention
    return self_attention_case(MultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device,
                               inference=inference)


def make_sdpa_inference(n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "The inference baseline: `make_sdpa_plain` forward only, under `torch.inference_mode`."
    return make_sdpa_plain(n, batch, heads, d_model, device, inference=True)

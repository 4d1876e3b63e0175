"""Benchmark of chapter 02 (Transformer-XL relative attention): forward+backward of one attention call,
batch 4, 8 heads, d_model 512, against plain `scaled_dot_product_attention` with the same projections."""
from functools import partial
import torch
from relpos.bench import bench_table
from relpos.mha import MultiHeadAttention
from relpos.relative_mha import RelativeMultiHeadAttention, XLRelativeMultiHeadAttention


def _case(module, n, batch, d_model, device, mem, **call):
    torch.manual_seed(0)
    module = module.to(device).train()   # dropout_prob=0: train mode only to keep autograd as in training
    with torch.no_grad():
        for name, p in module.named_parameters():
            if 'pos' in name or name in ('u', 'v'): p.normal_(0, 0.02)
    x = torch.randn(mem + n, batch, d_model, device=device, requires_grad=True)
    def fn(x): return module(query=x[-n:], key=x, value=x, **call)
    return fn, (x,)


def make_sdpa(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "relpos.mha.MultiHeadAttention: the same projections, no position term, `F.scaled_dot_product_attention`."
    return _case(MultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device, mem)


def make_fast(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "RelativeMultiHeadAttention, fast path (blockwise `relative_attention`; recompute=None: at these sizes the softmax is kept for backward)."
    return _case(RelativeMultiHeadAttention(heads, d_model, dropout_prob=0.0, P=max(4096, n + mem)),
                 n, batch, d_model, device, mem)


def make_fast_recompute(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "RelativeMultiHeadAttention, fast path with `recompute=True` (softmax recomputed in backward, not kept)."
    module = RelativeMultiHeadAttention(heads, d_model, dropout_prob=0.0, P=max(4096, n + mem))
    module.recompute = True
    return _case(module, n, batch, d_model, device, mem)


def make_xl_fast(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "XLRelativeMultiHeadAttention (sinusoid R, W_kR, u, v), fast path."
    return _case(XLRelativeMultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device, mem)


def make_readable(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "RelativeMultiHeadAttention, readable path (labml's get_scores + shift_right, weights kept)."
    return _case(RelativeMultiHeadAttention(heads, d_model, dropout_prob=0.0, P=max(4096, n + mem)),
                 n, batch, d_model, device, mem, need_weights=True)


def make_labml(n, batch=4, heads=8, d_model=512, device='cpu', mem=0):
    "labml_nn's RelativeMultiHeadAttention (dev-only dependency)."
    import IPython.core.display, IPython.display  # labml 0.4.168 needs these names on current IPython
    IPython.core.display.display, IPython.core.display.HTML = IPython.display.display, IPython.display.HTML
    from labml_nn.transformers.xl.relative_mha import RelativeMultiHeadAttention as Labml
    return _case(Labml(heads, d_model, dropout_prob=0.0), n, batch, d_model, device, mem)


def _self_attention(module, n, batch, d_model, device, **kw):
    from bench.mha import self_attention_case
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if 'pos' in name or name in ('u', 'v'): p.normal_(0, 0.02)
    return self_attention_case(module.train(), n, batch, d_model, device, **kw)


def _variant(build, n, batch=4, heads=8, d_model=512, device='cpu', **kw):
    "Self-attention through the layer `build(heads, d_model, n)`; `causal=True`: the causal mask (the blocks skip the keys it hides); `inference=True`: forward only under `torch.inference_mode`."
    return _self_attention(build(heads, d_model, n), n, batch, d_model, device, **kw)

_learned = lambda heads, d_model, n: RelativeMultiHeadAttention(heads, d_model, 0.0, P=max(4096, n))   # labml's learned tables
_paper = lambda heads, d_model, n: XLRelativeMultiHeadAttention(heads, d_model, 0.0)                  # sinusoid R, W_kR, u, v
make_fast_causal = partial(_variant, _learned, causal=True)
make_xl_fast_causal = partial(_variant, _paper, causal=True)
make_fast_inference = partial(_variant, _learned, inference=True)
make_xl_fast_inference = partial(_variant, _paper, inference=True)


CASES = {name: f'bench.relative_mha:make_{name}' for name in ['sdpa', 'fast', 'fast_recompute', 'xl_fast', 'readable', 'labml']}
CAUSAL = {'sdpa_causal': 'bench.mha:make_sdpa_causal', 'fast': 'bench.relative_mha:make_fast_causal',
          'xl_fast': 'bench.relative_mha:make_xl_fast_causal'}
INFERENCE = {'sdpa': 'bench.mha:make_sdpa_inference', 'fast': 'bench.relative_mha:make_fast_inference',
             'xl_fast': 'bench.relative_mha:make_xl_fast_inference'}


def main(ns=(128, 512, 1024, 2048), reps=2, cases=None, long=(1024, 2048, 4096, 8192)):
    "Four tables: training with and without memory; causal training against causal SDPA; inference; long sequences at batch 1."
    cases = {k: CASES[k] for k in (cases or CASES)}
    configs = [dict(n=n, mem=m) for n in ns for m in (0, n)]
    return '\n\n'.join([
        bench_table(cases, configs, baseline='sdpa', reps=reps,
                    title='relative_mha: forward+backward, batch 4, 8 heads, d_model 512 (mem: memory length, keys = mem + n)'),
        bench_table(CAUSAL, [dict(n=n) for n in ns if n >= 1024], baseline='sdpa_causal', reps=reps,
                    title='relative_mha, causal: forward+backward, batch 4, 8 heads, d_model 512, against SDPA with is_causal=True'),
        bench_table(INFERENCE, [dict(n=n) for n in ns if n >= 1024], baseline='sdpa', reps=reps, backward=False,
                    title='relative_mha, inference: forward under torch.inference_mode, batch 4, 8 heads, d_model 512'),
        bench_table({'sdpa': 'bench.relative_mha:make_sdpa', 'fast': 'bench.relative_mha:make_fast',
                     'fast_recompute': 'bench.relative_mha:make_fast_recompute'},
                    [dict(n=n, batch=1) for n in long], baseline='sdpa', reps=reps,
                    title='relative_mha, long sequences: forward+backward, batch 1, 8 heads, d_model 512, recompute=None (default) and True')])

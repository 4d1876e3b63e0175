"""Benchmark for `relpos.fourier` (nbs/04_fourier.ipynb): building the bias; the attention layer forward+backward against
plain SDPA, under a causal mask against causal SDPA, and forward-only (inference) against plain SDPA."""
import torch
from relpos.mha import MultiHeadAttention
from relpos.fourier import RelativeFourierPositions, FourierMultiHeadAttention
from relpos.bench import bench_table
from bench.mha import self_attention_case, make_sdpa_causal, make_sdpa_plain  # noqa: F401 (cases named below)

def _x(n, batch, d_model, device):
    return torch.randn(n, batch, d_model, device=device, requires_grad=True)

def _layer(cls, n, batch, heads, d_model, device, **kw):
    torch.manual_seed(0)
    m = cls(heads, d_model, dropout_prob=0.0, **kw).to(device)
    x = _x(n, batch, d_model, device)
    return (lambda x: m(query=x, key=x, value=x)), (x,)

def make_sdpa(n, batch=4, heads=8, d_model=512, device='cpu'):
    "Baseline: relpos.mha.MultiHeadAttention on its SDPA path, no position term."
    return _layer(MultiHeadAttention, n, batch, heads, d_model, device)

def make_fourier(n, batch=4, heads=8, d_model=512, device='cpu'):
    "FourierMultiHeadAttention as shipped, no mask: its distance table to the Toeplitz kernel (`relpos.bias.toeplitz_attention`), no `[n, n]` bias."
    return _layer(FourierMultiHeadAttention, n, batch, heads, d_model, device)

class _MeliadStyle(FourierMultiHeadAttention):
    "meliad's recipe in PyTorch: einsum bias, handed to plain SDPA as a float mask that requires grad."
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw); self.positions.fast = False
    def sdpa(self, query, key, value, mask, bias=None): return MultiHeadAttention.sdpa(self, query, key, value, mask, bias)

def make_meliad_style(n, batch=4, heads=8, d_model=512, device='cpu'):
    return _layer(_MeliadStyle, n, batch, heads, d_model, device)

def _bias(n, fast, heads, device):
    torch.manual_seed(0)
    m = RelativeFourierPositions(heads).to(device)
    m.fast = fast
    m(n, n)  # tables cached for this size, as in a training loop
    return (lambda rot: m(n, n)), (m.rotation_matrix,)

def make_bias_einsum(n, batch=4, heads=8, d_model=512, device='cpu'):
    "meliad's O(h·n²·p) einsum bias (forward+backward to the rotation matrix)."
    return _bias(n, False, heads, device)

def make_bias_fast(n, batch=4, heads=8, d_model=512, device='cpu'):
    "The O(h·n·p) distance table, expanded to [1, h, n, n]."
    return _bias(n, True, heads, device)

def make_fourier_causal(n, batch=4, heads=8, d_model=512, device='cpu', inference=False, **kw):
    "FourierMultiHeadAttention under `bench.mha.causal_mask` (query i sees keys 0..i): the keys right of the diagonal are skipped."
    torch.manual_seed(0)
    return self_attention_case(FourierMultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device,
                               causal=True, inference=inference)

def make_fourier_plain(n, batch=4, heads=8, d_model=512, device='cpu', inference=False, **kw):
    "FourierMultiHeadAttention without a mask (with `inference=True`: forward only, under `torch.inference_mode`)."
    torch.manual_seed(0)
    return self_attention_case(FourierMultiHeadAttention(heads, d_model, dropout_prob=0.0), n, batch, d_model, device,
                               inference=inference)

def main(sizes=(128, 512, 1024, 2048), causal_sizes=(1024, 2048), inference_sizes=(2048,), long_sizes=(1024, 2048, 4096, 8192), reps=5):
    configs = [dict(n=n) for n in sizes]
    bias = bench_table({'einsum': 'bench.fourier:make_bias_einsum', 'fast': 'bench.fourier:make_bias_fast'},
                       configs, baseline='einsum', reps=reps, title='Building the bias [1, 8, n, n] (h=8, p=128)')
    attn = bench_table({'sdpa': 'bench.fourier:make_sdpa', 'fourier': 'bench.fourier:make_fourier',
                        'meliad_style': 'bench.fourier:make_meliad_style'},
                       configs, baseline='sdpa', reps=reps,
                       title='Attention layer, batch 4, 8 heads, d_model 512, dropout 0')
    causal = bench_table({'sdpa_causal': 'bench.mha:make_sdpa_causal', 'fourier': 'bench.fourier:make_fourier_causal'},
                         [dict(n=n) for n in causal_sizes], baseline='sdpa_causal', reps=reps,
                         title='Causal mask, batch 4, 8 heads, d_model 512 (sdpa_causal: is_causal=True)')
    inference = bench_table({'sdpa': 'bench.mha:make_sdpa_plain', 'sdpa_causal': 'bench.mha:make_sdpa_causal',
                             'fourier': 'bench.fourier:make_fourier_plain', 'fourier_causal': 'bench.fourier:make_fourier_causal'},
                            [dict(n=n, inference=True) for n in inference_sizes], baseline='sdpa', backward=False, reps=reps,
                            title='Inference (forward only, torch.inference_mode), no mask and causal, batch 4, 8 heads, d_model 512')
    long = bench_table({'sdpa': 'bench.fourier:make_sdpa', 'fourier': 'bench.fourier:make_fourier'},
                       [dict(n=n, batch=1) for n in long_sizes], baseline='sdpa', reps=2,
                       title='Long sequences: attention layer, batch 1, 8 heads, d_model 512, no mask')
    return '\n\n'.join([bias, attn, causal, inference, long])

"Benchmark for `relpos.fourier` (nbs/04_fourier.ipynb): building the bias, and full attention forward+backward against plain SDPA."
import torch
from relpos.mha import MultiHeadAttention
from relpos.fourier import RelativeFourierPositions, FourierMultiHeadAttention
from relpos.bench import bench_table

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
    "FourierMultiHeadAttention as shipped: fast bias, trainable, bias gradient on the fused CPU kernel."
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

def main(sizes=(128, 512, 1024, 2048), reps=5):
    configs = [dict(n=n) for n in sizes]
    bias = bench_table({'einsum': 'bench.fourier:make_bias_einsum', 'fast': 'bench.fourier:make_bias_fast'},
                       configs, baseline='einsum', reps=reps, title='Building the bias [1, 8, n, n] (h=8, p=128)')
    attn = bench_table({'sdpa': 'bench.fourier:make_sdpa', 'fourier': 'bench.fourier:make_fourier',
                        'meliad_style': 'bench.fourier:make_meliad_style'},
                       configs, baseline='sdpa', reps=reps,
                       title='Attention layer, batch 4, 8 heads, d_model 512, dropout 0')
    return bias + '\n\n' + attn

"Benchmark of `relpos.shift.shift_right`: Transformer-XL's position term by one product and a shift, against a gather of R[j - i] per pair."
import torch


def _inputs(n, heads, d_k, device, seed=0):
    "Queries `[n, heads, d_k]`, keys `[n, heads, d_k]` and the table window `R [2n, heads, d_k]` (row w: distance w - n)."
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(m, heads, d_k, generator=g).to(device).requires_grad_() for m in (n, n, 2 * n))


def make_content(n, heads=4, d_k=32, device='cpu', **kw):
    "The baseline: the content scores `Q K^T` alone, `[n, n, heads]`."
    q, k, _ = _inputs(n, heads, d_k, device)
    return (lambda q, k: torch.einsum('ihd,jhd->ijh', q, k)), (q, k)


def make_shift(n, heads=4, d_k=32, device='cpu', **kw):
    "`Q R^T` against the `2n` rows of the window, `shift_right`, the last `n` columns: `[n, n, heads]`."
    from relpos.shift import shift_right
    q, _, R = _inputs(n, heads, d_k, device)
    return (lambda q, R: shift_right(torch.einsum('ihd,whd->iwh', q, R))[:, -n:]), (q, R)


def make_gather(n, heads=4, d_k=32, device='cpu', **kw):
    "R[j - i] gathered for every pair, `[n, n, heads, d_k]`, then one dot product per pair."
    q, _, R = _inputs(n, heads, d_k, device)
    rows = torch.arange(n, device=device)[None, :] - torch.arange(n, device=device)[:, None] + n   # window row of r = j - i
    return (lambda q, R: torch.einsum('ihd,ijhd->ijh', q, R[rows])), (q, R)


def main(ns=(128, 512), **kw):
    from relpos.bench import bench_table
    cases = {'content Q K^T': 'bench.shift:make_content', 'shift_right': 'bench.shift:make_shift',
             'gather R[j - i]': 'bench.shift:make_gather'}
    return bench_table(cases, [dict(n=n, **kw) for n in ns], baseline='content Q K^T',
                       title='Position term of n queries against n keys, 4 heads, d_k 32, forward + backward')

"Benchmark for `relpos.context_choice` (nbs/05_context_choice.ipynb): the gates' training step against the local attention they mix."
import torch
import torch.nn.functional as F
from relpos.context_choice import ContextChoiceConstant, ContextChoiceLinear
from relpos.bench import bench_table


def _inputs(n, batch=4, d_model=512, device='cpu', seed=0):
    "The two attention results a gate mixes, batch first `[batch, n, d_model]`, both requiring grad."
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, n, d_model, generator=g).to(device).requires_grad_() for _ in range(2))


def make_attention(n, batch=4, heads=8, d_model=512, device='cpu'):
    "The local side alone: causal SDPA over the chunk, `[batch, heads, n, d_model / heads]` (no projections)."
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d_model // heads, generator=g).to(device).requires_grad_() for _ in range(3))
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), (q, k, v)


def _gate_case(cls, n, batch=4, heads=8, d_model=512, device='cpu'):
    torch.manual_seed(0)
    gate = cls(heads, d_model).to(device)
    def step(local, global_):
        out = gate(local, global_)
        return out + 0 * gate.get_loss_component()   # the auxiliary loss in the graph, as in training
    return step, _inputs(n, batch, d_model, device)


def make_constant(n, **kw):
    "`ContextChoiceConstant`, the paper's gate: one logit per head, with its auxiliary loss."
    return _gate_case(ContextChoiceConstant, n, **kw)


def make_linear(n, **kw):
    "`ContextChoiceLinear`, the seed's per-token gate, with its auxiliary loss."
    return _gate_case(ContextChoiceLinear, n, **kw)


def make_lerp(n, batch=4, heads=8, d_model=512, device='cpu'):
    "Not shipped: the constant gate's mix as one `torch.lerp` (one pass over memory, other rounding), no auxiliary loss."
    torch.manual_seed(0)
    bias = torch.randn(heads, device=device, requires_grad=True)
    def step(local, global_):
        g = torch.sigmoid(bias)[:, None]                                                # [heads, 1]
        return torch.lerp(global_.unflatten(-1, (heads, -1)), local.unflatten(-1, (heads, -1)), g).flatten(-2)
    return step, _inputs(n, batch, d_model, device)


def main(sizes=(512, 2048), reps=5):
    return bench_table({'local attention': 'bench.context_choice:make_attention',
                        'constant gate': 'bench.context_choice:make_constant',
                        'linear gate': 'bench.context_choice:make_linear',
                        'lerp': 'bench.context_choice:make_lerp'},
                       [dict(n=n) for n in sizes], baseline='local attention', reps=reps,
                       title='A gate against the local attention it mixes: forward+backward, batch 4, 8 heads, d_model 512')

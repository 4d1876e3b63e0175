"""Benchmark for `relpos.models` (nbs/09_models.ipynb): one `DecoderLM` training step per position method, against
position='none'; and one attention layer per method under a causal mask, training and inference, against causal SDPA.
Every table also divides each case's time by rotary's from the same run (its last column); every method of
`relpos.models.POSITIONS` is a case of each."""
import torch
from relpos.models import DecoderLM, POSITIONS, POSITION_BUILDERS, causal_mask

N_VOCAB = 256

def make(position, n, batch=4, d_model=256, heads=4, n_layers=4, device='cpu'):
    "A `DecoderLM` with the defaults' sizes trained at length `n`; the step is forward + backward of the logits."
    torch.manual_seed(0)
    lm = DecoderLM(N_VOCAB, d_model=d_model, heads=heads, n_layers=n_layers, position=position, max_len=n).to(device)
    tokens = torch.randint(0, N_VOCAB, (batch, n), device=device)
    return (lambda tokens: lm(tokens)[0]), (tokens,)

def make_layer(position, n, batch=4, d_model=512, heads=8, device='cpu', inference=False):
    """One attention layer of `position` as `DecoderLM` builds it, self-attention over `[batch, n, d_model]` with the
    causal mask; `inference`: forward only, under `torch.inference_mode`."""
    torch.manual_seed(0)
    if position == 'sdpa_causal':   # the baseline: the same projections, SDPA with is_causal=True
        from bench.mha import CausalSDPA
        sdpa = CausalSDPA(heads, d_model)
        attn = lambda q, k, v, mask: sdpa(query=q.transpose(0, 1), key=k.transpose(0, 1), value=v.transpose(0, 1)).transpose(0, 1)
    else:
        attn = POSITION_BUILDERS[position](d_model, heads, 0.0, n, 0)
    if isinstance(attn, torch.nn.Module): attn.to(device)
    else: sdpa.to(device)
    x = torch.randn(batch, n, d_model, device=device, requires_grad=not inference)
    mask = causal_mask(n, n, device)
    def fn(x):
        with torch.inference_mode(inference): return attn(x, x, x, mask)
    return fn, (x,)

def _factory(make_fn, position, **fixed):
    f = lambda n, **kw: make_fn(position, n, **fixed, **kw)
    f.__doc__ = f"{make_fn.__name__}({position!r}, {fixed})"
    return f

LAYER_CASES = ('sdpa_causal',) + tuple(p for p in POSITIONS if p != 'absolute')   # 'absolute' is 'none' at the layer
for _p in POSITIONS: globals()[f"make_{_p}"] = _factory(make, _p)
for _p in LAYER_CASES:
    globals()[f"make_train_{_p}"] = _factory(make_layer, _p)
    globals()[f"make_infer_{_p}"] = _factory(make_layer, _p, inference=True)

def main(sizes=(128, 512), reps=3, layer_n=2048,
         clock='wall',   # 'cpu': CPU time of the process, which other jobs on a shared machine distort least
         threads=None):  # torch threads for the run (None: torch's default)
    "The three tables of chapter 09; with `clock='cpu', threads=1` every case is timed in CPU time on one thread."
    before = torch.get_num_threads()
    if threads is not None: torch.set_num_threads(threads)
    try: return _tables(sizes, reps, layer_n, clock)
    finally: torch.set_num_threads(before)

def _tables(sizes, reps, layer_n, clock):
    from relpos.bench import bench_table
    return '\n\n'.join([
        bench_table({p: f"bench.models:make_{p}" for p in POSITIONS}, [dict(n=n) for n in sizes], baseline='none',
                    reps=reps, clock=clock, also='rotary', title='DecoderLM training step: batch 4, d_model 256, 4 heads, 4 layers, vocabulary 256'),
        bench_table({p: f"bench.models:make_train_{p}" for p in LAYER_CASES}, [dict(n=layer_n)], baseline='sdpa_causal',
                    reps=reps, clock=clock, also='rotary', title='One attention layer per method, causal, forward+backward: batch 4, 8 heads, d_model 512'),
        bench_table({p: f"bench.models:make_infer_{p}" for p in LAYER_CASES}, [dict(n=layer_n)], baseline='sdpa_causal',
                    reps=reps, clock=clock, backward=False, also='rotary',
                    title='One attention layer per method, causal, inference (forward under torch.inference_mode): batch 4, 8 heads, d_model 512')])

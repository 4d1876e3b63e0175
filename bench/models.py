"Benchmark for `relpos.models` (nbs/09_models.ipynb): one `DecoderLM` training step per position method, against position='none'."
import torch
from relpos.models import DecoderLM, POSITIONS

N_VOCAB = 256

def make(position, n, batch=4, d_model=256, heads=4, n_layers=4, device='cpu'):
    "A `DecoderLM` with the defaults' sizes trained at length `n`; the step is forward + backward of the logits."
    torch.manual_seed(0)
    lm = DecoderLM(N_VOCAB, d_model=d_model, heads=heads, n_layers=n_layers, position=position, max_len=n).to(device)
    tokens = torch.randint(0, N_VOCAB, (batch, n), device=device)
    return (lambda tokens: lm(tokens)[0]), (tokens,)

def _factory(position):
    f = lambda n, **kw: make(position, n, **kw)
    f.__doc__ = f"DecoderLM(position={position!r})"
    return f

for _p in POSITIONS: globals()[f"make_{_p}"] = _factory(_p)

def main(sizes=(128, 512), reps=3):
    from relpos.bench import bench_table
    return bench_table({p: f"bench.models:make_{p}" for p in POSITIONS}, [dict(n=n) for n in sizes], baseline='none',
                       reps=reps, title='DecoderLM training step: batch 4, d_model 256, 4 heads, 4 layers, vocabulary 256')

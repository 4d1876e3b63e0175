"""Rows per block on a GPU: Shaw's chunks and XL's blocks at n = 1024 and 2048, batch 4, 8 heads, d_model 512 (training
step with and without the causal mask, and inference), each size forced by patching the row function; baselines SDPA.
`python -m bench._gpu_block_rows OUT.txt` on a machine with CUDA (nbs/data/gpu_block_rows_h200.txt came from an H200).
The defaults of `relpos.mha.block_rows` off CPU rest on this sweep."""
import sys, time, torch
import relpos.shaw as shaw, relpos.relative_mha as rm
from relpos.bench import time_fwd_bwd, _step
import bench.shaw as bs, bench.relative_mha as br, bench.mha as bm
out = open(sys.argv[1], 'w')
def say(*a):
    s = ' '.join(str(x) for x in a); print(s, flush=True); out.write(s + '\n'); out.flush()
def measure(make, backward=True, **kw):
    fn, inputs = make(**kw)
    t = time_fwd_bwd(fn, *inputs, reps=7, backward=backward)
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    _step(fn, inputs, backward); torch.cuda.synchronize()
    return t * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**20
say('torch', torch.__version__, torch.cuda.get_device_name())
for n in (1024, 2048):
    say(f'n={n} sdpa', '%.2f ms %.0f MiB' % measure(br.make_sdpa, n=n, device='cuda'))
    say(f'n={n} sdpa_causal', '%.2f ms %.0f MiB' % measure(bm.make_sdpa_causal, n=n, device='cuda'))
    say(f'n={n} sdpa_infer', '%.2f ms %.0f MiB' % measure(bm.make_sdpa_inference, backward=False, n=n, device='cuda'))
    orig = shaw._chunk_rows
    for c in (None, 32, 128, 256, 512, 1024):
        if c: shaw._chunk_rows = lambda *a, _c=c: _c
        for causal in (False, True):
            say(f'n={n} shaw rows={c} causal={causal}', '%.2f ms %.0f MiB' % measure(bs.make_fast_causal if causal else bs.make_fast, n=n, device='cuda'))
        say(f'n={n} shaw rows={c} inference', '%.2f ms %.0f MiB' % measure(bs.make_fast, backward=False, n=n, device='cuda', inference=True))
        shaw._chunk_rows = orig
    orig = rm._block_rows
    for c in (None, 128, 256, 512, 1024, 2048):
        if c: rm._block_rows = lambda *a, _c=c: _c
        say(f'n={n} xl rows={c} causal=False', '%.2f ms %.0f MiB' % measure(br.make_fast, n=n, device='cuda'))
        say(f'n={n} xl rows={c} causal=True', '%.2f ms %.0f MiB' % measure(br.make_fast_causal, n=n, device='cuda'))
        say(f'n={n} xl rows={c} inference', '%.2f ms %.0f MiB' % measure(br.make_fast_inference, backward=False, n=n, device='cuda'))
        rm._block_rows = orig

"""The GPU tables: every position method's attention layer as `DecoderLM` builds it, and cached decoding against
transformers' Llama. Run on a machine with CUDA: `python -m bench cuda` (or `tools/cuda_check.sh`). Writes
nbs/data/layers_cuda.json, decode_cuda.json and flex_options_cuda.json (each with the device, torch, commit and date), which
the chapters read.

- layers: bf16 autocast (float32 parameters, as AMP training keeps them), causal self-attention, batch 4, 8 heads,
  head size 64, n = 2048 and 8192; forward+backward and forward alone (inference mode), against
  `scaled_dot_product_attention(is_causal=True)` with the same projections (its flash kernel) in the same run.
- decode: one Llama of transformers built from a config (random weights, bf16), and the same model converted with
  `DecoderLM.from_transformers`: greedy tokens/s of `generate` (relpos: its `KVCache`; transformers: dynamic and
  static cache), batch 1 and 8."""
import json, os, time
from pathlib import Path
import torch
from relpos.bench import bench_table, parse_tables
from relpos.models import POSITIONS
from bench.models import make_layer

DATA = Path(__file__).resolve().parent.parent / 'nbs' / 'data'
LAYER_CASES = ('sdpa_causal',) + tuple(p for p in POSITIONS if p != 'absolute')   # 'absolute' is 'none' at the layer


def make_amp_layer(position, n, batch=4, d_model=512, heads=8, device='cuda', inference=False):
    "`bench.models.make_layer` (one layer as `DecoderLM` builds it, causal mask) run under bf16 autocast."
    fn, inputs = make_layer(position, n, batch=batch, d_model=d_model, heads=heads, device=device, inference=inference)
    def amp(x):
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16): return fn(x)
    return amp, inputs


def _factory(position, inference):
    f = lambda n, **kw: make_amp_layer(position, n, inference=inference, **kw)
    f.__doc__ = f"make_amp_layer({position!r}, inference={inference})"
    return f

for _p in LAYER_CASES:
    globals()[f"make_train_{_p}"] = _factory(_p, False)
    globals()[f"make_infer_{_p}"] = _factory(_p, True)


def _commit() -> str:
    "The checkout's commit, with '+changes' when its tracked files differ from it (what the numbers were measured on)."
    import subprocess
    git = lambda *a: subprocess.run(['git', *a], cwd=DATA.parent.parent, capture_output=True, text=True).stdout.strip()
    head = git('rev-parse', '--short', 'HEAD') or 'unknown'
    return head + ('+changes' if git('status', '--porcelain', '--untracked-files=no') else '')


def _stamp(device) -> dict:
    name = torch.cuda.get_device_name() if torch.device(device).type == 'cuda' else 'cpu'
    return dict(device=name, torch=torch.__version__, commit=_commit(),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))


def layers(ns=(2048, 8192), reps=10, store=True, device='cuda', modes=('train', 'infer')) -> str:
    """Training step (`train`) and inference (`infer`) of every method's layer against causal SDPA, bf16 autocast; each
    table stored in layers_cuda.json as soon as it is measured (a table of another mode already there is kept)."""
    shape = 'causal self-attention, batch 4, 8 heads, d_model 512 (head 64), bf16 autocast (baseline: SDPA is_causal=True)'
    what = {'train': 'forward+backward', 'infer': 'inference (forward under torch.inference_mode)'}
    path = DATA / 'layers_cuda.json'
    stored = json.loads(path.read_text()).get('by_mode', {}) if store and path.exists() else {}
    out = []
    for mode in modes:
        for n in ns:   # one table per size, stored as soon as it is measured
            table = bench_table({p: f"bench.cuda:make_{mode}_{p}" for p in LAYER_CASES}, [dict(n=n, device=device)],
                                baseline='sdpa_causal', reps=reps, backward=mode == 'train',
                                title=f'One attention layer per method, {what[mode]}: {shape}')
            out.append(table)
            stored.setdefault(mode, {})[str(n)] = dict(**_stamp(device), markdown=table, table=parse_tables(table)[0])
            if store: path.write_text(json.dumps(dict(by_mode=stored), indent=1))
            print(table, flush=True)   # as it is measured: a step stopped at its time limit still shows its finished tables
    return '\n\n'.join(out)


def _sync(device):
    if torch.device(device).type == 'cuda': torch.cuda.synchronize()


def _llama(layers=8, hidden=1024, heads=16, kv_heads=4, vocab=32000):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


def decode(batch_sizes=(1, 8), prompt_len=256, new=256, rounds=3, store=True, device='cuda', llama=None) -> str:
    "Greedy tokens/s of the same Llama: relpos (`DecoderLM.from_transformers`, `KVCache`) and transformers (dynamic and static cache)."
    import transformers
    import relpos.hf  # noqa: F401  (DecoderLM.from_transformers)
    from relpos.models import DecoderLM
    hf = _llama(**(llama or {}))
    lm = DecoderLM.from_transformers(hf).eval()
    hf, lm = hf.to(device, torch.bfloat16), lm.to(device, torch.bfloat16)
    runs = {
        'relpos': lambda p: lm.generate(p, new, temperature=0, use_cache=True),
        'transformers dynamic cache': lambda p: hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new,
                                                            min_new_tokens=new, do_sample=False, pad_token_id=0),
        'transformers static cache': lambda p: hf.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=new,
                                                           min_new_tokens=new, do_sample=False, pad_token_id=0,
                                                           cache_implementation='static'),
    }
    rows = []
    for b in batch_sizes:
        prompt = torch.randint(0, hf.config.vocab_size, (b, prompt_len), generator=torch.Generator().manual_seed(b)).to(device)
        best, outs = {k: float('inf') for k in runs}, {}
        with torch.no_grad():
            for name, run in runs.items(): outs[name] = run(prompt)          # warm-up (static cache: allocation)
            for _ in range(rounds):
                for name, run in runs.items():                               # interleaved rounds, fastest kept
                    _sync(device); s = time.perf_counter()
                    run(prompt); _sync(device)
                    best[name] = min(best[name], time.perf_counter() - s)
        rows.append(dict(batch=b, **{f"{k} tok/s": b * new / t for k, t in best.items()}))
        print(rows[-1], flush=True)
    cfg = hf.config
    title = (f"Greedy decoding, tokens/s: a Llama of transformers {transformers.__version__} (random weights from a config: "
             f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads, "
             f"{cfg.num_key_value_heads} key/value heads, vocabulary {cfg.vocab_size}), bf16, prompt {prompt_len}, "
             f"{new} new tokens, fastest of {rounds} interleaved rounds")
    result = dict(**_stamp(device), title=title, transformers=transformers.__version__, prompt=prompt_len, new=new, rows=rows)
    if store: (DATA / 'decode_cuda.json').write_text(json.dumps(result, indent=1))
    return decode_markdown(result)


def decode_markdown(result:dict) -> str:
    "The stored decode result as a Markdown table."
    names = [k[:-len(' tok/s')] for k in result['rows'][0] if k.endswith(' tok/s')]
    lines = [f"**{result['title']}**", '', '| batch | ' + ' | '.join(names) + ' | relpos / dynamic | relpos / static |',
             '|---|' + '---|' * (len(names) + 2)]
    for r in result['rows']:
        lines.append(f"| {r['batch']} | " + ' | '.join(f"{r[n + ' tok/s']:.0f}" for n in names)
                     + f" | {r['relpos tok/s'] / r['transformers dynamic cache tok/s']:.2f}×"
                     + f" | {r['relpos tok/s'] / r['transformers static cache tok/s']:.2f}× |")
    return '\n'.join(lines + ['', f"torch {result['torch']}, cuda: {result['device']}, {result['date']}"])


def profile(cases=('sdpa_causal', 'none', 'rotary', 'alibi', 'fire', 'xl', 'shaw'), n=2048, steps=3) -> str:
    "Where a training step's time goes (torch.profiler, CUDA and CPU): per case the wall time and GPU kernel time per step, and the ops with the most GPU time. For finding the overheads; not stored."
    from torch.profiler import profile as torch_profile, ProfilerActivity
    from relpos.bench import _step
    out = []
    for case in cases:
        fn, inputs = make_amp_layer(case, n)
        for _ in range(3): _step(fn, inputs, True)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            s = time.perf_counter()
            for _ in range(steps): _step(fn, inputs, True)
            torch.cuda.synchronize(); wall = (time.perf_counter() - s) / steps
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3 / steps
        syncs = sum(e.count for e in events if e.key in ('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'aten::item',
                                                         'aten::_local_scalar_dense')) / steps
        out.append(f"### {case}, n={n}: wall {wall * 1e3:.2f} ms/step, GPU kernels {gpu:.2f} ms/step, syncs/step {syncs:.0f}")
        out.append(events.table(sort_by='self_device_time_total', row_limit=12, max_name_column_width=60))
        print(out[-2], flush=True)
    return '\n'.join(out)


FLEX_OPTION_CANDIDATES = (None, {'BLOCK_M': 64, 'BLOCK_N': 64, 'num_stages': 2})


def flex_options(n=2048, reps=5, dtypes=(torch.bfloat16, torch.float32), options=FLEX_OPTION_CANDIDATES, store=True) -> str:
    """FlexAttention as the bias layers call it (`relpos.bias.flex_bias_attention`, a Toeplitz `score_mod` on a learnable
    float32 table as T5's, causal, batch 4, 8 heads, head 64): forward+backward time under torch's default kernel
    options and under smaller tiles (`relpos.bias.FLEX_SMALL_TILES`), per dtype, against causal SDPA of the same dtype;
    a failure (shared memory) named. Stored in flex_options_cuda.json, which chapter 3b reads."""
    from relpos.bias import flex_bias_attention, toeplitz_score_mod
    F = torch.nn.functional
    def timed(f, *xs):
        for _ in range(2): f(*xs).float().sum().backward()          # compile, warm
        best = float('inf')
        for _ in range(reps):
            _sync('cuda'); s = time.perf_counter()
            f(*xs).float().sum().backward(); _sync('cuda')
            best = min(best, time.perf_counter() - s)
        return best * 1e3
    title = f"FlexAttention kernel options, n={n}, causal, batch 4, 8 heads, head 64, forward+backward (ms)"
    lines, rows = [f"### {title}", '', '| dtype | options | ms | / SDPA causal |', '|---|---|---|---|'], []
    for dtype in dtypes:
        g = torch.Generator(device='cuda').manual_seed(0)
        q, k, v = (torch.randn(4, 8, n, 64, device='cuda', dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        table = torch.randn(8, 2 * n - 1, device='cuda', generator=g).requires_grad_()
        base = timed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
        lines.append(f"| {str(dtype)[6:]} | SDPA is_causal=True | {base:.2f} | 1.00× |")
        rows.append(dict(dtype=str(dtype)[6:], options='sdpa_causal', ms=base))
        for opts in options:
            try:
                ms = timed(lambda q, k, v: flex_bias_attention(q, k, v, toeplitz_score_mod(table, n), 0.125, causal=True,
                                                               kernel_options=opts), q, k, v)
                lines.append(f"| {str(dtype)[6:]} | {opts} | {ms:.2f} | {ms / base:.2f}× |")
                rows.append(dict(dtype=str(dtype)[6:], options=opts, ms=ms))
            except Exception as e:   # the compile's failure, first line
                error = f"{type(e).__name__}: {str(e).splitlines()[0][-160:]}"
                lines.append(f"| {str(dtype)[6:]} | {opts} | {error} | |")
                rows.append(dict(dtype=str(dtype)[6:], options=opts, error=error))
            print(lines[-1], flush=True)
    if store: (DATA / 'flex_options_cuda.json').write_text(json.dumps(dict(**_stamp('cuda'), title=title, rows=rows), indent=1))
    return '\n'.join(lines)


def main(parts=None):
    "The tables named in `parts` or `RELPOS_CUDA_PARTS`, in that order: `train`, `infer` (layers), `decode`, `flex` (FlexAttention's tiles), `profile` (not stored); the first three by default."
    if not torch.cuda.is_available(): raise RuntimeError("bench.cuda needs a CUDA device")
    parts = (parts or os.environ.get('RELPOS_CUDA_PARTS') or 'train,decode,infer').split(',')
    # one process compiles FlexAttention for every method's score_mod, in training and in inference: more entries than
    # dynamo's default limit of 8 per function, past which it runs the slow eager reference (a warning in the log)
    torch._dynamo.config.recompile_limit = 256
    run = dict(decode=decode, profile=profile, flex=flex_options)
    return '\n\n'.join(run[part]() if part in run else layers(modes=(part,)) for part in parts)

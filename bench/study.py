"""The study behind the chapter "Which method?" (nbs/11_which_method.ipynb): every position method in
`relpos.models.POSITIONS` trains the same small `DecoderLM` on the same bytes of real text, with the same optimizer,
schedule, batches and number of steps, over several seeds; then each is evaluated at and beyond its training length.

    python -m bench.study                  # the full study (`make study`), results in nbs/data/study.json
    python -m bench.study --smoke          # a few steps, two methods, tiny data (what `make test` runs)

Runs go to a pool of single-threaded worker processes, one fresh process per run, so that each run's peak memory is
its own and two runs share the two cores of a small machine evenly.
"""
import argparse, hashlib, json, math, os, statistics, sys, time
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# Data: Python's own documentation, as shipped with the interpreter
# ---------------------------------------------------------------------------------------------------------------
def study_text(split:str='train'):
    """Bytes of real English text nobody in relpos wrote, available offline: the language reference topics
    (`pydoc_data.topics`) that CPython ships for `help()`. Topics sorted by name; every 10th topic (index 9, 19, ...)
    is validation, the rest training, so the two never share a paragraph."""
    from pydoc_data.topics import topics
    names = sorted(topics)
    pick = (lambda i: i % 10 == 9) if split == 'val' else (lambda i: i % 10 != 9)
    if split not in ('train', 'val'): raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return '\n\n'.join(topics[k] for i, k in enumerate(names) if pick(i)).encode('utf-8')

def data_recipe() -> dict:
    "What the study trained and evaluated on, with checksums a reader can compare against."
    tr, va = study_text('train'), study_text('val')
    return {'source': 'pydoc_data.topics (CPython ' + sys.version.split()[0] + ')',
            'split': 'topics sorted by name; every 10th (index 9, 19, ...) is validation',
            'train_bytes': len(tr), 'val_bytes': len(va),
            'train_sha256': hashlib.sha256(tr).hexdigest(), 'val_sha256': hashlib.sha256(va).hexdigest()}

def stream_batch(data:torch.Tensor, step:int, batch:int, seq:int):
    """Batch `step` of `batch` parallel streams through `data`: stream s starts at s/batch of the text and moves on
    by `seq` bytes a step (wrapping at the end), so consecutive batches continue each other, as Transformer-XL's
    memory expects. Every method and seed sees exactly these batches."""
    span = len(data) - seq - 1
    starts = (torch.arange(batch) * (span // batch) + step * seq) % span
    idx = starts[:, None] + torch.arange(seq + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]

# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------
def _rss(key:str) -> int:
    for line in open('/proc/self/status'):
        if line.startswith(key): return int(line.split()[1]) * 1024
    return 0

def lr_at(step:int, steps:int, lr:float, warmup:int) -> float:
    "Linear warm-up, then cosine decay to a tenth of `lr`."
    if step < warmup: return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

@torch.no_grad()
def bits_per_byte(model, data:torch.Tensor, window:int, seq:int, ends, segmented:bool) -> float:
    """Bits per byte on the last `seq` bytes of windows of `window` bytes ending at `ends`: the same scored bytes
    for every window length. `segmented`: feed the window in segments of `seq` with the model's memory (how a
    Transformer-XL model reads a long text) instead of one forward pass over the whole window."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(ends), 16):
        e = torch.as_tensor(ends[i:i + 16])
        idx = e[:, None] - window + torch.arange(window + 1)[None] - 1
        chunk = data[idx]
        x, y = chunk[:, :-1], chunk[:, 1:]
        if segmented:
            memory = None
            for s in range(0, window, seq):
                logits, memory = model(x[:, s:s + seq], memory)
        else:
            logits, _ = model(x)
        logits = logits[:, -seq:]
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y[:, -seq:].reshape(-1),
                                 reduction='sum').item()
        count += y[:, -seq:].numel()
    model.train()
    return total / count / math.log(2)

def train_run(method:str, seed:int, steps:int=300, batch:int=16, seq:int=128, d_model:int=128, heads:int=4,
              n_layers:int=3, mem_len:int=0, lr:float=2e-3, warmup:int=30, eval_every:int=50, # 0: no curve
              eval_windows=(128, 512, 1024), n_eval:int=48, data_scale:float=1.0) -> dict:
    "Train one `DecoderLM(position=method)` and evaluate it; returns the curves, bits per byte, time and memory."
    torch.set_num_threads(1)
    from relpos.models import DecoderLM
    from relpos.relative_mha import extend_position_tables
    train = torch.frombuffer(bytearray(study_text('train')), dtype=torch.uint8).long()
    val = torch.frombuffer(bytearray(study_text('val')), dtype=torch.uint8).long()
    if data_scale < 1: train, val = train[:int(len(train) * data_scale)], val[:int(len(val) * data_scale)]
    torch.manual_seed(seed)
    model = DecoderLM(256, d_model=d_model, heads=heads, n_layers=n_layers, position=method, mem_len=mem_len,
                      max_len=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    wmax = max(eval_windows, default=seq)
    ends = torch.linspace(wmax + 1, len(val), n_eval).long().tolist()   # the same scored bytes at every length
    curve_ends = ends[::max(1, n_eval // 16)]
    curve, train_loss, step_times = [], [], []
    open('/proc/self/clear_refs', 'w').write('5')   # peak resident memory from here on is this run's training
    base = _rss('VmRSS')
    memory = None
    for step in range(steps):
        x, y = stream_batch(train, step, batch, seq)
        for g in opt.param_groups: g['lr'] = lr_at(step, steps, lr, warmup)
        t0 = time.perf_counter()
        logits, memory = model(x, memory) if mem_len else model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step_times.append(time.perf_counter() - t0)
        train_loss.append(loss.item() / math.log(2))
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            curve.append((step + 1, bits_per_byte(model, val, seq, seq, curve_ends, segmented=False)))
    peak = _rss('VmHWM') - base
    def evaluate():
        bpb = {}
        for w in eval_windows:
            try: bpb[str(w)] = bits_per_byte(model, val, w, seq, ends, segmented=bool(mem_len))
            except (ValueError, TypeError) as e: bpb[str(w)] = 'refused: ' + str(e).splitlines()[0]
        return bpb
    bpb = evaluate()
    # the small learned position parameters, for the chapter's pictures of what each method learned
    keep = ('key_pos_bias', 'rotation_matrix', 'relative_attention_bias', 'relative_position_k', 'position_embeddings')
    positions = {k: [round(v, 5) for v in t.flatten().tolist()] + [list(t.shape)] for k, t in model.state_dict().items()
                 if any(w in k for w in keep) and t.numel() <= 16384} if seed == 0 else {}
    # learned XL tables: the same trained model again with its untrained rows filled (relpos.relative_mha.extend_position_tables);
    # with memory, evaluation reads segments with a bounded memory and never reaches an untrained row
    extended = evaluate() if eval_windows and not mem_len and extend_position_tables(model, seq - 1) else None
    return {'method': method, 'seed': seed, 'mem_len': mem_len, 'bpb': bpb, 'bpb_extended': extended,
            'curve': curve, 'train_bpb': train_loss, 'positions': positions,
            'step_time': statistics.median(step_times[10:] or step_times), 'peak_bytes': peak,
            'params': sum(p.numel() for p in model.parameters())}

def _worker(kw:dict) -> dict:
    try: return train_run(**kw)
    except Exception as e:   # one failed run is reported in the results, never silently dropped
        return {**{k: kw[k] for k in ('method', 'seed')}, 'mem_len': kw.get('mem_len', 0),
                'error': f"{type(e).__name__}: {e}"}

# ---------------------------------------------------------------------------------------------------------------
# The whole study
# ---------------------------------------------------------------------------------------------------------------
def study_runs(methods, seeds, variants:dict=None, **common) -> list:
    """Every (variant, seed): methods with their defaults, plus `variants` (label -> extra keyword arguments, e.g.
    Transformer-XL with memory). Seeds innermost, interleaved, so that machine noise spreads over methods evenly."""
    cases = [dict(label=m, method=m) for m in methods]
    cases += [dict(label=label, **kw) for label, kw in (variants or {}).items()]
    return [dict(case, seed=s, **common) for s in seeds for case in cases]

def run_study(runs:list, workers:int=2) -> list:
    "Run every entry of `runs` (keyword arguments of `train_run`, plus a `label`) in fresh processes."
    labels = [r.pop('label') for r in runs]
    env_threads = os.environ.get('OMP_NUM_THREADS')
    os.environ['OMP_NUM_THREADS'] = '1'   # read by each worker's OpenMP at start-up
    try:
        with get_context('spawn').Pool(workers, maxtasksperchild=1) as pool:
            results = pool.map(_worker, runs, chunksize=1)
    finally:
        if env_threads is None: os.environ.pop('OMP_NUM_THREADS')
        else: os.environ['OMP_NUM_THREADS'] = env_threads
    for label, r in zip(labels, results): r['label'] = label
    return results

# ---------------------------------------------------------------------------------------------------------------
# Reading the results (the chapter and the docs home)
# ---------------------------------------------------------------------------------------------------------------
class StudyResults:
    "The stored study (`nbs/data/study.json`) with the summaries the chapter and the docs home print."
    def __init__(self, res:dict):
        self.res = res
        self.labels = list(dict.fromkeys(r['label'] for r in res['results']))
        self.windows = sorted({int(w) for r in res['results'] for w in r.get('bpb', {})})
        self.seq, self.long = self.windows[0], self.windows[-1]   # the training length is the first window

    @classmethod
    def load(cls, path=None):
        return cls(json.loads(Path(path or Path(__file__).resolve().parents[1] / 'nbs' / 'data' / 'study.json').read_text()))

    def runs(self, label, part='results'): return [r for r in self.res[part] if r['label'] == label and 'error' not in r]

    def bpb(self, label, window, extended=False, part='results'):
        "Mean and sample standard deviation over seeds of bits per byte, or the refusal message; `part='long'`: the larger budget."
        vals = [(r['bpb_extended'] if extended else r['bpb'])[str(window)] for r in self.runs(label, part)]
        if any(isinstance(v, str) for v in vals): return next(v for v in vals if isinstance(v, str))
        return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)

    def mean(self, label, window, extended=False, part='results'):
        "Mean bits per byte; infinity for a refusal."
        v = self.bpb(label, window, extended, part)
        return math.inf if isinstance(v, str) else v[0]

    def fmt(self, label, window, extended=False, part='results'):
        v = self.bpb(label, window, extended, part)
        return 'refused' if isinstance(v, str) else f'{v[0]:.3f} ± {v[1]:.3f}'

    def step_time(self, label):   # median over the interleaved timing runs of each run's median step
        return statistics.median(r['step_time'] for r in self.runs(label, 'timing'))

    def time_ratio(self, label): return self.step_time(label) / self.step_time('none')
    def memory_mib(self, label): return max(r['peak_bytes'] for r in self.runs(label, 'timing')) / 2**20

    def one_pass(self): return [l for l in self.labels if l != 'xl+memory']   # the whole window in one forward

    def parts(self): return ['results'] + (['long'] if self.res.get('long') else [])

    def verdicts(self, part='results') -> dict:
        "The facts behind the 'which to use' table, for the study's budget (`results`) or four times it (`long`)."
        m, seq, long = self.one_pass(), self.seq, self.long
        mean = lambda l, w: self.mean(l, w, part=part)
        best_short = min(m, key=lambda l: mean(l, seq))
        near = [l for l in m if mean(l, seq) <= mean(best_short, seq) + 0.02]   # within 0.02 bits of it
        refused = [l for l in m if mean(l, long) == math.inf]
        rise = {l: mean(l, long) - mean(l, seq) for l in m if l not in refused}
        memory_helps = 'xl+memory' in self.labels and mean('xl+memory', long) < mean('xl', long) - 0.01
        return dict(best_short=best_short, memory_helps=memory_helps, near=near,
                    cheapest_near=min(near, key=self.time_ratio), best_long=min(m, key=lambda l: mean(l, long)),
                    refused=refused, rise=rise, worse=sorted((l for l in rise if rise[l] > 0.25), key=rise.get, reverse=True))

    def which_to_use(self) -> str:
        "Markdown table: what to pick for which need, with the numbers that say so (and, where run, after 4x the steps)."
        seq, long, parts = self.seq, self.long, self.parts()
        v = {p: self.verdicts(p) for p in parts}
        b = lambda l, w=seq, p='results': f'{self.mean(l, w, part=p):.3f}'
        x4 = 'after 4× the steps'
        def pick(key, w):   # the method(s) a verdict names, with the numbers of each budget
            names = list(dict.fromkeys(v[p][key] for p in parts))
            name = lambda p: '' if len(names) == 1 else f'`{v[p][key]}` '
            ev = f"{name('results')}{b(v['results'][key], w)} at {w}" + ''.join(
                f"; {x4}: {name(p)}{b(v[p][key], w, p)}" for p in parts[1:])
            return ', '.join(f'`{n}`' for n in names), ev
        rows = [('the best quality at the length you train on', *pick('best_short', seq)),
                ('texts longer than you trained on, read in one pass', *pick('best_long', long))]
        cheap = v['results']['cheapest_near']
        if cheap != v['results']['best_short']:
            rows.insert(1, ('that quality for the least time per step', f'`{cheap}`', f'{self.time_ratio(cheap):.2f}× the step time of no position method'))
        else:
            rows[0] = (rows[0][0], rows[0][1], rows[0][2] + f'; {self.time_ratio(cheap):.2f}× the step time of no position method')
        helps = [p for p in parts if v[p]['memory_helps']]
        # memory is recommended only where it also beats every method read in one pass: the study trains one method
        # (xl) with memory, so a gain over xl alone says nothing about the other methods
        beaten_by = {p: [l for l in self.one_pass() if self.mean(l, long, part=p) < self.mean('xl+memory', long, part=p)]
                     for p in helps}
        wins = [p for p in helps if not beaten_by[p]]
        mem = '; '.join(f"{'' if p == 'results' else x4 + ': '}`xl+memory` {b('xl+memory', long, p)} against `xl` {b('xl', long, p)} in one pass"
                        + (f' at {long}' if p == 'results' else '') for p in parts)
        if helps and wins != helps:
            p = helps[-1]
            better = sorted(beaten_by[p], key=lambda l: self.mean(l, long, part=p))
            mem += (f"; but read in one pass, {', '.join(f'`{l}` {b(l, long, p)}' for l in better)}"
                    + (f' ({x4})' if p == 'long' else '') + f"; `xl+memory` at {self.time_ratio('xl+memory'):.2f}× the step time of no position method")
        use = ('`xl` with `mem_len`' if wins == parts else '`xl` with `mem_len`, given enough training' if helps and wins == helps
               else 'not known: only `xl` was trained with memory, and methods read in one pass did better' if helps
               else 'no method gained from memory here')
        rows.append(('long texts read segment by segment', use, mem))
        worse = list(dict.fromkeys(l for p in parts for l in v[p]['worse']))
        refused = list(dict.fromkeys(l for p in parts for l in v[p]['refused']))
        if worse or refused:
            p = parts[-1]
            rows.append(('not, beyond the training length', ', '.join(f'`{l}`' for l in worse + refused),
                         '; '.join([f'`{l}` {b(l, seq, p)} → {b(l, long, p)}' for l in worse]
                                   + [f'`{l}` refuses longer inputs' for l in refused])
                         + (f' ({x4}, {seq} → {long})' if p == 'long' else f' ({seq} → {long})')))
        what = 'bits per byte, lower is better: mean over seeds' + ('; after 4× the steps: seed 0' if 'long' in parts else '')
        head = f'| if you need | use | evidence ({what}) |\n|---|---|---|\n'
        return head + '\n'.join(f'| {a} | {u} | {e} |' for a, u, e in rows)

    def table(self) -> str:
        "Markdown table of every variant: parameters, bits per byte at each window, step time and memory."
        head = ['method', 'params'] + [f'bpb @ {w}' for w in self.windows] + ['step time vs none', 'memory growth in training (MiB)']
        rows = [[f'`{l}`', f"{self.runs(l)[0]['params']:,}"] + [self.fmt(l, w) for w in self.windows]
                + [f'{self.time_ratio(l):.2f}×', f'{self.memory_mib(l):.0f}'] for l in self.labels]
        return '\n'.join(['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)] + ['| ' + ' | '.join(r) + ' |' for r in rows])

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--smoke', action='store_true', help='a few steps, two methods, tiny data')
    ap.add_argument('--phase', choices=('all', 'train', 'timing', 'long'), default='all',
                    help="train: the quality runs; timing: short runs that time a step, for a quiet machine; long: one seed at "
                         "4x the steps, to see which results hold with a larger budget; all: the three")
    ap.add_argument('--steps', type=int, default=300)
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--methods', nargs='*', default=None, help='default: every entry of relpos.models.POSITIONS')
    ap.add_argument('--out', default=None, help='default: nbs/data/study.json (smoke: print only)')
    a = ap.parse_args(argv)
    from relpos.models import POSITIONS
    methods = a.methods or list(POSITIONS)
    variants = {'xl+memory': dict(method='xl', mem_len=128)}
    if a.smoke:
        methods, variants = methods[:2], {}
        tiny = dict(d_model=32, n_layers=1, data_scale=0.05)
        train = study_runs(methods, range(1), steps=4, eval_every=2, n_eval=4, eval_windows=(128, 256), **tiny)
        timing = study_runs(methods, range(1), steps=12, eval_every=0, eval_windows=(), **tiny)
        long = study_runs(methods, range(1), steps=8, eval_every=4, n_eval=4, eval_windows=(128, 256), **tiny)
    else:
        train = study_runs(methods, range(a.seeds), variants, steps=a.steps)
        # Step time and memory: every variant twice, interleaved, 40 steps each (the median of the last 30), after
        # the quality runs, so that a quiet machine can give the whole of its two cores to this part alone.
        timing = study_runs(methods, range(2), variants, steps=40, eval_every=0, eval_windows=())
        # A larger budget: one seed, 4x the steps (the same warm-up, the cosine decay over the longer run), every variant.
        long = study_runs(methods, range(1), variants, steps=4 * a.steps, eval_every=4 * 50)
    path = Path(a.out or Path(__file__).resolve().parents[1] / 'nbs' / 'data' / 'study.json')
    out = json.loads(path.read_text()) if a.phase != 'all' and path.exists() else {}
    out.update(recipe=data_recipe(), torch=torch.__version__)
    out.setdefault('phases', {})
    for phase, runs in (('train', train), ('timing', timing), ('long', long)):
        if a.phase not in ('all', phase): continue
        t0 = time.time()
        out[{'train': 'results'}.get(phase, phase)] = run_study(runs, workers=a.workers)
        out['phases'][phase] = {'argv': sys.argv[1:] if argv is None else argv, 'wall_seconds': time.time() - t0,
                                'runs': len(runs), 'date': time.strftime('%Y-%m-%d')}
        print(f"{phase}: {len(runs)} runs in {out['phases'][phase]['wall_seconds']:.0f} s", flush=True)
    failed = [f"{r['label']} seed {r['seed']}: {r['error']}" for part in ('results', 'timing', 'long') for r in out.get(part, [])
              if 'error' in r]
    if a.out or not a.smoke:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
    else:
        for r in out['results']: print(r['label'], r['seed'], r.get('bpb', r.get('error')))
    if failed: sys.exit("failed runs:\n" + '\n'.join(failed))
    return out

if __name__ == '__main__': main()

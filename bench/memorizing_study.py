"""The study behind the Memorizing Transformer chapter's section "On real long documents" (nbs/10_memorizing.ipynb):
does a kNN memory lower bits per byte on long documents, how much memory, and how does it combine with the
Transformer-XL cache?

    python -m bench.memorizing_study            # every run not yet stored (`make memorizing-study`): resumable
    python -m bench.memorizing_study --phase long   # one budget only ('short': 300 steps, 'long': 1,200)
    python -m bench.memorizing_study --list     # the runs and which are stored
    python -m bench.memorizing_study --pilot    # a few steps of each setting: what a step costs
    python -m bench.memorizing_study --device cuda   # the same runs on a GPU (each run file says where it ran)

Corpus: the Python standard library's own source files of at least 16 KB, one document per file, split into
training and validation by a hash of the file's path; the list of files with their sha256 is stored in
nbs/data/memorizing_corpus.json, so that another Python (other files) is detected and reported. Byte tokens.

Each run is stored as soon as it finishes in nbs/data/memorizing_study/<phase>__<label>__seed<k>.json; runs already stored
are skipped, so an interrupted study continues where it stopped. At most two runs at once, one thread each.
"""
import argparse, hashlib, json, math, os, statistics, sys, sysconfig, time
from pathlib import Path

from typing import Optional

import torch
import torch.nn.functional as F

from bench.pool import run_pool, write_json
from bench.study import _device, device_name
from relpos.train import adamw, fit, learning_rate, lm_loss

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / 'nbs' / 'data'
MANIFEST = DATA / 'memorizing_corpus.json'
RESULTS = DATA / 'memorizing_study'
MIN_BYTES = 16384          # a document is a stdlib source file of at least 16 KB
VAL_EVERY = 10             # about 1 file in 10 is validation (by a hash of its path, not by its position in a list)

# ---------------------------------------------------------------------------------------------------------------
# Corpus: the standard library's long source files
# ---------------------------------------------------------------------------------------------------------------
def stdlib_root() -> Path: return Path(sysconfig.get_paths()['stdlib'])

def corpus_paths(root=None, min_bytes:int=MIN_BYTES) -> list:
    "Sorted relative paths of the `.py` files of at least `min_bytes` under the stdlib directory (no site-packages)."
    root = Path(root or stdlib_root())
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ('site-packages', 'dist-packages', '__pycache__'))
        for f in filenames:
            p = Path(dirpath) / f
            if f.endswith('.py') and p.is_file() and not p.is_symlink() and p.stat().st_size >= min_bytes:
                out.append(p.relative_to(root).as_posix())
    return sorted(out)

def split_of(relpath:str) -> str:
    "'val' for about one path in `VAL_EVERY`, chosen by the sha256 of the path (stable whatever else the directory holds)."
    h = int(hashlib.sha256(relpath.encode('utf-8')).hexdigest()[:8], 16)
    return 'val' if h % VAL_EVERY == 0 else 'train'

def build_manifest(root=None) -> dict:
    "What the corpus is on this interpreter: every file with its size, sha256 and split, and one checksum of the list."
    root = Path(root or stdlib_root())
    files = []
    for rel in corpus_paths(root):
        b = (root / rel).read_bytes()
        files.append([rel, len(b), hashlib.sha256(b).hexdigest(), split_of(rel)])
    listing = '\n'.join(' '.join(map(str, f)) for f in files).encode()
    return {'python': sys.version.split()[0], 'implementation': sys.implementation.name, 'min_bytes': MIN_BYTES,
            'rule': f'stdlib *.py files >= {MIN_BYTES} bytes (no site-packages), sorted by relative path; '
                    f'validation iff int(sha256(path)[:8], 16) % {VAL_EVERY} == 0',
            'files': files, 'sha256': hashlib.sha256(listing).hexdigest(),
            'bytes': {s: sum(f[1] for f in files if f[3] == s) for s in ('train', 'val')},
            'documents': {s: sum(f[3] == s for f in files) for s in ('train', 'val')}}

def compare_manifests(stored:dict, here:dict) -> list:
    "Differences between the stored corpus and this interpreter's, as sentences (empty: the same bytes)."
    if stored['sha256'] == here['sha256']: return []
    out = [] if stored['python'] == here['python'] else [f"stored corpus from Python {stored['python']}, this is {here['python']}"]
    a, b = {f[0]: f for f in stored['files']}, {f[0]: f for f in here['files']}
    if set(a) - set(b): out.append(f"{len(set(a) - set(b))} stored files missing here")
    if set(b) - set(a): out.append(f"{len(set(b) - set(a))} files here not in the stored list")
    changed = [p for p in set(a) & set(b) if a[p][2] != b[p][2]]
    if changed: out.append(f"{len(changed)} files differ in content")
    return out

def load_corpus(root=None, manifest=None) -> dict:
    """`{'train': [bytes, ...], 'val': [bytes, ...]}` in manifest order, read from this interpreter's stdlib. With a
    stored `manifest`, only its files are read and each is checked against its sha256 (a mismatch raises)."""
    root = Path(root or stdlib_root())
    if manifest is None: manifest = build_manifest(root)
    out = {'train': [], 'val': []}
    for rel, size, sha, split in manifest['files']:
        p = root / rel
        if not p.exists(): raise FileNotFoundError(f"corpus file {rel} (Python {manifest['python']}) is missing here")
        b = p.read_bytes()
        if hashlib.sha256(b).hexdigest() != sha:
            raise ValueError(f"corpus file {rel} differs from the stored one (Python {manifest['python']}, "
                             f"this is {sys.version.split()[0]}): sha256 mismatch")
        out[split].append(b)
    return out

def stored_manifest() -> dict: return json.loads(MANIFEST.read_text())

# ---------------------------------------------------------------------------------------------------------------
# Reading documents segment by segment
# ---------------------------------------------------------------------------------------------------------------
IGNORE = -100   # target of a padding position: never scored

def doc_segments(doc:bytes, seq:int):
    """The (input, target) segments of one document: inputs `doc[:-1]`, targets `doc[1:]`, cut into `seq` bytes;
    the last segment is padded (input 0, target IGNORE). A segment never holds bytes of two documents."""
    t = torch.frombuffer(bytearray(doc), dtype=torch.uint8).long()
    x, y = t[:-1], t[1:]
    n = -(-len(x) // seq) * seq
    xp = torch.zeros(n, dtype=torch.long); xp[:len(x)] = x
    yp = torch.full((n,), IGNORE, dtype=torch.long); yp[:len(y)] = y
    return xp.view(-1, seq), yp.view(-1, seq)

class DocStream:
    """`batch` rows, each reading whole documents one segment per step, in a fixed shuffled order (`data_seed`):
    row r takes documents r, r + batch, r + 2 batch, ... of the order, cycling. `next()` gives inputs and targets
    `[batch, seq]` and `doc_start` `[batch]` (True where a row's segment is the first of a document), as meliad's
    long-document tasks do: a new document in a row empties that row's memories."""
    def __init__(self, docs:list, batch:int, seq:int, data_seed:int=0):
        self.docs, self.batch, self.seq = docs, batch, seq
        g = torch.Generator().manual_seed(data_seed)
        self.order = torch.randperm(len(docs), generator=g).tolist()
        self.taken = 0                        # documents handed out so far
        self.rows = [None] * batch            # per row: (x segments, y segments, next segment index)
    def _next_doc(self):
        d = self.docs[self.order[self.taken % len(self.order)]]; self.taken += 1
        return list(doc_segments(d, self.seq)) + [0]
    def next(self):
        xs, ys, start = [], [], []
        for r in range(self.batch):
            if self.rows[r] is None or self.rows[r][2] == len(self.rows[r][0]):
                self.rows[r] = self._next_doc(); start.append(True)
            else: start.append(False)
            x, y, i = self.rows[r]
            xs.append(x[i]); ys.append(y[i]); self.rows[r][2] = i + 1
        return torch.stack(xs), torch.stack(ys), torch.tensor(start)

# ---------------------------------------------------------------------------------------------------------------
# Evaluation: bits per byte on validation documents, by byte offset in the document
# ---------------------------------------------------------------------------------------------------------------
BUCKETS = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)   # bucket i: byte offsets [BUCKETS[i], BUCKETS[i+1])

def eval_batch(docs:list, seq:int, max_bytes:int):
    "Validation documents as rows, each cut to `max_bytes` and padded: inputs, targets `[rows, n_seg, seq]` and target offsets."
    segs = [doc_segments(d[:max_bytes + 1], seq) for d in docs]
    n = max(len(s[0]) for s in segs)
    x = torch.zeros(len(docs), n, seq, dtype=torch.long)
    y = torch.full((len(docs), n, seq), IGNORE, dtype=torch.long)
    for r, (xs, ys) in enumerate(segs): x[r, :len(xs)], y[r, :len(ys)] = xs, ys
    return x, y

@torch.no_grad()
def evaluate(model, docs:list, seq:int, max_bytes:int, buckets=BUCKETS) -> dict:
    """Read every validation document (rows in parallel) segment by segment from a fresh memory (`doc_start` on the
    first segment); the summed negative log-likelihood in bits and the count of scored bytes, in total and per bucket
    of the target's byte offset in its document (offset of the target byte: 1, 2, ...)."""
    was = model.training; model.eval()
    dev = next(model.parameters()).device   # the sums stay on the CPU, in float64
    x, y = eval_batch(docs, seq, max_bytes)
    rows, n_seg, _ = x.shape
    edges = torch.tensor(buckets[1:-1])
    nll = torch.zeros(len(buckets) - 1, dtype=torch.float64); cnt = torch.zeros(len(buckets) - 1, dtype=torch.long)
    memory = None
    for s in range(n_seg):
        start = torch.full((rows,), s == 0, device=dev)
        inp = x[:, s].to(dev)
        logits, memory = model(inp, memory, doc_start=start) if getattr(model, 'memorizing_layers', ()) or model.mem_len \
            else model(inp)
        logits = logits.cpu()
        t = y[:, s]
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), t.reshape(-1), ignore_index=IGNORE,
                               reduction='none').view_as(t).double()
        offset = (s * seq + 1 + torch.arange(seq)).expand_as(t).contiguous()   # the target byte's offset in its document
        b = torch.bucketize(offset, edges, right=True)
        keep = t != IGNORE
        nll.index_add_(0, b[keep], loss[keep]); cnt.index_add_(0, b[keep], torch.ones_like(b[keep]))
    model.train(was)
    return {'bits': (nll.sum() / math.log(2)).item(), 'bytes': int(cnt.sum()),
            'bucket_bits': (nll / math.log(2)).tolist(), 'bucket_bytes': cnt.tolist(), 'buckets': list(buckets)}

# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------
def lr_at(step:int, steps:int, lr:float, warmup:int) -> float:
    "Linear warm-up, then cosine decay to a tenth of `lr`: `relpos.train.learning_rate`, the schedule training uses."
    return learning_rate(step, lr, warmup, steps)

def build_model(seq:int, d_model:int, heads:int, n_layers:int, position:str, mem_len:int=0, knn_mult:int=0,
                knn_layer:int=None, top_k:int=32, faiss:bool=False, **_):
    "The study's `DecoderLM`; `knn_mult` > 0: one kNN layer (`knn_layer`) of `knn_mult * seq` entries per row and head."
    from relpos.models import DecoderLM
    extra = {}
    if knn_mult:
        extra = dict(memorizing_layers=(knn_layer,), knn_capacity=knn_mult * seq, top_k=top_k)
        if faiss:
            from relpos.memorizing import FaissKNNMemory
            extra.update(knn_memory=FaissKNNMemory)
    return DecoderLM(256, d_model=d_model, heads=heads, n_layers=n_layers, position=position, mem_len=mem_len,
                     max_len=seq, **extra)

@torch.no_grad()
def pair_init(model, seed:int, seq:int, d_model:int, heads:int, n_layers:int, position:str) -> dict:
    """Give `model` the initial weights of the setting without memory (`none`) built from `seed`, for every parameter
    the two share: a kNN layer's local side (`...module.local.X`) takes `none`'s `...module.X`. Only the kNN layer's
    own parameters (gate, temperature) keep their draw. Two settings with the same seed then differ at the start only
    where their methods differ, so their per-seed difference is paired. Returns what was shared."""
    torch.manual_seed(seed)
    ref = dict(build_model(seq, d_model, heads, n_layers, position).named_parameters())
    n, numel, own = 0, 0, []
    for name, p in model.named_parameters():
        q = ref.get(name.replace('.module.local.', '.module.'))
        if q is not None and q.shape == p.shape: p.copy_(q); n, numel = n + 1, numel + p.numel()
        else: own.append(name)
    return {'paired_with': 'none', 'tensors': n, 'params': numel, 'own': own}

def _train(model, stream:DocStream, steps:int, lr:float, warmup:int, gate_loss:bool=False, stateful:bool=True,
           eval_fn=None, eval_every:int=0):
    """`relpos.train.fit` on the documents of `stream`: the next-byte loss (padding not scored), plus the kNN gates'
    loss if `gate_loss`; `stateful` (XL or kNN memory): each row's memory carried from segment to segment and emptied
    where its document starts. Returns per-step losses (bits per byte), wall and CPU times, and the curve of `eval_fn`
    every `eval_every` steps (not after the last)."""
    dev = next(model.parameters()).device   # the batches go where the model is
    batches = (tuple(t.to(dev) for t in (b if stateful else b[:2])) for b in iter(stream.next, None))
    loss_fn = lambda model, batch, memory: lm_loss(model, batch, memory, gate_loss=gate_loss)
    train_bits, times, cpu, curve = [], [], [], []
    for s in fit(model, adamw(model, lr), batches, steps, lr, warmup, clip=1.0, loss_fn=loss_fn):
        times.append(s.seconds); cpu.append(s.cpu_seconds)
        train_bits.append(s.loss.item() / math.log(2))
        if eval_every and s.step % eval_every == 0 and s.step < steps:
            e = eval_fn()
            curve.append((s.step, e['bits'] / e['bytes']))
    return train_bits, times, cpu, curve

def train_run(label:str, seed:int, steps:int, batch:int, seq:int, d_model:int, heads:int, n_layers:int,
              position:str, lr:float, warmup:int, eval_docs:int, eval_bytes:int, eval_every:int=0, gate_loss:bool=False,
              device:str='cpu', **setting) -> dict:
    """Train one setting from scratch on the training documents, then evaluate it on the validation documents.
    `gate_loss`: add the kNN gates' auxiliary loss (`get_loss_component()`, which pushes each gate toward the memory)
    to the training loss; without it the gates learn from the language-modelling loss alone, as in meliad and the paper.
    Every parameter shared with the setting without memory starts as that setting's of the same seed (`pair_init`).
    `device`: where the model, its memories and the batches live ('cpu', 'cuda'); faiss searches on the CPU only."""
    if setting.get('faiss') and torch.device(device).type != 'cpu':
        raise ValueError(f"{label!r}: FaissKNNMemory (faiss-cpu) keeps its memory on the CPU; run this setting with "
                         f"device='cpu' (--device cpu), device={device!r} was asked")
    dev = _device(device)
    config = dict(steps=steps, batch=batch, seq=seq, d_model=d_model, heads=heads, n_layers=n_layers, position=position,
                  lr=lr, warmup=warmup, eval_docs=eval_docs, eval_bytes=eval_bytes, gate_loss=gate_loss)
    torch.set_num_threads(1)
    corpus = load_corpus(manifest=stored_manifest())
    torch.manual_seed(seed)
    model = build_model(seq, d_model, heads, n_layers, position, **setting)
    init = pair_init(model, seed, seq, d_model, heads, n_layers, position)
    model.to(dev)   # after pairing: `pair_init` builds `none` on the CPU, where the seed's draws are the same
    stream = DocStream(corpus['train'], batch, seq, data_seed=0)   # the same bytes for every setting and seed
    val = corpus['val'][:eval_docs]
    stateful = bool(setting.get('knn_mult') or setting.get('mem_len'))
    t_start, cpu_start = time.time(), time.process_time()
    eval_fn = lambda: evaluate(model, val[:8], seq, min(eval_bytes, 4096))
    train_bits, times, cpu, curve = _train(model, stream, steps, lr, warmup, gate_loss, stateful, eval_fn, eval_every)
    train_seconds, train_cpu = time.time() - t_start, time.process_time() - cpu_start
    # How much each kNN layer's heads weigh local attention against the retrieved pairs after training: sigmoid of
    # the constant gate's per-head bias (1: memory ignored). What the memory backend searched with, as built.
    gates = gate_local(model)
    backend = [dict(kind=type(a.memory).__name__, **{k: getattr(a.memory, k) for k in ('capacity', 'nlist', 'nprobe', 'train_size')
                                                      if hasattr(a.memory, k)})
               for a in model.memorizing if a.memory is not None]
    t0 = time.time()
    ev = evaluate(model, val, seq, eval_bytes)
    return {'label': label, 'seed': seed, 'setting': setting, 'config': config, 'init': init, 'device': device_name(dev),
            'bpb': ev['bits'] / ev['bytes'], 'eval': ev,
            'gate_local': gates, 'knn_memory': backend, 'curve': curve, 'train_bpb': [round(v, 4) for v in train_bits],
            # one thread: CPU time per step is the work, wall time adds the waits of a shared machine
            'step_time': statistics.median(times[20:] or times), 'step_times_mean': statistics.mean(times),
            'step_cpu': statistics.median(cpu[20:] or cpu), 'step_cpu_mean': statistics.mean(cpu),
            'train_seconds': train_seconds, 'train_cpu_seconds': train_cpu, 'eval_seconds': time.time() - t0,
            'params': sum(p.numel() for p in model.parameters()), 'torch': torch.__version__,
            'python': sys.version.split()[0], 'date': time.strftime('%Y-%m-%d %H:%M')}

# ---------------------------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------------------------
SEQ = 128
N_LAYERS = 4
MELIAD_LAYER = 2     # meliad: the 9th of 12 layers (memory_layer_indices=(-4,)), 3/4 of the depth -> layer 2 of 0..3
OTHER_LAYER = 0      # meliad's literal index -4 in a 4-layer model: the bottom layer
# Two budgets: 'short' (0.3 M training bytes, a 0.53 M-parameter model, the gates' auxiliary loss added to the
# training loss, as the seed's context-choice module suggests) and 'long' (4x the steps, 1.2 M bytes, a wider model:
# 0.9 M parameters; the gates learn from the language-modelling loss alone, as in meliad and the paper, and one more
# setting adds the auxiliary loss back). Memory can only pay once the model has learned to use what it retrieves.
PHASES = {
    'short': dict(steps=300, batch=8, seq=SEQ, d_model=96, heads=4, n_layers=N_LAYERS, position='xl_paper', lr=2e-3,
                  warmup=20, eval_docs=12, eval_bytes=16384, gate_loss=True),
    'long': dict(steps=1200, batch=8, seq=SEQ, d_model=128, heads=4, n_layers=N_LAYERS, position='xl_paper', lr=2e-3,
                 warmup=60, eval_docs=12, eval_bytes=16384, gate_loss=False),
}
def settings(phase:str='long') -> dict:
    "label -> the keyword arguments that make the setting in `phase` (on top of its sizes, `PHASES`, which they may override)."
    knn = lambda mult, **kw: dict(knn_mult=mult, knn_layer=MELIAD_LAYER, top_k=32, **kw)
    return {
        'none': dict(),
        'xl': dict(mem_len=SEQ),
        'knn 1x': knn(1), 'knn 4x': knn(4), 'knn 16x': knn(16), 'knn 64x': knn(64),
        'knn 16x + xl': knn(16, mem_len=SEQ),
        'knn 16x top-128': dict(knn(16), top_k=128),
        f'knn 16x layer {OTHER_LAYER}': dict(knn(16), knn_layer=OTHER_LAYER),
        'knn 64x faiss': knn(64, faiss=True),
        # where the phase trains the gates without their auxiliary loss: the same 16x memory with it
        **({} if PHASES[phase]['gate_loss'] else {'knn 16x + gate loss': knn(16, gate_loss=True)}),
    }

def gate_local(model) -> list:
    "Per kNN layer, each head's sigmoid(b_h): the weight its constant gate gives local attention (1 - it: the retrieved pairs)."
    return [torch.sigmoid(a.gate.bias.detach()).tolist() for a in model.memorizing if hasattr(a.gate, 'bias')]

def initial_gate_local(run:dict) -> list:
    "The kNN gates' sigmoid(b_h) of a stored run's model before training: the model is rebuilt from its seed and setting, as `train_run` builds it."
    c = run['config']
    torch.manual_seed(run['seed'])
    model = build_model(c['seq'], c['d_model'], c['heads'], c['n_layers'], c['position'], **run['setting'])
    return gate_local(model)   # pairing (`pair_init`) leaves the gates as drawn here

def run_file(label:str, seed:int, phase:str='long') -> Path:
    return RESULTS / f"{phase}__{label.replace(' ', '_').replace('+', 'plus')}__seed{seed}.json"

def all_runs(seeds=(0, 1), phase:str='long', common=None) -> list:
    "Every (setting, seed) of a phase, seeds outermost: a study stopped half-way has every setting at seed 0."
    common = common or PHASES[phase]
    return [dict(label=l, seed=s, phase=phase, **{**common, **kw}) for s in seeds for l, kw in settings(phase).items()]

def _worker(kw:dict) -> dict:
    out, phase = Path(kw.pop('out_dir')), kw.pop('phase', 'long')
    try: r = train_run(**kw)
    except Exception as e:   # a failed run is reported, never silently dropped (and not stored: rerun retries it)
        import traceback; traceback.print_exc()
        return {'label': kw['label'], 'seed': kw['seed'], 'error': f"{type(e).__name__}: {e}"}
    r['phase'] = phase
    write_json(out / run_file(kw['label'], kw['seed'], phase).name, r)   # never a half-written result
    print(f"{time.strftime('%H:%M:%S')} done {phase} {kw['label']} seed {kw['seed']}: {r['bpb']:.4f} bpb, "
          f"step {r['step_time'] * 1e3:.0f} ms, train {r['train_seconds']:.0f} s, eval {r['eval_seconds']:.0f} s", flush=True)
    return r

SEEDS = 4   # seeds per setting: with 2, the two `none` runs alone differed late in documents by more than most effects

def _ratio(x:float) -> str: return '–' if math.isnan(x) else f'{x:.2f}×'   # a cost cell: '–' across devices

def run_device(run:dict) -> str:
    "Where a stored run trained; runs of the CPU-only harness before `--device` record none."
    return run.get('device', 'cpu (1 thread)')

def is_paired(run:dict) -> bool:
    "Whether a stored run started from the paired initialisation (`pair_init`); runs stored before it record no `init`."
    return 'init' in run

def load_results(path=None) -> list:
    "Every stored run (one JSON file each)."
    return [json.loads(p.read_text()) for p in sorted(Path(path or RESULTS).glob('*.json'))]

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--seeds', type=int, default=SEEDS, help=f'seeds per setting (default {SEEDS})')
    ap.add_argument('--phase', nargs='+', choices=list(PHASES), default=list(PHASES), help='budgets to run (default: all)')
    ap.add_argument('--list', action='store_true', help='print the runs and which are stored')
    ap.add_argument('--pilot', type=int, default=0, help='time this many steps of every setting (nothing stored)')
    ap.add_argument('--out', default=None, help=f'directory of the stored runs (default {RESULTS.relative_to(ROOT)})')
    ap.add_argument('--manifest', action='store_true', help='(re)write nbs/data/memorizing_corpus.json from this Python')
    ap.add_argument('--device', default='cpu', help="where the runs train: 'cpu' (default) or 'cuda'; stored in each run")
    a = ap.parse_args(argv)
    try: _device(a.device)   # refused here, before any run, where it is not present
    except (TypeError, ValueError) as e: sys.exit(str(e))
    if a.manifest or not MANIFEST.exists():
        MANIFEST.write_text(json.dumps(build_manifest(), indent=0)); print(f"wrote {MANIFEST}")
    diff = compare_manifests(stored_manifest(), build_manifest())
    if diff: sys.exit("the stored corpus is not this interpreter's: " + '; '.join(diff) +
                      " (rerun with --manifest to study this Python's stdlib instead, and delete the stored runs)")
    runs = [dict(r, device=a.device) for p in a.phase for r in all_runs(tuple(range(a.seeds)), p)]
    if a.pilot:
        for r in all_runs((0,), a.phase[-1]):
            r.update(steps=a.pilot, eval_docs=2, eval_bytes=1024, device=a.device); r.pop('phase')
            t0 = time.time(); out = train_run(**r)
            print(f"{r['label']}: step {out['step_time'] * 1e3:.0f} ms (mean {out['step_times_mean'] * 1e3:.0f}), "
                  f"eval {out['eval_seconds']:.1f} s, total {time.time() - t0:.1f} s", flush=True)
        return
    out = Path(a.out or RESULTS)
    path = lambda r: out / run_file(r['label'], r['seed'], r['phase']).name
    done = lambda r: path(r).exists() and is_paired(json.loads(path(r).read_text()))
    todo = [dict(r, out_dir=str(out)) for r in runs if not done(r)]
    cpu_only = [r for r in todo if r.get('faiss') and torch.device(a.device).type != 'cpu']
    if cpu_only and not a.list:   # faiss-cpu: these settings run with --device cpu
        todo = [r for r in todo if r not in cpu_only]
        print(f"not run on {a.device} (FaissKNNMemory is CPU-only; run them with --device cpu): "
              + ', '.join(sorted({r['label'] for r in cpu_only})), flush=True)
    if a.list:
        for r in runs: print(('stored ' if done(r) else 'todo   ') + f"{r['phase']} {r['label']} seed {r['seed']}")
        return
    old = sum(path(r).exists() for r in todo)
    print(f"{len(runs) - len(todo)} of {len(runs)} runs stored; running {len(todo)}"
          + (f" ({old} of them stored before paired initialisation: rerun and replaced)" if old else ''), flush=True)
    if todo:
        results = run_pool(_worker, todo, a.workers)
        failed = [f"{r['label']} seed {r['seed']}: {r['error']}" for r in results if 'error' in r]
        if failed: sys.exit("failed runs (not stored; rerun to retry):\n" + '\n'.join(failed))

if __name__ == '__main__': main()

# ---------------------------------------------------------------------------------------------------------------
# Reading the stored runs (the chapter)
# ---------------------------------------------------------------------------------------------------------------
from bench.study import t975
# A difference whose 95% interval lies inside +-MARGIN bits per byte counts as none: 0.01 bits per byte is a change of
# 0.7% in the per-byte perplexity (2 ** 0.01), too little to pay for a memory (every memory setting's step cost at least
# 1.28x the CPU time of a step without one in the stored runs)
MARGIN = 0.01
LATE = (8192, 16384)   # byte offsets where a memory of 64x the segment (8 KB) is full
EARLY = (0, 1024)      # the first kilobyte: little to remember yet
PAIRED_RULE = ("*Rule:* each difference is taken seed by seed, over the seeds both settings share, on bytes {lo}–{hi} KB "
               "(late − early: minus the same on bytes {elo}–{ehi} KB). "
               "*Better* or *worse*: its 95% t-interval lies below or above 0; *no difference*: inside "
               "±{margin:g} bits per byte ({ppl:.1%} in per-byte perplexity, too little to pay a memory for); "
               "*not known*: otherwise, or fewer than 2 seeds. Runs: {seeds}, {pairing}.")

def judge(d:list):
    """(verdict, mean, half-width of the 95% t-interval, n) of the per-seed differences `d` by `PAIRED_RULE`: 'better'
    (interval below 0), 'worse' (above 0), 'no difference' (inside +-`MARGIN`), else, or with fewer than 2, 'not known'."""
    if len(d) < 2: return 'not known', (statistics.mean(d) if d else math.nan), math.nan, len(d)
    m = statistics.mean(d)
    half = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    v = ('better' if m + half < 0 else 'worse' if m - half > 0 else
         'no difference' if -MARGIN <= m - half and m + half <= MARGIN else 'not known')
    return v, m, half, len(d)

def _places(m:float, half:float, verdict:str) -> int:
    """Decimals to print `m ± half` with: 3, or more (up to 6) where 3 would print a half-width of 0.000 or an interval
    that touches 0 although its verdict says it lies on one side (+0.018 ± 0.018 for an interval above 0); an exact 0 stays
    0.000."""
    if math.isnan(half): return 3
    for d in range(3, 7):
        lo, hi, h = round(m - half, d), round(m + half, d), round(half, d)
        if (h > 0 or half == 0) and not (verdict == 'worse' and lo <= 0) and not (verdict == 'better' and hi >= 0): return d
    return 6

class MemStudyResults:
    "The stored runs with the summaries the chapter prints: bits per byte by setting and by offset, costs, verdicts."
    def __init__(self, runs:list, phase:Optional[str]=None):   # phase: only that budget's runs (None: every run given)
        self.phase = phase
        self.all = [r for r in runs if 'error' not in r and (phase is None or r.get('phase') == phase)]
        order = list(settings(phase or 'long'))
        found = {r['label'] for r in self.all}
        self.labels = [l for l in order if l in found] + sorted(found - set(order))

    @classmethod
    def load(cls, path=None, phase:Optional[str]=None): return cls(load_results(path), phase)

    def runs(self, label): return sorted((r for r in self.all if r['label'] == label), key=lambda r: r['seed'])
    def seeds(self, label): return [r['seed'] for r in self.runs(label)]

    @staticmethod
    def run_bpb(r, lo=0, hi=None) -> float:
        "Bits per byte of one run over the target bytes at offsets in [lo, hi) (whole buckets)."
        e = r['eval']; edges = e['buckets']
        keep = [i for i in range(len(edges) - 1) if edges[i] >= lo and (hi is None or edges[i + 1] <= hi)]
        bits, n = sum(e['bucket_bits'][i] for i in keep), sum(e['bucket_bytes'][i] for i in keep)
        return bits / n if n else math.nan

    def bpb(self, label, lo=0, hi=None):
        "(mean, sample sd, seeds) of bits per byte over [lo, hi)."
        v = [self.run_bpb(r, lo, hi) for r in self.runs(label)]
        return statistics.mean(v), (statistics.stdev(v) if len(v) > 1 else math.nan), len(v)

    def diffs(self, label, base='none', lo=0, hi=None) -> list:
        "Per seed (seeds both settings have): bits per byte of `label` minus `base` over [lo, hi); same seed, same batches."
        b = {r['seed']: self.run_bpb(r, lo, hi) for r in self.runs(base)}
        return [self.run_bpb(r, lo, hi) - b[r['seed']] for r in self.runs(label) if r['seed'] in b]

    def gain(self, label, base='none', lo=0, hi=None) -> float:
        "Mean over seeds of `diffs` (NaN if no seed is shared); negative: `label` is lower. A mean, not a verdict."
        d = self.diffs(label, base, lo, hi)
        return statistics.mean(d) if d else math.nan

    def cost(self, label, key='step_cpu', base='none') -> float:
        """Median step time of `label` over the median of `base` (CPU time per step by default: one thread, so the work);
        NaN where their runs did not all run on one device (a ratio across devices measures the devices)."""
        if len({run_device(r) for l in (label, base) for r in self.runs(l)}) > 1: return math.nan
        med = lambda l: statistics.median(r[key] for r in self.runs(l))
        return med(label) / med(base)

    def devices_text(self) -> str:
        "Where the runs ran: 'cpu (1 thread)', or each device with its number of runs where there are several."
        n = {}
        for r in self.all: n[run_device(r)] = n.get(run_device(r), 0) + 1
        return ', '.join(d if len(n) == 1 else f"{d} ({k} run{'s' * (k != 1)})" for d, k in n.items())

    def memory_weight(self, label, initial:bool=False) -> float:
        """Mean over seeds and heads of the weight the trained gate gives the retrieved pairs, 1 - sigmoid(b_h); NaN if not
        recorded. `initial`: the same at initialisation, for the runs that recorded a trained value (rebuilt from their seed)."""
        w = [1 - g for r in self.runs(label) if r.get('gate_local')
             for layer in (initial_gate_local(r) if initial else r['gate_local']) for g in layer]
        return statistics.mean(w) if w else math.nan

    def weight_text(self, label) -> str:
        "'0.46 (0.50)': the weight on memory trained and at initialisation, for the table; '' where not recorded."
        w = self.memory_weight(label)
        return '' if math.isnan(w) else f"{w:.2f} ({self.memory_weight(label, initial=True):.2f})"

    def curve(self, label, min_bytes:int=256):
        "(bucket (start, end), mean bits per byte over seeds) for the buckets that score at least `min_bytes` bytes."
        runs = self.runs(label); edges = runs[0]['eval']['buckets']
        out = []
        for i in range(len(edges) - 1):
            if min(r['eval']['bucket_bytes'][i] for r in runs) < min_bytes: continue   # e.g. the single byte at 16 KB
            out.append(((edges[i], edges[i + 1]),
                        statistics.mean(r['eval']['bucket_bits'][i] / r['eval']['bucket_bytes'][i] for r in runs)))
        return out

    def table(self) -> str:
        """Markdown: every setting's bits per byte (all scored bytes, the first KB, 8-16 KB), its difference with no memory
        late in documents and that difference minus the one on the first KB, each with its 95% interval and verdict by
        `PAIRED_RULE` (printed below the table), and its cost."""
        fmt = lambda m, s: f'{m:.3f}' + ('' if math.isnan(s) else f' ± {s:.3f}')
        gates = any(r.get('gate_local') for r in self.all)   # recorded by runs of the current harness
        head = ('| setting | seeds | bpb, all: mean ± sd of seeds | bpb, bytes 0–1 KB | bpb, bytes 8–16 KB | Δ vs none, 8–16 KB: mean ± 95% '
                'interval, verdict | late Δ − early Δ: mean ± 95% interval, verdict | CPU per step vs none | '
                'wall per step vs none |' + (' weight on memory: trained (at initialisation) |' if gates else '')
                + '\n|---|---|---|---|---|---|---|---|---|' + ('---|' if gates else ''))
        rows = []
        for l in self.labels:
            m, s, n = self.bpb(l); e, es, _ = self.bpb(l, *EARLY); t, ts, _ = self.bpb(l, *LATE)
            gs = '' if l == 'none' else self.interval_text(l, short=True)
            ws = '' if l == 'none' else self.interval_text(l, early=EARLY, short=True)
            rows.append(f"| `{l}` | {n} | {fmt(m, s)} | {fmt(e, es)} | {fmt(t, ts)} | {gs} | {ws} | "
                        f"{_ratio(self.cost(l))} | {_ratio(self.cost(l, 'step_time'))} |"
                        + (f" {self.weight_text(l)} |" if gates else ''))
        return head + '\n' + '\n'.join(rows) + '\n\n' + self.rule()

    def paired(self) -> bool:
        "Whether every run records the paired initialisation (`init`); False for none at all."
        return bool(self.all) and all(is_paired(r) for r in self.all)

    def seeds_text(self) -> str:
        "'2 seeds per setting', or '2 to 4 seeds per setting' where the settings have different counts."
        n = sorted({len(self.runs(l)) for l in self.labels}) or [0]
        return f"{n[0]}{'' if len(n) == 1 else f' to {n[-1]}'} seed{'s' * (n[-1] != 1)} per setting"

    def pairing_text(self) -> str:
        "Whether the runs were paired, from what they record (`is_paired`)."
        k = sum(is_paired(r) for r in self.all)
        if self.all and k == len(self.all):
            return ("paired: every run records `init`, so with the same seed every setting's shared parameters start from "
                    "the same values")
        clause = ("a kNN setting's shared parameters did not start where the same seed's `none` did, so its differences "
                  "also carry initialisation noise")
        if k == 0: return "stored before paired initialisation (no `init` recorded): " + clause
        return (f"{k} of {len(self.all)} runs paired; the others' differences also carry initialisation noise (a kNN "
                "setting started elsewhere than the same seed's `none`)")

    def rule(self) -> str:
        "`PAIRED_RULE` with these runs' seeds and pairing: the sentence printed below every verdict."
        return PAIRED_RULE.format(lo=LATE[0] // 1024, hi=LATE[1] // 1024, elo=EARLY[0] // 1024, ehi=EARLY[1] // 1024,
                                  seeds=self.seeds_text(),
                                  pairing=self.pairing_text(), margin=MARGIN, ppl=2 ** MARGIN - 1)

    def interval(self, label, base='none', lo=LATE[0], hi=LATE[1], early=None):
        """(mean, half-width of the 95% t-interval, pairs, paired) of `label` minus `base` over [lo, hi), seed by seed
        (`early`: minus the same difference over the bytes [early[0], early[1]), per seed); `paired`: every run of both
        started from the paired initialisation (else the differences also carry the initialisation's noise). NaN
        half-width with fewer than 2 pairs."""
        _, m, half, n = judge(self._diffs(label, base, lo, hi, early))
        return m, half, n, all(is_paired(r) for l in (label, base) for r in self.runs(l))

    def _diffs(self, label, base, lo, hi, early=None) -> list:
        d = self.diffs(label, base, lo, hi)
        return d if early is None else [a - b for a, b in zip(d, self.diffs(label, base, *early))]

    def paired_verdict(self, label, base='none', lo=LATE[0], hi=LATE[1], early=None):
        """By `PAIRED_RULE`: 'better' (the interval lies below 0), 'worse' (above 0), 'no difference' (inside
        +-`MARGIN`), 'not known' (otherwise, or fewer than 2 pairs); None if either was not run."""
        if label not in self.labels or base not in self.labels: return None
        return judge(self._diffs(label, base, lo, hi, early))[0]

    def interval_text(self, label, base='none', lo=LATE[0], hi=LATE[1], early=None, short=False) -> str:
        """'`label` − `base`: -0.012 ± 0.010 bits per byte (4 paired seeds), better', for a sentence; `short`: the
        numbers and the verdict alone, for a table cell."""
        if label not in self.labels or base not in self.labels: return f'`{label}` against `{base}`: not run yet'
        v, m, half, n = judge(self._diffs(label, base, lo, hi, early))
        paired = self.interval(label, base, lo, hi, early)[3]
        num = f"{m:+.{_places(m, half, v)}f}" + ('' if math.isnan(half) else f" ± {half:.{_places(m, half, v)}f}")
        if short: return f"{num}, {v}"
        return (f"`{label}` − `{base}`: {num} bits per byte ({n} {'paired ' if paired else ''}seed{'s' * (n != 1)}), {v}")

    def paper_ordering(self) -> list:
        """The paper's claims as this section checks them (late in documents, 8-16 KB), each with its verdict by
        `PAIRED_RULE` and the evidence: (claim, verdict, evidence). The memory-size claim needs every step from one size
        to the next 'better'; 'mixed': one step is better, another worse."""
        v, c = self.paired_verdict, self.interval_text
        sizes = [l for l in ('knn 1x', 'knn 4x', 'knn 16x', 'knn 64x') if l in self.labels]
        steps = [(b, a) for a, b in zip(sizes, sizes[1:])]
        more = [v(b, a) for b, a in steps]
        size = (None if not steps else 'better' if all(x == 'better' for x in more)
                else 'mixed' if 'better' in more and 'worse' in more else 'worse' if 'worse' in more
                else 'not known' if 'not known' in more else 'no difference')
        return [('a kNN memory lowers bits per byte', v('knn 16x', 'none'), c('knn 16x', 'none')),
                ('more memory lowers it more (1× → 4× → 16× → 64× the segment)', size, '; '.join(c(b, a) for b, a in steps)),
                ('the XL cache lowers it', v('xl', 'none'), c('xl', 'none')),
                ('memory + XL cache beats the XL cache alone', v('knn 16x + xl', 'xl'), c('knn 16x + xl', 'xl')),
                ('memory + XL cache beats the memory alone', v('knn 16x + xl', 'knn 16x'), c('knn 16x + xl', 'knn 16x'))]

    def short_answer(self) -> str:
        "Paragraphs for the docs home: what memory did late in the validation documents at this phase's budget, from the runs, and the rule."
        if not {'none', 'knn 16x'} <= set(self.labels):
            return 'The study has not been run yet (`make memorizing-study`).'
        c = self.config()
        verdicts = [v for _, v, _ in self.paper_ordering()]
        mem = [l for l in self.labels if l != 'none']
        by = {k: [l for l in mem if self.paired_verdict(l) == k] for k in ('better', 'worse', 'no difference', 'not known')}
        names = lambda ls: ', '.join(f'`{l}`' for l in ls)
        parts = [f"{k}: {names(ls)}" for k, ls in by.items() if ls and k != 'not known']
        if by['not known']: parts.append(f"not known: {'the other ' if parts else ''}{len(by['not known'])}")
        counts = {'agree': sum(v == 'better' for v in verdicts), 'disagree': sum(v == 'worse' for v in verdicts),
                  'mixed': sum(v == 'mixed' for v in verdicts), 'no difference': sum(v == 'no difference' for v in verdicts),
                  'not known': sum(v in ('not known', None) for v in verdicts)}
        out = (f"On bytes 8–16 KB of the validation documents, after {c['steps']:,} steps ({c['steps'] * c['batch'] * c['seq']:,} "
               f"training bytes, `d_model` {c['d_model']}, {self.seeds_text()}): "
               f"{self.interval_text('knn 16x')}; {self.interval_text('xl')}; {self.interval_text('knn 16x + xl')}. "
               + f"Against no memory, by the rule below, of {len(mem)} settings with a memory: "
               + ('' if by['better'] else 'none better; ') + '; '.join(parts) + '.\n\n'
               + f"Of the paper's {len(verdicts)} claims checked there: " + ', '.join(
                   f"{k} {what}" for what, k in counts.items() if k))
        if {'knn 64x', 'knn 64x faiss'} <= set(self.labels):
            out += (f". In these training runs (one thread each, two sharing the machine) a step with a memory of 64× the "
                    f"segment took {self.cost('knn 64x'):.2f}× the CPU time of a step without memory with exact search, "
                    f"{self.cost('knn 64x faiss'):.2f}× with faiss")
        return out + '.\n\n' + self.rule()

    def config(self) -> dict:
        "The phase's sizes as the runs recorded them (those of the setting without memory)."
        return self.runs('none')[0]['config'] if self.runs('none') else {}


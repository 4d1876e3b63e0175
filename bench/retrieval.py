"""Retrieval beyond the training length, for the chapter "Which method?": can a model use a token far back, not merely
avoid degrading? Every label of the study (bench/study.py) trains the study's `DecoderLM` on two synthetic byte tasks
at the study's training length T, then is read at 1x, 2x, 4x, 8x and 16x T:

- passkey: a key of `KEY_DIGITS` digits after the marker `#`, hidden in filler (lowercase letters and spaces) at a
  controlled depth; the prompt ends with `#` and the model must write the key (exact match of every digit);
- multi-query associative recall (MQAR): `PAIRS` pairs "key letter, value digit" spread through the filler, then
  `|` and every key again, each followed by its value (each value scored).

Both are generated deterministically from (seed, step) in training (the same batches for every label of a seed) and
from (length, depth) in evaluation (the same prompts for every label and seed). Accuracy is stored as counts
(correct, total) per length and depth, so seeds add exactly.

    python -m bench.retrieval                       # every (label, seed) not yet stored: resumable
    python -m bench.retrieval --labels none rotary --seeds 1
    python -m bench.retrieval --list
    python -m bench.retrieval --smoke --out D       # tiny models, a few steps (what the tests run)

Each run is stored as soon as it finishes in nbs/data/retrieval/<label>__seed<k>.json; stored runs are skipped.
"""
import argparse, json, math, statistics, sys, time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.pool import run_pool, write_json
from bench import study as S
from relpos.train import adamw, fit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'nbs' / 'data' / 'retrieval'
MULTIPLES = (1, 2, 4, 8, 16)          # read at these multiples of the training length
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # passkey: where the key sits in the filler (0: first, 1: just before the question)
KEY_DIGITS, PAIRS = 5, 8
MARK, SEP = ord('#'), ord('|')
FILLER = np.frombuffer(b'abcdefghijklmnopqrstuvwxyz ', dtype=np.uint8)
DIGITS = np.frombuffer(b'0123456789', dtype=np.uint8)
KEYS = np.frombuffer(b'ABCDEFGHIJKLMNOPQRSTUVWXYZ', dtype=np.uint8)
EVAL_SEED = 12345                     # the evaluation prompts: the same for every label and seed
EVAL_N = 8                            # prompts per (task, length, depth) in evaluation
# the study's training length; a smaller model than the study's (2 layers of width 64: induction needs 2) so that the
# task can be learned within a CPU budget
COMMON = dict(steps=2000, batch=16, seq=S.SEQ, d_model=64, heads=4, n_layers=2, lr=3e-3, warmup=50)
SMOKE = dict(steps=4, batch=4, seq=32, d_model=32, heads=2, n_layers=2, lr=2e-3, warmup=2, eval_n=1)

# ---------------------------------------------------------------------------------------------------------------
# The two tasks
# ---------------------------------------------------------------------------------------------------------------
def passkey(length:int, depth:float, rng:np.random.Generator):
    """A passkey prompt of `length + 1` bytes (a model reads the first `length` and predicts the next byte of each):
    filler, `#` and the key at `depth` of the filler, more filler, `#`, the key. Returns `(tokens, answer)`:
    `tokens` int64 `[length + 1]`, `answer` bool `[length]`, True where the *target* is a digit of the final key."""
    n = KEY_DIGITS + 1
    fill = length + 1 - 2 * n
    if fill < 0: raise ValueError(f"length must be >= {2 * n - 1} for a passkey of {KEY_DIGITS} digits, got {length}")
    if not 0 <= depth <= 1: raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    key = rng.choice(DIGITS, KEY_DIGITS)
    before = int(round(depth * fill))
    filler = rng.choice(FILLER, fill)
    block = np.concatenate([[MARK], key])
    toks = np.concatenate([filler[:before], block, filler[before:], block]).astype(np.int64)
    answer = np.zeros(length, dtype=bool)
    answer[length - KEY_DIGITS:] = True            # targets length+1-KEY_DIGITS .. length: the key's digits
    return torch.from_numpy(toks), torch.from_numpy(answer)

def mqar(length:int, rng:np.random.Generator, pairs:int=PAIRS):
    """A multi-query associative recall prompt of `length + 1` bytes: `pairs` pairs (a distinct capital letter, a
    digit) at random places in filler, then `|` and every key again in a random order, each followed by its value.
    Returns `(tokens, answer, depth)`: `answer` bool `[length]` True where the target is a queried value, `depth`
    float `[length]`: for those targets, where the pair sits in the context (0: first byte, 1: last)."""
    q = 2 * pairs
    ctx = length + 1 - 1 - q                     # context bytes before `|`
    fill = ctx - 2 * pairs
    if fill < 0: raise ValueError(f"length must be >= {4 * pairs} for {pairs} pairs, got {length}")
    keys, vals = rng.choice(KEYS, pairs, replace=False), rng.choice(DIGITS, pairs)
    gaps = np.bincount(rng.integers(0, pairs + 1, fill), minlength=pairs + 1)   # filler before each pair, and after the last
    filler, parts, where, at = rng.choice(FILLER, fill), [], [], 0
    for p in range(pairs):
        parts += [filler[gaps[:p].sum():gaps[:p + 1].sum()], [keys[p], vals[p]]]
        at += gaps[p]; where.append(at); at += 2
    parts.append(filler[gaps[:pairs].sum():])
    order = rng.permutation(pairs)
    toks = np.concatenate(parts + [[SEP]] + [[keys[p], vals[p]] for p in order]).astype(np.int64)
    answer, depth = np.zeros(length, dtype=bool), np.zeros(length)
    for n, p in enumerate(order):
        t = ctx + 1 + 2 * n + 1                  # the value's index in tokens; its target index is one less
        answer[t - 1], depth[t - 1] = True, where[p] / max(1, ctx - 2)
    return torch.from_numpy(toks), torch.from_numpy(answer), torch.from_numpy(depth)

def train_batch(step:int, batch:int, seq:int, seed:int):
    """Batch `step` of training at length `seq`: even rows passkey at a uniform depth, odd rows MQAR; drawn from
    (`seed`, `step`) alone, so every label of a seed trains on the same prompts in the same order.
    Returns `(x, y, answer)`: inputs, targets `[batch, seq]` and where the loss counts (the answers only)."""
    rng = np.random.default_rng([seed, step])
    rows = [passkey(seq, float(rng.uniform()), rng)[:2] if b % 2 == 0 else mqar(seq, rng)[:2] for b in range(batch)]
    toks, ans = torch.stack([t for t, _ in rows]), torch.stack([a for _, a in rows])
    return toks[:, :-1], toks[:, 1:], ans

def eval_prompts(task:str, length:int, n:int=EVAL_N):
    """The evaluation prompts of `task` at `length`: passkey, `n` at each depth of `DEPTHS`; MQAR, `n * len(DEPTHS)`
    prompts. Returns a list of `(tokens, answer, depth)` (passkey: depth is one number per prompt)."""
    out = []
    if task == 'passkey':
        for d, depth in enumerate(DEPTHS):
            rng = np.random.default_rng([EVAL_SEED, length, d])
            out += [passkey(length, depth, rng) + (depth,) for _ in range(n)]
    elif task == 'mqar':
        rng = np.random.default_rng([EVAL_SEED, length, 99])
        out = [mqar(length, rng) for _ in range(n * len(DEPTHS))]
    else: raise ValueError(f"task must be 'passkey' or 'mqar', got {task!r}")
    return out

# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------
def depth_bin(depth:float) -> int:
    "The index of the `DEPTHS` entry nearest to `depth` (MQAR's pairs are binned to the passkey's depths)."
    return min(range(len(DEPTHS)), key=lambda i: (abs(DEPTHS[i] - depth), i))

def score(task:str, logits:torch.Tensor, y:torch.Tensor, answer:torch.Tensor, depth) -> dict:
    """Counts `{depth index: [correct, total]}` for one prompt from its `logits [length, vocab]` and targets `y`:
    passkey, one item, correct when the argmax is right at every digit of the key (then greedy decoding writes the
    key); MQAR, one item per queried value, binned by the depth of its pair."""
    hit = logits.argmax(-1) == y
    out = {}
    if task == 'passkey':
        out[depth_bin(depth)] = [int(bool(hit[answer].all())), 1]
    else:
        for t in answer.nonzero().flatten().tolist():
            c = out.setdefault(depth_bin(float(depth[t])), [0, 0])
            c[0] += int(hit[t]); c[1] += 1
    return out

@torch.no_grad()
def read(model, x:torch.Tensor, segment:int=0) -> torch.Tensor:
    "Logits of `x [batch, length]`, in one pass or in segments of `segment` carrying the model's memory."
    if not segment: return model(x)[0]
    memory, outs = None, []
    for a in range(0, x.shape[1], segment):
        logits, memory = model(x[:, a:a + segment], memory)
        outs.append(logits)
    return torch.cat(outs, 1)

def evaluate(model, seq:int, segment:int=0, n:int=EVAL_N, multiples=MULTIPLES, device='cpu') -> dict:
    """Accuracy counts `{task: {length: {depth index: [correct, total]}}}` at every multiple of `seq`; a length the
    model refuses is stored as 'refused: <message>'."""
    was = model.training
    model.eval()
    out = {}
    for task in ('passkey', 'mqar'):
        out[task] = {}
        for m in multiples:
            L = m * seq
            counts = {}
            try:
                for toks, ans, depth in eval_prompts(task, L, n):
                    logits = read(model, toks[None, :-1].to(device), segment)[0].float().cpu()
                    for k, (c, t) in score(task, logits, toks[1:], ans, depth).items():
                        counts.setdefault(str(k), [0, 0])
                        counts[str(k)][0] += c; counts[str(k)][1] += t
                out[task][str(L)] = counts
            except (ValueError, TypeError) as e:
                out[task][str(L)] = 'refused: ' + str(e).splitlines()[0]
    model.train(was)
    return out

# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------
def answer_loss(segment:int=0, accuracy:list=None):
    """The tasks' loss for `relpos.train.fit`: cross-entropy on the answers only (`batch = (x, y, answer)`), the prompt
    read in one pass or in segments of `segment` carrying the memory from an empty one (each prompt is its own text,
    so no memory crosses steps). Each call appends the answers' accuracy to `accuracy`."""
    def loss_fn(model, batch, memory):
        x, y, ans = batch
        if segment:
            memory, outs = None, []
            for a in range(0, x.shape[1], segment):
                logits, memory = model(x[:, a:a + segment], memory)
                outs.append(logits)
            logits = torch.cat(outs, 1)
        else: logits = model(x)[0]
        loss = F.cross_entropy(logits[ans], y[ans])
        if accuracy is not None: accuracy.append((logits[ans].argmax(-1) == y[ans]).float().mean().item())
        return loss, loss.detach(), None
    return loss_fn

def _train(model, steps:int, batch:int, length:int, lr:float, warmup:int, seed:int, segment:int=0, device='cpu'):
    "`relpos.train.fit` on the tasks' batches (`train_batch` of `seed`) with `answer_loss`; returns per-step losses and accuracies."
    batches = (tuple(t.to(device) for t in train_batch(step, batch, length, seed)) for step in range(steps))
    losses, acc = [], []
    for s in fit(model, adamw(model, lr), batches, steps, lr, warmup, clip=1.0, loss_fn=answer_loss(segment, acc)):
        losses.append(s.loss.item())
    return losses, acc

def train_run(label:str, method:str, seed:int, steps:int=2000, batch:int=16, seq:int=S.SEQ, d_model:int=64,
              heads:int=4, n_layers:int=2, lr:float=3e-3, warmup:int=50, mem_len:int=0, nope_layers=(),
              rope_variants:bool=False, position_kwargs=None, eval_n:int=EVAL_N, device:str='cpu', **_) -> dict:
    """Train the study's model of `method` on the two tasks at length `seq` (loss on the answers only; AdamW and the
    study's schedule; paired initialisation, `bench.study.pair_init`), then `evaluate` it. Memory rows (`mem_len`)
    train on prompts of 2 `seq` read as two segments, and are read segment by segment. `rope_variants` (rotary): also
    read with each RoPE scaling of `bench.study.SCALINGS` at factor L / seq (evaluation only)."""
    t0 = time.time()
    torch.set_num_threads(1)
    dev = S._device(device)
    torch.manual_seed(seed)
    model = S.build_model(method, seq, d_model, heads, n_layers, mem_len, nope_layers, position_kwargs)
    init = S.pair_init(model, seed, d_model, heads, n_layers, seq)
    model.to(dev).train()
    segment = seq if mem_len else 0
    length = 2 * seq if mem_len else seq
    losses, acc = _train(model, steps, batch, length, lr, warmup, seed, segment, dev)
    train_seconds = time.time() - t0
    every = max(1, steps // 30)
    out = {'task': 'retrieval', 'label': label, 'method': method, 'seed': seed,
           'setting': dict(mem_len=mem_len, nope_layers=list(nope_layers), steps=steps, batch=batch, seq=seq,
                           train_length=length, d_model=d_model, heads=heads, n_layers=n_layers, lr=lr, warmup=warmup,
                           position_kwargs=dict(position_kwargs or {}), positions=S.position_record(model),
                           key_digits=KEY_DIGITS, pairs=PAIRS, eval_n=eval_n),
           'init': init, 'device': S.device_name(dev), 'params': sum(p.numel() for p in model.parameters()),
           'train_loss': [[i + every, round(statistics.mean(losses[i:i + every]), 4), round(statistics.mean(acc[i:i + every]), 4)]
                          for i in range(0, steps, every)],
           'train_seconds': round(train_seconds, 1), 'torch': torch.__version__, 'evals': {}}
    ev = lambda: evaluate(model, seq, segment, eval_n, device=dev)
    out['evals'][label] = ev()
    if rope_variants:
        for kind in S.SCALINGS:   # factor L / seq at each length, as in the study
            e = {'passkey': {}, 'mqar': {}}
            for m in MULTIPLES:
                S.set_rope_scaling(model, kind, m, seq)
                r = evaluate(model, seq, segment, eval_n, (m,), device=dev)
                for t in e: e[t].update(r[t])
            S.set_rope_scaling(model, None, 1, seq)
            out['evals'][f'{label}+{kind}'] = e
    out['seconds'] = round(time.time() - t0, 1)
    return out

# ---------------------------------------------------------------------------------------------------------------
# The runs, stored one file each
# ---------------------------------------------------------------------------------------------------------------
def derived_labels(label:str) -> list:
    "The labels a run of `label` stores: itself, and for rotary its RoPE scalings (evaluation only)."
    return [label] + ([f'{label}+{k}' for k in S.SCALINGS] if label == 'rotary' else [])

def all_runs(seeds:int=3, labels=None, common=None, steps=None) -> list:
    "Every run as keyword arguments of `train_run` (plus `label`), seed 0 of every label first."
    spec = S.settings()
    common = dict(common or COMMON)
    if steps: common['steps'] = steps
    labels = list(spec) if labels is None else list(labels)
    for l in labels:
        if l not in spec: raise ValueError(f"labels: {l!r} is not a label of the study; use one of {list(spec)}")
    return [dict(common, **at_depth(spec[l], common['n_layers']), label=l, seed=s) for s in range(seeds) for l in labels]

def at_depth(setting:dict, n_layers:int) -> dict:
    "A study setting for a model of `n_layers`: its NoPE layers counted from the top (the hybrid's NoPE layer is the last)."
    if not setting.get('nope_layers'): return setting
    return dict(setting, nope_layers=tuple(n_layers - S.COMMON['n_layers'] + l for l in setting['nope_layers']))

def run_file(label:str, seed:int, out=None) -> Path: return Path(out or RESULTS) / f"{label}__seed{seed}.json"

def stored_run(kw:dict, out=None):
    "The stored run of `kw`, or None (not stored, or stored with other position settings or steps than `kw` asks for)."
    f = run_file(kw['label'], kw['seed'], out)
    if not f.exists(): return None
    r = json.loads(f.read_text())
    same = all(r['setting'].get(k) == kw.get(k) for k in ('steps', 'batch', 'seq', 'd_model', 'heads', 'n_layers'))
    return r if same and S.is_current(r, kw) else None

def load_results(path=None) -> list:
    return [json.loads(p.read_text()) for p in sorted(Path(path or RESULTS).glob('*__seed*.json'))]

def _worker(kw:dict) -> dict:
    kw = dict(kw)
    out = kw.pop('out_dir')
    try: r = train_run(**kw)
    except Exception as e:   # reported, not stored: a rerun retries it
        import traceback; traceback.print_exc()
        return {'label': kw['label'], 'seed': kw['seed'], 'error': f"{type(e).__name__}: {e}"}
    write_json(run_file(kw['label'], kw['seed'], out), r)
    R = RetrievalResults([r])
    print(f"{time.strftime('%H:%M:%S')} done {kw['label']} seed {kw['seed']}: passkey "
          + ' '.join(f"{m}x:{R.accuracy(kw['label'], 'passkey', m * kw['seq']):.2f}" for m in MULTIPLES)
          + f", {r['seconds']:.0f} s", flush=True)
    return r

# ---------------------------------------------------------------------------------------------------------------
# Reading the stored runs (the chapter)
# ---------------------------------------------------------------------------------------------------------------
class RetrievalResults:
    "The stored retrieval runs with the summaries the chapter prints: accuracy by label, length and depth."
    def __init__(self, runs:list):
        self.all = [r for r in runs if 'error' not in r]
        order = [d for l in S.settings() for d in derived_labels(l)]
        found = {l for r in self.all for l in r['evals']}
        self.labels = [l for l in order if l in found] + sorted(found - set(order))
        self.seq = min((r['setting']['seq'] for r in self.all), default=S.SEQ)
        self.lengths = [m * self.seq for m in MULTIPLES]

    @classmethod
    def load(cls, path=None): return cls(load_results(path))

    def runs(self, label) -> list: return sorted((r for r in self.all if label in r['evals']), key=lambda r: r['seed'])

    def counts(self, label, task, length, depth=None):
        "[correct, total] over seeds (and depths unless `depth`, an index of `DEPTHS`); None if refused or not run."
        c, t = 0, 0
        for r in self.runs(label):
            cell = r['evals'][label][task].get(str(length))
            if cell is None or isinstance(cell, str): return None
            for k, (a, b) in cell.items():
                if depth is None or int(k) == depth: c, t = c + a, t + b
        return [c, t] if t else None

    def accuracy(self, label, task, length, depth=None) -> float:
        "Share correct; NaN where refused or not run."
        v = self.counts(label, task, length, depth)
        return math.nan if v is None else v[0] / v[1]

    def grid(self, label, task) -> np.ndarray:
        "Accuracy `[depth, length]` (rows `DEPTHS`, columns the lengths), NaN where refused."
        return np.array([[self.accuracy(label, task, L, d) for L in self.lengths] for d in range(len(DEPTHS))])

    def table(self, task) -> str:
        "Markdown: accuracy at each length (every depth together), with seeds and parameters."
        head = ['label', 'seeds', 'parameters'] + [f'{L} ({L // self.seq}×)' for L in self.lengths]
        cell = lambda l, L: ('refused' if self.counts(l, task, L) is None and self.runs(l) else f'{self.accuracy(l, task, L):.2f}')
        rows = [[f'`{l}`', str(len(self.runs(l))), f"{self.runs(l)[0]['params']:,}"] + [cell(l, L) for L in self.lengths]
                for l in self.labels]
        return '\n'.join(['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)] + ['| ' + ' | '.join(r) + ' |' for r in rows])

    # -- verdicts by a stated rule, on paired seed differences (as the study's bits per byte: `bench.study.VERDICT_RULE`) --
    def seed_accuracy(self, label, task, length) -> dict:
        "`{seed: accuracy}` at `length`, every depth together; a refused length is left out."
        out = {}
        for r in self.runs(label):
            cell = r['evals'][label][task].get(str(length))
            if cell is None or isinstance(cell, str): continue
            c, t = map(sum, zip(*cell.values())) if cell else (0, 0)
            if t: out[r['seed']] = c / t
        return out

    def judge(self, task, length) -> dict:
        """`{label: (verdict, mean difference to the best, half-width of its 95% interval, pairs)}` at `length` by
        `RETRIEVAL_RULE`: 'best' (highest mean accuracy of the labels with 2 or more seeds), 'worse' (the interval of the
        paired difference with it lies below 0), 'as good' (inside +-`RETRIEVAL_MARGIN`), 'not known' (neither, or fewer
        than 2 paired seeds), 'refused'; `{}` when no label with 2 seeds is above chance there (nothing to rank)."""
        acc = {l: self.seed_accuracy(l, task, length) for l in self.labels if self.runs(l)}
        out = {l: ('refused', math.nan, math.nan, 0) for l, a in acc.items() if not a}
        seeded = [l for l, a in acc.items() if len(a) >= 2]
        mean = lambda l: statistics.mean(acc[l].values())
        if not seeded or mean(best := max(seeded, key=mean)) <= CHANCE[task] + RETRIEVAL_MARGIN: return {}
        for l, a in acc.items():
            if not a: continue
            if l == best: out[l] = ('best', 0.0, 0.0, len(a)); continue
            d = [a[k] - acc[best][k] for k in sorted(set(a) & set(acc[best]))]
            if len(d) < 2 or l not in seeded:
                out[l] = ('not known', statistics.mean(d) if d else math.nan, math.nan, len(d)); continue
            m, half = statistics.mean(d), S.t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
            out[l] = ('worse' if m + half < 0 else 'as good' if -RETRIEVAL_MARGIN <= m - half and m + half <= RETRIEVAL_MARGIN
                      else 'not known', m, half, len(d))
        return out

    def verdict_table(self, task) -> str:
        """Markdown: at each length, the best label of 2 or more seeds and the labels as good as it, by `RETRIEVAL_RULE`
        (printed below); the last column names the one-seed labels (not judged) that scored above that best, or above
        chance + `RETRIEVAL_MARGIN` where nothing is ranked, so that a reader sees what a second seed would have to confirm."""
        rows = []
        for L in self.lengths:
            v = self.judge(task, L)
            names = lambda w: ', '.join(f'`{l}`' for l in v if v[l][0] == w) or '–'
            acc = {l: self.seed_accuracy(l, task, L) for l in self.labels if self.runs(l)}
            one = [l for l, a in acc.items() if len(a) == 1]
            if v:
                best = next(l for l in v if v[l][0] == 'best')
                bar = statistics.mean(acc[best].values())
                lead = f"`{best}` {bar:.2f}"
            else:
                two = any(len(a) >= 2 for a in acc.values())
                bar = CHANCE[task] + RETRIEVAL_MARGIN
                lead = f'no label of 2+ seeds above chance + {RETRIEVAL_MARGIN:g}' if two else 'no label with 2 seeds there yet'
            above = sorted((l for l in one if next(iter(acc[l].values())) > bar), key=lambda l: -next(iter(acc[l].values())))
            ones = f"{len(one)}" + (': ' + ', '.join(f"`{l}` {next(iter(acc[l].values())):.2f}" for l in above) if above else '')
            if not v:
                rows.append(f"| {L} ({L // self.seq}×) | {lead} | – | – | – | {ones} |")
                continue
            for l in one: v[l] = ('one seed',) + v[l][1:]
            rows.append(f"| {L} ({L // self.seq}×) | {lead} | {names('as good')} | {names('not known')} | "
                        f"{sum(v[l][0] == 'worse' for l in v)} | {ones} |")
        return ('| length | best of 2+ seeds (mean accuracy) | as good | not known | worse (count) | '
                'one seed, not judged: count, and those above the best (or above chance + '
                f'{RETRIEVAL_MARGIN:g} where nothing is ranked) |\n'
                '|---|---|---|---|---|---|\n'
                + '\n'.join(rows) + '\n\n' + RETRIEVAL_RULE.format(chance=CHANCE[task]))

RETRIEVAL_MARGIN = 0.1   # accuracy: 4 of the 40 prompts a seed reads per task and length
CHANCE = {'passkey': 0.0, 'mqar': 0.1}   # a 5-digit key guessed: 1e-5; a value digit guessed: 1 in 10
RETRIEVAL_RULE = ("*Rule:* of the labels with 2 or more seeds, the one of highest mean accuracy (every depth together) is "
                  "the *best*; when even it is not above chance ({chance:g}) + " + f"{RETRIEVAL_MARGIN:g}" + ", the row ranks "
                  "nothing. Every other label's difference with the best is taken seed by seed (the same training batches "
                  "and the same initial weights of the shared parameters): the 95% t-interval of the mean difference lying "
                  "below 0 gives *worse*, inside ±" + f"{RETRIEVAL_MARGIN:g}" + " *as good*; otherwise, and with fewer "
                  "than 2 paired seeds, *not known*.")

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--labels', nargs='*', default=None, help="default: every label of the study's main phase")
    ap.add_argument('--seeds', type=int, default=3)
    ap.add_argument('--steps', type=int, default=None, help=f"default {COMMON['steps']}")
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--list', action='store_true')
    ap.add_argument('--smoke', action='store_true', help='tiny models, a few steps (needs --out)')
    ap.add_argument('--out', default=None, help='directory of the stored runs (default nbs/data/retrieval)')
    ap.add_argument('--device', default='cpu', help="'cpu' (default) or 'cuda'; stored in each run")
    a = ap.parse_args(argv)
    if a.smoke and not a.out: sys.exit('--smoke needs --out (a smoke run is never stored with the real runs)')
    S._device(a.device)
    out = Path(a.out or RESULTS)
    runs = [dict(r, device=a.device) for r in all_runs(a.seeds, a.labels, SMOKE if a.smoke else COMMON, a.steps)]
    todo = [dict(r, out_dir=str(out)) for r in runs if not stored_run(r, out)]
    if a.list:
        left = {(r['label'], r['seed']) for r in todo}
        for r in runs: print(('todo   ' if (r['label'], r['seed']) in left else 'stored ') + f"{r['label']} seed {r['seed']}")
        return
    print(f"retrieval: {len(runs) - len(todo)} of {len(runs)} runs stored; running {len(todo)}", flush=True)
    results = run_pool(_worker, todo, a.workers)
    failed = [f"{r['label']} seed {r['seed']}: {r['error']}" for r in results if 'error' in r]
    if failed: sys.exit("failed runs (not stored; rerun to retry):\n" + '\n'.join(failed))

if __name__ == '__main__': main()

"""The study behind the chapter "Which method?" (nbs/11_which_method.ipynb): every position method in
`relpos.models.POSITIONS` trains the same small `DecoderLM` on the same bytes of real text, with the same optimizer,
schedule, batches and number of steps, over several seeds; each is then evaluated at 1x, 2x, 4x and 8x its training
length with two protocols. Beside the methods: rotary with RoPE scaling (evaluation only, and after a short
fine-tune at 4x the length), a NoPE hybrid, and every method that takes memory trained and read with it.

    python -m bench.study                   # every run of the main phase not yet stored (`make study`): resumable
    python -m bench.study --phase long      # 4x the steps for the best methods of the main phase, 2 seeds
    python -m bench.study --phase timing    # CPU time of a training step of every label: one thread, 5 interleaved rounds
    python -m bench.study --device cuda     # the same runs on a GPU (each run file records where it ran)
    python -m bench.study --list            # the runs of a phase and which are stored
    python -m bench.study --smoke --out D   # tiny models, a few steps, stored in D (what the tests run)

Each run is stored as soon as it finishes, in nbs/data/study/<phase>__<label>__seed<k>.json; stored runs are
skipped, so an interrupted study continues where it stopped. Runs go to `bench.pool.run_pool`: one fresh
single-threaded process per run, two at a time. A stored run whose position settings differ from what the study asks
for now (FIRE's threshold, T5's buckets: `is_current`) is set aside and run again. Every label of a seed starts from
the same weights wherever it shares parameters with `none` (`pair_init`), so per-seed differences are paired; the
verdicts (`StudyResults.judge`) follow `VERDICT_RULE`.
"""
import argparse, copy, hashlib, json, math, statistics, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.pool import run_pool, write_json
from relpos.train import adamw, fit, learning_rate, lm_loss

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'nbs' / 'data' / 'study'
PHASES = ('main', 'long', 'timing')
SEQ = 128                  # training length (bytes)
MULTIPLES = (1, 2, 4, 8)   # evaluation lengths, in training lengths
SCORED = 64                # sliding-window protocol: bytes scored at the end of each window
STRIDE = 128               # sliding-window protocol: distance between the ends of consecutive windows
MEM_LEN = SEQ              # memory rows: one segment of memory
NOPE_LAYERS = (2,)         # the NoPE hybrid: the last of 3 layers has no position method
SCALINGS = ('linear', 'dynamic', 'yarn')   # RoPE scalings tried on the trained rotary model
FT_FRACTION, FT_MULTIPLE = 0.1, 4          # fine-tune: 10% of the training steps at 4x the training length
COMMON = dict(steps=300, batch=16, seq=SEQ, d_model=128, heads=4, n_layers=3, lr=2e-3, warmup=30)
SMOKE = dict(steps=4, batch=4, seq=16, d_model=32, heads=2, n_layers=3, lr=2e-3, warmup=2, data_scale=0.05,
             eval_every=2, scored=8, stride=16, attn_windows=2)

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

def lr_at(step:int, steps:int, lr:float, warmup:int) -> float:
    "Linear warm-up, then cosine decay to a tenth of `lr`: `relpos.train.learning_rate`, the schedule training uses."
    return learning_rate(step, lr, warmup, steps)

# ---------------------------------------------------------------------------------------------------------------
# Evaluation: two protocols, bits per byte
# ---------------------------------------------------------------------------------------------------------------
def nonoverlap_windows(n_bytes:int, length:int) -> list:
    """Protocol (a): `(start, n)` of consecutive windows of `length` inputs through a text of `n_bytes` bytes (the
    last one shorter): window `data[s:s+n]` predicts `data[s+1:s+n+1]`, so every byte after the first is scored once."""
    n = n_bytes - 1
    return [(s, min(length, n - s)) for s in range(0, n, length)]

def sliding_ends(n_bytes:int, longest:int, stride:int) -> list:
    """Protocol (b): the end (exclusive) of every window's targets, `stride` apart, the first leaving room for the
    longest window; the same ends, hence the same scored bytes, at every length."""
    return list(range(longest + 1, n_bytes + 1, stride))

def _batch_size(length:int) -> int:   # windows per forward: bounded logits and [n, n] weights on the readable paths
    return max(1, min(64, 16384 // length, 4 * 2**20 // (length * length)))

@torch.no_grad()
def window_bits(model, data:torch.Tensor, starts, length:int, score_last:int, segment:int=0):
    """(bits, bytes) over windows `data[s:s+length]` predicting the next bytes, the last `score_last` of each scored.
    `segment`: read each window in segments of that many bytes, carrying the model's memory from one to the next
    (memory starts empty in every window)."""
    bits, count = 0.0, 0
    for i in range(0, len(starts), _batch_size(length)):
        idx = (torch.as_tensor(starts[i:i + _batch_size(length)])[:, None] + torch.arange(length + 1)).to(data.device)
        chunk = data[idx]
        x, y = chunk[:, :-1], chunk[:, 1:]
        if segment:
            memory, outs = None, []
            for a in range(0, length, segment):
                logits, memory = model(x[:, a:a + segment], memory)
                outs.append(logits)
            logits = torch.cat(outs, 1)
        else:
            logits, _ = model(x)
        lg, yy = logits[:, -score_last:], y[:, -score_last:]
        bits += F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), yy.reshape(-1), reduction='sum').item() / math.log(2)
        count += yy.numel()
    return bits, count

def evaluate(model, val:torch.Tensor, lengths, scored:int=SCORED, stride:int=STRIDE, segment:int=0, longest:int=None) -> dict:
    """Bits per byte at every length in `lengths`, `{'nonoverlap': {L: bpb}, 'sliding': {L: bpb}}`: (a) the whole
    text in consecutive windows of L, every byte scored; (b) windows of L ending `stride` apart, the last `scored`
    bytes of each scored (each with at least L - scored bytes of context). A length the model refuses (`ValueError`,
    `TypeError`) is stored as 'refused: <message>', never as a number. `longest` (default `max(lengths)`): the
    longest length of the study, which places the sliding windows' ends (the same scored bytes in every call)."""
    out = {'nonoverlap': {}, 'sliding': {}}
    ends = sliding_ends(len(val), longest or max(lengths), stride)
    was_training = model.training
    model.eval()
    for L in lengths:
        try:
            wins, bits, count = nonoverlap_windows(len(val), L), 0.0, 0
            for n in sorted({n for _, n in wins}):
                b, c = window_bits(model, val, [s for s, m in wins if m == n], n, n, segment)
                bits, count = bits + b, count + c
            out['nonoverlap'][str(L)] = bits / count
            b, c = window_bits(model, val, [e - L - 1 for e in ends], L, scored, segment)
            out['sliding'][str(L)] = b / c
        except (ValueError, TypeError) as e:
            msg = 'refused: ' + str(e).splitlines()[0]
            out['nonoverlap'].setdefault(str(L), msg)
            out['sliding'][str(L)] = msg
    model.train(was_training)
    return out

# ---------------------------------------------------------------------------------------------------------------
# Mechanism: what the attention does beyond the training length (stored with each run)
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def attention_stats(model, val:torch.Tensor, lengths, scored:int=SCORED, stride:int=STRIDE, windows:int=4, near:int=SEQ,
                    longest:int=None):
    """At every length L, for each layer, over the last `scored` queries of the first `windows` sliding windows
    (the bytes protocol (b) scores): `far`, the mean attention mass on keys at distance >= `near` (the training
    length: distances training never saw); `entropy`, the mean entropy of a query's weights in bits; for T5 layers
    `last_bucket`, the mass in the last (shared) bucket, and `last_bucket_keys`, the share of visible keys in it.
    None when a layer keeps no weights."""
    from relpos.mha import MultiHeadAttention
    mods = [l.self_attn.module for l in model.layers]
    if not all(isinstance(m, MultiHeadAttention) for m in mods): return None   # Shaw's module keeps its own layout
    ends = sliding_ends(len(val), longest or max(lengths), stride)[:windows]
    was_training = model.training
    model.eval()
    out = {}
    for m in mods: m.need_weights = True
    try:
        for L in lengths:
            idx = (torch.as_tensor([e - L - 1 for e in ends])[:, None] + torch.arange(L)).to(val.device)
            try: model(val[idx])
            except (ValueError, TypeError): continue
            q, k = torch.arange(L - scored, L)[:, None], torch.arange(L)[None]
            d = q - k                                                     # [scored, L]: distance of each key
            rows = []
            for m in mods:
                a = m.attn[-scored:].double().cpu()                       # [scored, L, batch, heads]
                row = {'far': (a * (d >= near)[..., None, None]).sum(1).mean().item(),
                       'entropy': -(a * torch.log2(a.clamp_min(1e-30))).sum(1).mean().item()}
                pos = getattr(m, 'positions', None)
                if hasattr(pos, 'bucket') and hasattr(pos, 'num_buckets'):
                    last = (pos.bucket(k - q) == pos.num_buckets - 1) & (d >= 0)
                    row['last_bucket'] = (a * last[..., None, None]).sum(1).mean().item()
                    row['last_bucket_keys'] = (last.sum(1) / (d >= 0).sum(1)).float().mean().item()
                rows.append({k_: round(v, 6) for k_, v in row.items()})
            out[str(L)] = rows
    finally:
        for m in mods: m.need_weights, m.attn = False, None
        model.train(was_training)
    return out

def bias_points(longest:int) -> list:
    "Distances at which a learned bias is stored: 0..15, then about 8 per octave up to `longest - 1`."
    pts = set(range(min(16, longest))) | {int(round(2 ** (i / 8))) for i in range(32, 8 * int(math.log2(longest)) + 1)}
    return sorted(p for p in pts if p < longest)

@torch.no_grad()
def fire_bias_curves(model, lengths) -> dict:
    """FIRE's learned bias against distance for the last query of a window of each length in `lengths` (its
    position L - 1 sets the normaliser): `{'distances': [...], 'bias': {L: [layer][head][value at each distance]}}`."""
    fires = [l.self_attn.module.positions for l in model.layers if hasattr(getattr(l.self_attn.module, 'positions', None), 'threshold')]
    if not fires: return None
    pts = bias_points(max(lengths))
    out = {'distances': pts, 'bias': {}, 'threshold': [round(f.threshold.item(), 3) for f in fires],
           'c': [round(f.c.item(), 5) for f in fires]}
    for L in lengths:
        rows = []
        for f in fires:
            b = f(1, L)[0, :, 0].flip(-1)                                  # [heads, distance 0..L-1]
            rows.append([[round(v, 4) for v in b[h, [p for p in pts if p < L]].tolist()] for h in range(b.shape[0])])
        out['bias'][str(L)] = rows
    return out

def set_rope_scaling(model, rope_type, factor:float, seq:int) -> int:
    """Give every rotary layer of `model` transformers' `rope_scaling` `{'rope_type': rope_type, 'factor': factor}`
    (yarn: `original_max_position_embeddings=seq`; dynamic: `max_position_embeddings=seq`), or none (`rope_type=None`);
    the weights do not change. Returns the number of layers changed."""
    from relpos.rotary import RotaryMultiHeadAttention, check_rope_scaling
    cfg = None if rope_type is None else {'rope_type': rope_type, 'factor': float(factor),
                                          **({'original_max_position_embeddings': seq} if rope_type == 'yarn' else {})}
    n = 0
    for m in model.modules():
        if isinstance(m, RotaryMultiHeadAttention):
            m.rope_scaling = check_rope_scaling(cfg, m.rotary_dim)
            m.max_position_embeddings = seq if rope_type == 'dynamic' else None
            n += 1
    return n

# ---------------------------------------------------------------------------------------------------------------
# One run: the model, its paired initialisation, what its position method was set to
# ---------------------------------------------------------------------------------------------------------------
# Runs stored before the run files recorded `positions` used these (FireBias's and T5's defaults of the time)
LEGACY_POSITIONS = {'fire': {'init_L': 512.0}, 't5': {'num_buckets': 32, 'max_distance': 128}}

def resolve_position_kwargs(position_kwargs, seq:int) -> dict:
    "`position_kwargs` of a setting with the rule `'T/4'` (a quarter of the training length `seq`) made a number."
    return {k: (seq // 4 if v == 'T/4' else v) for k, v in (position_kwargs or {}).items()}

def build_model(method:str, seq:int, d_model:int=128, heads:int=4, n_layers:int=3, mem_len:int=0, nope_layers=(),
                position_kwargs=None):
    "The study's `DecoderLM` over bytes for `method`, its tables sized for the training length `seq`."
    from relpos.models import DecoderLM
    return DecoderLM(256, d_model=d_model, heads=heads, n_layers=n_layers, position=method, mem_len=mem_len,
                     max_len=seq, nope_layers=tuple(nope_layers), **resolve_position_kwargs(position_kwargs, seq))

def position_record(model) -> dict:
    """What the position method was set to where the study varies it: FIRE's threshold `init_L`, T5's `num_buckets`
    and `max_distance` (`{}` for the other methods)."""
    for m in model.modules():
        if hasattr(m, 'init_L') and hasattr(m, 'L_multiplier'): return {'init_L': float(m.init_L)}
        if hasattr(m, 'num_buckets') and hasattr(m, 'max_distance') and hasattr(m, 'bucket'):
            return {'num_buckets': int(m.num_buckets), 'max_distance': int(m.max_distance)}
    return {}

def expected_positions(method:str, seq:int, mem_len:int=0, position_kwargs=None) -> dict:
    "`position_record` of the model a setting builds now (a one-layer model of the same method: the same rule)."
    return position_record(build_model(method, seq, 8, 2, 1, mem_len, (), position_kwargs))

def stored_positions(run:dict) -> dict:
    "`position_record` of a stored run; runs stored before it was recorded used `LEGACY_POSITIONS`."
    st = run.get('setting', {})
    return st['positions'] if 'positions' in st else dict(LEGACY_POSITIONS.get(run.get('method'), {}))

def is_current(run:dict, kw:dict) -> bool:
    "Whether stored `run` is the run `kw` asks for now: the same position settings (FIRE's threshold, T5's buckets)."
    return stored_positions(run) == expected_positions(kw['method'], kw.get('seq', SEQ), kw.get('mem_len', 0),
                                                       kw.get('position_kwargs'))

@torch.no_grad()
def pair_init(model, seed:int, d_model:int, heads:int, n_layers:int, seq:int) -> dict:
    """Give `model` the initialisation of every parameter it shares (same name, same shape) with `position='none'`'s
    model of the same size built from `seed`: embeddings, projections, feed-forward blocks, norms, output layer. Two
    labels with the same seed then start from the same weights and differ only where their methods differ, so their
    per-seed difference is paired. Returns what was shared."""
    torch.manual_seed(seed)
    ref = dict(build_model('none', seq, d_model, heads, n_layers).named_parameters())
    n, numel = 0, 0
    for name, p in model.named_parameters():
        q = ref.get(name)
        if q is not None and q.shape == p.shape:
            p.copy_(q); n, numel = n + 1, numel + p.numel()
    return {'paired_with': 'none', 'tensors': n, 'params': numel}

def _device(device:str):
    "The torch device `device` names ('cpu', 'cuda', 'cuda:1'), refused clearly where it is not present."
    if not isinstance(device, str): raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    d = torch.device(device)
    if d.type == 'cuda' and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device here; use --device cpu")
    return d

def device_name(device) -> str:
    "Where a run ran, in words, for the run file."
    d = torch.device(device)
    return torch.cuda.get_device_name(d) if d.type == 'cuda' else 'cpu (1 thread)'

def _rss(key:str) -> int:
    for line in open('/proc/self/status'):
        if line.startswith(key): return int(line.split()[1]) * 1024
    return 0

def _train(model, train, steps, batch, seq, lr, warmup, memory_len=0, step0=0, curve=None, eval_fn=None, eval_every=0):
    """`relpos.train.fit` on the study's stream (`stream_batch` from step `step0`): AdamW, clipped gradients, the
    schedule of `lr_at`, memory carried from step to step when `memory_len`; returns per-step losses (bits per byte)
    and step times."""
    batches = (stream_batch(train, step0 + step, batch, seq) for step in range(steps))
    loss_fn = lm_loss if memory_len else (lambda model, batch, memory: lm_loss(model, batch, None))   # no memory: each batch alone
    losses, times = [], []
    for s in fit(model, adamw(model, lr), batches, steps, lr, warmup, clip=1.0, loss_fn=loss_fn):
        times.append(s.seconds)
        losses.append(s.loss.item() / math.log(2))
        if eval_every and (s.step % eval_every == 0 or s.step == steps): curve.append((s.step, eval_fn()))
    return losses, times

def train_run(label:str, method:str, seed:int, phase:str='main', steps:int=300, batch:int=16, seq:int=SEQ,
              d_model:int=128, heads:int=4, n_layers:int=3, lr:float=2e-3, warmup:int=30, mem_len:int=0,
              nope_layers=(), rope_variants:bool=False, eval_every:int=50, evaluation:bool=True, scored:int=SCORED,
              stride:int=STRIDE, attn_windows:int=4, data_scale:float=1.0, position_kwargs=None,
              device:str='cpu') -> dict:
    """Train one `DecoderLM(position=method)` and evaluate it at 1x, 2x, 4x and 8x `seq` with both protocols
    (`evaluate`), keeping what explains the numbers (`attention_stats`, `fire_bias_curves`). `rope_variants` (rotary):
    the same trained model evaluated again with each RoPE scaling of `SCALINGS` at factor L / seq, and, from a copy
    of it, a fine-tune of `FT_FRACTION` of the steps at `FT_MULTIPLE` x seq with each scaling at that factor, then
    evaluated at every length. Memory (`mem_len`): trained and read segment by segment. `evaluation=False`: time only.
    `position_kwargs`: for the position method (`'T/4'`: a quarter of `seq`). Every parameter the model shares with
    `position='none'` starts as that model's of the same seed (`pair_init`). `device`: where it trains ('cpu', 'cuda')."""
    t_start = time.time()
    torch.set_num_threads(1)
    dev = _device(device)
    from relpos.relative_mha import extend_position_tables
    train = torch.frombuffer(bytearray(study_text('train')), dtype=torch.uint8).long()
    val = torch.frombuffer(bytearray(study_text('val')), dtype=torch.uint8).long()
    if data_scale < 1: train, val = train[:int(len(train) * data_scale)], val[:int(len(val) * data_scale)]
    val_sha = hashlib.sha256(bytes(val.to(torch.uint8).tolist())).hexdigest()
    train, val = train.to(dev), val.to(dev)
    lengths = [m * seq for m in MULTIPLES]
    torch.manual_seed(seed)
    model = build_model(method, seq, d_model, heads, n_layers, mem_len, nope_layers, position_kwargs)
    init = pair_init(model, seed, d_model, heads, n_layers, seq)
    model.to(dev)
    segment = seq if mem_len else 0
    curve = []
    curve_fn = lambda: round(evaluate(model, val, [seq], scored, stride * 4, segment, lengths[-1])['sliding'][str(seq)], 4)
    open('/proc/self/clear_refs', 'w').write('5')   # peak resident memory from here on is this run's training
    base = _rss('VmRSS')
    losses, times = _train(model, train, steps, batch, seq, lr, warmup, mem_len, curve=curve, eval_fn=curve_fn,
                           eval_every=eval_every if evaluation else 0)
    peak = _rss('VmHWM') - base
    train_seconds = time.time() - t_start
    every = max(1, steps // 30)   # the training curve, averaged over 30 stretches of steps (small files)
    out = {'phase': phase, 'label': label, 'method': method, 'seed': seed,
           'setting': dict(mem_len=mem_len, nope_layers=list(nope_layers), steps=steps, batch=batch, seq=seq,
                           d_model=d_model, heads=heads, n_layers=n_layers, lr=lr, warmup=warmup,
                           position_kwargs=dict(position_kwargs or {}), positions=position_record(model)),
           'init': init, 'device': device_name(dev),
           'params': sum(p.numel() for p in model.parameters()),
           'step_time': statistics.median(times[10:] or times), 'peak_bytes': peak,
           'train_bpb': [[i + every, round(statistics.mean(losses[i:i + every]), 4)] for i in range(0, steps, every)],
           'curve': curve, 'train_seconds': round(train_seconds, 1), 'torch': torch.__version__,
           'val_sha256': val_sha,
           'evals': {}, 'attention': {}}
    if not evaluation:
        out['seconds'] = round(time.time() - t_start, 1)
        return out
    ev = lambda m, ls=lengths: evaluate(m, val, ls, scored, stride, segment, lengths[-1])
    att = lambda m, ls=lengths: None if mem_len else attention_stats(m, val, ls, scored, stride, attn_windows, seq, lengths[-1])
    out['evals'][label], out['attention'][label] = ev(model), att(model)
    fire = fire_bias_curves(model, [seq, lengths[-1]])
    if fire: out['fire_bias'] = fire
    if seed == 0 and phase == 'main' and not mem_len:   # the small learned position tables, for the chapter's pictures
        keep = ('key_pos_bias', 'rotation_matrix', 'relative_attention_bias', 'relative_position_k', 'position_embeddings')
        out['positions'] = {k: [round(v, 5) for v in t.flatten().tolist()] + [list(t.shape)]
                            for k, t in model.state_dict().items() if any(w in k for w in keep) and t.numel() <= 16384}
    if rope_variants:
        for kind in SCALINGS:                      # evaluation only: factor = eval length / training length
            e, a = {'nonoverlap': {}, 'sliding': {}}, {}
            for L in lengths:
                set_rope_scaling(model, kind, L / seq, seq)
                r = ev(model, [L])
                for p in e: e[p].update(r[p])
                a.update(att(model, [L]) or {})
            set_rope_scaling(model, None, 1, seq)
            out['evals'][f'{label}+{kind}'], out['attention'][f'{label}+{kind}'] = e, a
        ft_steps, ft_len = max(1, round(FT_FRACTION * steps)), FT_MULTIPLE * seq
        for kind in SCALINGS:                      # a short fine-tune at FT_MULTIPLE x the length, same tokens per step
            ft = copy.deepcopy(model)
            set_rope_scaling(ft, kind, FT_MULTIPLE, seq)
            t0 = time.time()
            _train(ft, train, ft_steps, max(1, batch // FT_MULTIPLE), ft_len, lr * 0.1, max(1, ft_steps // 10), step0=steps)
            out.setdefault('finetune', {})[f'{label}+{kind}+ft'] = dict(steps=ft_steps, length=ft_len, factor=FT_MULTIPLE,
                                                                      batch=max(1, batch // FT_MULTIPLE), lr=lr * 0.1,
                                                                      seconds=round(time.time() - t0, 1))
            out['evals'][f'{label}+{kind}+ft'], out['attention'][f'{label}+{kind}+ft'] = ev(ft), att(ft)
    if method == 'xl' and not mem_len and extend_position_tables(model, seq - 1):
        # the same trained tables with every distance beyond the trained ones clipped to the longest trained row
        out['evals'][f'{label}+clip'], out['attention'][f'{label}+clip'] = ev(model), att(model)
    out['eval_seconds'] = round(time.time() - t_start - train_seconds, 1)
    out['seconds'] = round(time.time() - t_start, 1)
    return out

# ---------------------------------------------------------------------------------------------------------------
# The runs of each phase, stored one file each
# ---------------------------------------------------------------------------------------------------------------
def settings() -> dict:
    """label -> keyword arguments of `train_run`: every method of `POSITIONS`; rotary with its RoPE scalings
    (inside the `rotary` run); the NoPE hybrid; every method that takes memory, trained and read with `MEM_LEN`."""
    from relpos.models import POSITIONS
    out = {m: dict(method=m) for m in POSITIONS}
    out['rotary'] = dict(method='rotary', rope_variants=True)
    out['rotary+nope'] = dict(method='rotary', nope_layers=NOPE_LAYERS)
    # FIRE's threshold as the paper's listing sets it (512), far above this training length: the normaliser never acts
    out['fire+L512'] = dict(method='fire', position_kwargs={'init_L': 512.0})
    # T5 with the paper's ratio of max_distance to training length (128 at 512): buckets that training fills
    out['t5+quarter'] = dict(method='t5', position_kwargs={'max_distance': 'T/4'})
    out.update({f'{m}+memory': dict(method=m, mem_len=MEM_LEN) for m in POSITIONS if m != 'absolute'})
    return out

def derived_labels(label:str) -> list:
    "The labels a run of `label` stores numbers for: itself, and its evaluation variants (rotary's scalings, xl's clipped tables)."
    if label == 'rotary': return [label] + [f'{label}+{k}' for k in SCALINGS] + [f'{label}+{k}+ft' for k in SCALINGS]
    if label == 'xl': return [label, 'xl+clip']
    return [label]

def run_label(label:str) -> str:
    "The run that stores `label`'s numbers (`rotary+yarn+ft` -> `rotary`)."
    for l in settings():
        if label in derived_labels(l): return l
    raise ValueError(f"label must be one the study stores, got {label!r}")

def _cost(label:str) -> int:   # longest runs first within a seed: two workers end together
    return 3 if label == 'rotary' else 2 if label.endswith('+memory') else 1

def all_runs(phase:str='main', seeds=None, labels=None, common=None, steps=None) -> list:
    """Every run of `phase` as keyword arguments of `train_run` (plus `label`), seeds outermost (seed 0 of every label
    first: a study stopped half-way is balanced), the longest runs first within a seed. main: every label of
    `settings()`, 3 seeds; long: `labels` (see `long_labels`), 4x the steps, 2 seeds; timing: every label twice, 40
    steps, no evaluation."""
    if phase not in PHASES: raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    common = dict(common or COMMON)
    if steps: common['steps'] = steps
    spec = settings()
    labels = list(spec) if labels is None else list(labels)
    seeds = {'main': 3, 'long': 2, 'timing': 2}[phase] if seeds is None else seeds
    if phase == 'long': common['steps'] *= 4; common['eval_every'] = 4 * common.get('eval_every', 50)
    if phase == 'timing': common.update(steps=40, evaluation=False)
    order = sorted(labels, key=lambda l: -_cost(l))
    def run(l, s):
        kw = dict(common, **spec[l], label=l, seed=s, phase=phase)
        if phase == 'timing': kw['rope_variants'] = False   # the step of training is what is timed
        return kw
    return [run(l, s) for s in range(seeds) for l in order]

def run_file(phase:str, label:str, seed:int, out=None) -> Path:
    return Path(out or RESULTS) / f"{phase}__{label}__seed{seed}.json"

def stored_run(phase:str, kw:dict, out=None):
    """The stored run of `kw` (`phase`, label, seed), or None: not stored, or stored with other position settings than
    the study asks for now (`is_current`: such a run is run again, and its file replaced)."""
    f = run_file(phase, kw['label'], kw['seed'], out)
    if not f.exists(): return None
    r = json.loads(f.read_text())
    return r if is_current(r, kw) else None

def load_results(path=None) -> list:
    "Every stored run (one JSON file each)."
    return [json.loads(p.read_text()) for p in sorted(Path(path or RESULTS).glob('*__seed*.json'))]

def _worker(kw:dict) -> dict:
    kw = dict(kw)
    out = kw.pop('out_dir')
    try: r = train_run(**kw)
    except Exception as e:   # a failed run is reported, never silently dropped (and not stored: a rerun retries it)
        import traceback; traceback.print_exc()
        return {'label': kw['label'], 'seed': kw['seed'], 'phase': kw['phase'], 'error': f"{type(e).__name__}: {e}"}
    write_json(run_file(kw['phase'], kw['label'], kw['seed'], out), r)
    ev = r['evals'].get(kw['label'], {}).get('sliding', {})
    print(f"{time.strftime('%H:%M:%S')} done {kw['phase']} {kw['label']} seed {kw['seed']}: "
          f"{' '.join(f'{L}:{v:.3f}' if isinstance(v, float) else f'{L}:refused' for L, v in ev.items())} "
          f"step {r['step_time'] * 1e3:.0f} ms, {r['seconds']:.0f} s", flush=True)
    return r

# ---------------------------------------------------------------------------------------------------------------
# The timing phase: CPU time of a training step on one thread, every label interleaved, repeated
# ---------------------------------------------------------------------------------------------------------------
CPUTIME_FILE = 'cputime.json'

def cpu_timing(labels=None, repeats:int=5, steps:int=3, warmup:int=2, common=None, log=print) -> dict:
    """CPU time (`time.thread_time`: this thread's, so other processes' load is not counted) of a training step of
    every label of `settings()`, on one thread, in one process: each model built and warmed up `warmup` steps, then
    `repeats` rounds, each timing `steps` steps of every label in turn (the order rotated each round, so a slow
    stretch of the machine falls on every label alike). Returns `{label: [seconds per step, one per round]}` and the set-up."""
    torch.set_num_threads(1)
    c = dict(common or COMMON)
    spec = settings()
    labels = list(spec) if labels is None else list(labels)
    train = torch.frombuffer(bytearray(study_text('train')), dtype=torch.uint8).long()
    cases = {}
    for l in labels:
        kw = spec[l]
        torch.manual_seed(0)
        model = build_model(kw['method'], c['seq'], c['d_model'], c['heads'], c['n_layers'], kw.get('mem_len', 0),
                            kw.get('nope_layers', ()), kw.get('position_kwargs'))
        total = warmup + repeats * steps   # every step this label takes: the schedule's length
        batches = (stream_batch(train, s, c['batch'], c['seq']) for s in range(total))
        cases[l] = dict(model=model, steps=fit(model, adamw(model, c['lr']), batches, total, c['lr'], c['warmup']))
    step = lambda case: next(case['steps'])   # one training step of `relpos.train.fit`, its batch made within it
    for l in labels:
        for _ in range(warmup): step(cases[l])
    times = {l: [] for l in labels}
    for r in range(repeats):
        for l in labels[r % len(labels):] + labels[:r % len(labels)]:
            t0 = time.thread_time()
            for _ in range(steps): step(cases[l])
            times[l].append((time.thread_time() - t0) / steps)
        log(f"timing: round {r + 1} of {repeats} done", flush=True)
    return {'phase': 'timing', 'clock': 'time.thread_time (CPU time of the timing thread), 1 thread',
            'repeats': repeats, 'steps_per_repeat': steps, 'warmup_steps': warmup, 'order': 'rotated each round',
            'setting': {k: c[k] for k in ('batch', 'seq', 'd_model', 'heads', 'n_layers')},
            'params': {l: sum(p.numel() for p in cases[l]['model'].parameters()) for l in labels},
            'seconds': times, 'torch': torch.__version__, 'device': device_name('cpu'),
            'date': time.strftime('%Y-%m-%d')}

def load_cputime(path=None):
    "The stored timing phase (`CPUTIME_FILE` in the study's directory), or None."
    f = Path(path or RESULTS) / CPUTIME_FILE
    return json.loads(f.read_text()) if f.exists() else None

def time_ratios(timing:dict, label:str, base:str='none') -> list:
    "The CPU time of `label`'s step over `base`'s, one ratio per round (paired: the same round of the machine)."
    t = timing['seconds']
    if label not in t or base not in t: return []
    return [a / b for a, b in zip(t[label], t[base])]

TIMING_TOL = 0.10   # chapter 09's ratio carries no spread (the fastest of 3 rounds, 2 decimals, another model size)

def timing_disagreements(results, bench_rows:dict, tol:float=TIMING_TOL) -> dict:
    """`{label: (ratio in chapter 09's benchmark, (median, lowest, highest) here)}` for the labels of `bench_rows`
    (`{case: time ratio}` at the study's length) whose benchmark ratio lies outside the timing phase's range +- `tol`."""
    out = {}
    for l, r in bench_rows.items():
        if l == 'none' or not results.timing or l not in results.timing['seconds']: continue
        m, lo, hi = results.time_spread(l)
        if not lo - tol <= r <= hi + tol: out[l] = (r, (m, lo, hi))
    return out

def long_labels(results=None) -> list:
    """The runs of the `long` phase: every base method (each entry of `POSITIONS`, as the main phase trains it), plus,
    for each method, the run behind its best label of the main phase by protocol (b) at 8x the training length when
    that is another run (a memory row, FIRE's or T5's variant); a variant of rotary's evaluation (`rotary+yarn+ft`) is
    in the `rotary` run. No selection by rank: the long phase compares every method."""
    from relpos.models import POSITIONS
    R = results or StudyResults.load()
    spec, L = settings(), R.long
    runs = [m for m in POSITIONS if m in spec]
    for m in runs[:]:
        family = [l for l in R.labels if spec.get(run_label(l), {}).get('method') == m and R.runs(l)
                  and math.isfinite(R.mean(l, L, 'sliding'))]
        if family:
            best = run_label(min(family, key=lambda l: R.mean(l, L, 'sliding')))
            if best not in runs: runs.append(best)
    return runs

# ---------------------------------------------------------------------------------------------------------------
# Reading the stored runs (the chapter and the docs home)
# ---------------------------------------------------------------------------------------------------------------
# A difference whose 95% interval lies inside +-EQUIVALENCE_MARGIN bits per byte counts as none ('as good', 'tie'); an
# interval that holds 0 but reaches past it supports neither 'as good' nor 'worse': 'not known'
EQUIVALENCE_MARGIN = 0.1
PROTOCOLS = {'nonoverlap': '(a) non-overlapping windows', 'sliding': f'(b) sliding window'}

class StudyResults:
    "The stored runs (`nbs/data/study/`) with the summaries the chapter and the docs home print."
    def __init__(self, runs:list, expected:dict=None):
        spec, current = settings(), {}
        def stale(r):   # stored with other position settings than the study's label asks for now: not counted
            kw = spec.get(r['label'])
            if kw is None: return False
            seq, mem = r['setting']['seq'], r['setting'].get('mem_len', 0)
            if (r['label'], seq, mem) not in current:
                current[r['label'], seq, mem] = expected_positions(kw['method'], seq, mem, kw.get('position_kwargs'))
            return stored_positions(r) != current[r['label'], seq, mem]
        self.stale = [r for r in runs if 'error' not in r and stale(r)]
        self.all = [r for r in runs if 'error' not in r and not stale(r)]
        self.expected = expected or {}   # phase -> [(label, seed)] that the study runs
        self.timing = None               # the timing phase (`cpu_timing`), set by `load`
        order = [d for l in settings() for d in derived_labels(l)]
        found = {l for r in self.all if r['phase'] != 'timing' for l in r['evals']}
        self.labels = [l for l in order if l in found] + sorted(found - set(order))
        seqs = {r['setting']['seq'] for r in self.all}
        self.seq = min(seqs) if seqs else SEQ
        self.lengths = [m * self.seq for m in MULTIPLES]
        self.long = self.lengths[-1]

    @classmethod
    def load(cls, path=None):
        "The stored runs in `path` (default nbs/data/study/), with the runs of the main and timing phases that are expected."
        runs = load_results(path)
        R = cls([r for r in runs if r['phase'] != 'timing'], {'main': [(r['label'], r['seed']) for r in all_runs('main')]})
        R.timing = load_cputime(path)
        R.expected['long'] = [(r['label'], r['seed']) for r in all_runs('long', labels=long_labels(R))]
        return R

    def stored(self, phase='main') -> list: return sorted({(r['label'], r['seed']) for r in self.all if r['phase'] == phase})
    def missing(self, phase='main') -> list:
        have = set(self.stored(phase))
        return [k for k in self.expected.get(phase, []) if k not in have]

    def coverage(self) -> str:
        "Which runs are stored, phase by phase, and which expected ones are missing, seed by seed (a sentence for the chapter)."
        return '; '.join(self.coverage_lines()) + '.'

    def coverage_lines(self) -> list:
        "`coverage`, one phase (and the runs set aside) per item."
        out = []
        for p in PHASES:
            have, miss = self.stored(p), self.missing(p)
            if not have and p != 'main': continue
            if p in self.expected:   # runs of labels an earlier plan trained are counted apart, by label
                planned = set(self.expected[p]); extra = [k for k in have if k not in planned]
                s = f"{p}: {len(have) - len(extra)} of the {len(planned)} planned runs stored"
                if extra:
                    ls = sorted({l for l, _ in extra})
                    s += (f" (and {len(extra)} more of labels it no longer plans: "
                          + ', '.join(f"`{l}` ({sum(x == l for x, _ in extra)})" for l in ls) + ')')
            else: s = f"{p}: {len(have)} runs stored"
            by_seed = {}
            for l, k in miss: by_seed.setdefault(k, []).append(l)
            every = {l for l, _ in self.expected.get(p, [])}
            if by_seed and len({tuple(ls) for ls in by_seed.values()}) == 1:   # the same labels missing at every seed
                ls = next(iter(by_seed.values()))
                s += '; missing: ' + ('every label' if set(ls) == every else ', '.join(f'`{l}`' for l in ls)) + \
                     f" (seed{'s' * (len(by_seed) > 1)} {', '.join(map(str, sorted(by_seed)))})"
            elif by_seed:
                s += '; missing: ' + '; '.join(f"seed {k}: " + ('every label' if set(ls) == every else ', '.join(f'`{l}`' for l in ls))
                                               for k, ls in sorted(by_seed.items()))
            out.append(s)
        if self.timing: out.append(f"timing: {len(self.timing['seconds'])} labels, {self.timing['repeats']} rounds")
        if self.stale:
            old = sorted({(r['phase'], r['label']) for r in self.stale})
            out.append('set aside (stored with other position settings than the study uses now): '
                       + ', '.join(f"{p} `{l}` ({len([r for r in self.stale if (r['phase'], r['label']) == (p, l)])} runs)" for p, l in old))
        return out

    def runs(self, label, phase='main') -> list:
        "Stored runs of `phase` that hold numbers for `label`, by seed."
        return sorted((r for r in self.all if r['phase'] == phase and label in r['evals']), key=lambda r: r['seed'])

    def seeds(self, label, phase='main') -> list: return [r['seed'] for r in self.runs(label, phase)]

    def values(self, label, length, protocol='sliding', phase='main') -> list:
        return [r['evals'][label][protocol][str(length)] for r in self.runs(label, phase)]

    def bpb(self, label, length, protocol='sliding', phase='main'):
        "(mean, sample sd, seeds) of bits per byte; the refusal message where the method refused; None if not run."
        vals = self.values(label, length, protocol, phase)
        if not vals: return None
        if any(isinstance(v, str) for v in vals): return next(v for v in vals if isinstance(v, str))
        return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else math.nan), len(vals)

    def mean(self, label, length, protocol='sliding', phase='main') -> float:
        "Mean bits per byte; infinity for a refusal, NaN if not run."
        v = self.bpb(label, length, protocol, phase)
        return math.nan if v is None else math.inf if isinstance(v, str) else v[0]

    def fmt(self, label, length, protocol='sliding', phase='main') -> str:
        v = self.bpb(label, length, protocol, phase)
        if v is None: return '–'
        if isinstance(v, str): return 'refused'
        return f'{v[0]:.3f}' + ('' if math.isnan(v[1]) else f' ± {v[1]:.3f}')

    def one_pass(self, phase='main') -> list: return [l for l in self.labels if not l.endswith('+memory') and self.runs(l, phase)]
    def memory_rows(self, phase='main') -> list: return [l for l in self.labels if l.endswith('+memory') and self.runs(l, phase)]

    def ranking(self, protocol='sliding', length=None, phase='main', labels=None) -> list:
        "Labels by mean bits per byte at `length` (default the longest), best first; refusals last, labels not run left out."
        length = length or self.long
        ls = [l for l in (labels or self.labels) if not math.isnan(self.mean(l, length, protocol, phase))]
        return sorted(ls, key=lambda l: self.mean(l, length, protocol, phase))

    def time_spread(self, label) -> tuple:
        """(median, lowest, highest) over the timing phase's rounds of the CPU time of `label`'s training step over
        `none`'s (`cpu_timing`); NaNs until it is stored. The quality runs' own step times, kept in each run file, were
        measured under whatever else the machine was running and are not used."""
        r = time_ratios(self.timing, run_label(label) if label in _all_derived() else label) if self.timing else []
        return (statistics.median(r), min(r), max(r)) if r else (math.nan,) * 3

    def ratio_text(self, label) -> str:
        "'1.23× (1.20–1.25)': the median ratio to `none` and its range over rounds, or '–' before the timing phase."
        m, lo, hi = self.time_spread(label)
        return '–' if math.isnan(m) else f'{m:.2f}× ({lo:.2f}–{hi:.2f})'

    def time_ratio(self, label) -> float: return self.time_spread(label)[0]

    def attention(self, label, length, key='far', layer=None, phase='main'):
        "Mean over seeds (and layers, unless `layer`) of an `attention_stats` entry; NaN where not stored."
        vals = []
        for r in self.runs(label, phase):
            a = (r.get('attention') or {}).get(label) or {}
            rows = a.get(str(length))
            if rows: vals.append(statistics.mean(x[key] for x in (rows if layer is None else [rows[layer]])))
        return statistics.mean(vals) if vals else math.nan

    def params(self, label, phase='main') -> str:
        "The trained model's parameter count, '–' if not run."
        r = self.runs(label, phase) or self.runs(run_label(label) if label in _all_derived() else label, phase)
        return f"{r[0]['params']:,}" if r and 'params' in r[0] else '–'

    def table(self, protocol='sliding', phase='main') -> str:
        "Markdown: every label's bits per byte at 1x-8x the training length under `protocol`, with its seeds, parameters and step time."
        head = ['label', 'seeds', 'parameters'] + [f'{L} ({L // self.seq}×)' for L in self.lengths] + ['CPU time of a step vs `none`']
        rows = [[f'`{l}`', str(len(self.runs(l, phase))), self.params(l, phase)] + [self.fmt(l, L, protocol, phase) for L in self.lengths]
                + [self.ratio_text(l)] for l in self.labels if self.runs(l, phase)]
        return '\n'.join(['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)] + ['| ' + ' | '.join(r) + ' |' for r in rows])

    # -- verdicts by a stated rule, on paired seed differences -----------------------------------------------------
    def paired_differences(self, a, b, length, protocol='sliding', phase='main') -> list:
        "`a` minus `b` in bits per byte, seed by seed, over the seeds both have numbers for (refusals left out)."
        va = {r['seed']: r['evals'][a][protocol][str(length)] for r in self.runs(a, phase)}
        vb = {r['seed']: r['evals'][b][protocol][str(length)] for r in self.runs(b, phase)}
        return [va[k] - vb[k] for k in sorted(set(va) & set(vb))
                if not isinstance(va[k], str) and not isinstance(vb[k], str)]

    def judge(self, length=None, protocol='sliding', phase='main', labels=None) -> dict:
        """`{label: (verdict, mean difference to the best, half-width of its 95% interval, pairs)}` at `length` by
        `VERDICT_RULE`: 'best' (lowest mean), 'worse' (the interval of the paired difference with the best lies above 0),
        'as good' (it lies inside +-`EQUIVALENCE_MARGIN`), 'not known' (neither, or fewer than 2 paired seeds), 'refused'."""
        length = length or self.long
        ls = [l for l in (labels or self.labels) if self.runs(l, phase)]
        finite = [l for l in ls if math.isfinite(self.mean(l, length, protocol, phase))]
        out = {l: ('refused', math.nan, math.nan, 0) for l in ls if self.mean(l, length, protocol, phase) == math.inf}
        seeded = [l for l in finite if len(self.runs(l, phase)) >= 2]   # a mean of one seed cannot be the reference
        for l in finite:
            if l not in seeded: out[l] = ('not known', math.nan, math.nan, len(self.runs(l, phase)))
        if not seeded: return out
        best = min(seeded, key=lambda l: self.mean(l, length, protocol, phase))
        for l in finite:   # a label with one seed: its one paired difference with the best, no interval, no verdict
            if l not in seeded:
                d = self.paired_differences(l, best, length, protocol, phase)
                out[l] = ('not known', statistics.mean(d) if d else math.nan, math.nan, len(d))
        for l in seeded:
            if l == best:
                out[l] = ('best', 0.0, 0.0, len(self.runs(l, phase))); continue
            d = self.paired_differences(l, best, length, protocol, phase)
            if len(d) < 2:
                out[l] = ('not known', statistics.mean(d) if d else math.nan, math.nan, len(d)); continue
            m, half = statistics.mean(d), t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
            out[l] = (_verdict(m, half), m, half, len(d))
        return out

    def verdict_table(self, length=None, protocol='sliding', phase='main', labels=None) -> str:
        "Markdown: each label's verdict at `length` by `VERDICT_RULE`, with its parameters, mean and paired difference; the rule below."
        length = length or self.long
        v = self.judge(length, protocol, phase, labels)
        order = sorted(v, key=lambda l: (['best', 'as good', 'not known', 'worse', 'refused'].index(v[l][0]), v[l][1] if math.isfinite(v[l][1]) else 0))
        def fmt(l):
            verdict, m, half, n = v[l]
            if verdict in ('best', 'refused'): return '–'
            if math.isnan(m): return f"– ({self.seed_note(l, phase)})"
            if math.isnan(half): return f"{m:+.3f}, one pair: no interval ({self.seed_note(l, phase)})"
            return f"{m:+.3f} ± {half:.3f} ({n})"
        rows = [f"| `{l}` | {self.params(l, phase)} | {self.fmt(l, length, protocol, phase)} | {fmt(l)} | {v[l][0]} |" for l in order]
        head = f"| label | parameters | bpb at {length} | difference with the best, 95% interval (pairs) | verdict |\n|---|---|---|---|---|\n"
        return head + '\n'.join(rows) + '\n\n' + VERDICT_RULE.format(length=length, multiple=length // self.seq,
                                                                   protocol=PROTOCOLS[protocol])

    def verdicts(self, phase='main') -> dict:
        "The facts behind the 'which to use' table, each by `VERDICT_RULE`."
        seq, L = self.seq, self.long
        one, mem = self.one_pass(phase), self.memory_rows(phase)
        mem2 = [l for l in mem if len(self.runs(l, phase)) >= 2]   # a mean of one seed recommends nothing
        m = lambda l, n, p: self.mean(l, n, p, phase)
        # at the training length only the models as trained compete: an evaluation-time variant is the same model there,
        # and a fine-tuned one had 10% more steps
        trained = [l for l in one if l in settings()] or one
        short = self.judge(seq, 'nonoverlap', phase, trained)
        near = [l for l in trained if short.get(l, ('',))[0] in ('best', 'as good')]
        best_short = next((l for l in near if short[l][0] == 'best'), None)
        long = {p: self.judge(L, p, phase, one) for p in PROTOCOLS}
        tr = lambda l: math.inf if math.isnan(self.time_ratio(l)) else self.time_ratio(l)
        return dict(best_short=best_short, near=near,
                    cheapest_near=min(near, key=lambda l: (tr(l), l != best_short)) if near else None,
                    best_long={p: next((l for l in long[p] if long[p][l][0] == 'best'), None) for p in PROTOCOLS},
                    good_long={p: [l for l in one if long[p].get(l, ('',))[0] in ('best', 'as good')] for p in PROTOCOLS},
                    unknown_long=[l for l in one if long['sliding'].get(l, ('',))[0] == 'not known'],
                    best_memory={p: min(mem2, key=lambda l: m(l, L, p)) if mem2 else None for p in PROTOCOLS},
                    refused=[l for l in one if long['sliding'].get(l, ('',))[0] == 'refused'],
                    worse=[l for l in one if long['sliding'].get(l, ('',))[0] == 'worse'],
                    judged={'short': short, 'long': long})

    def seed_note(self, label, phase='main') -> str:
        "'1 seed', '3 seeds': how many runs a label's numbers rest on."
        n = len(self.runs(label, phase))
        return f"{n} seed{'s' * (n != 1)}"

    # -- the papers' claims, checked by the same rule --------------------------------------------------------------
    def compare(self, terms, protocol='sliding', phase='main') -> tuple:
        """The sum of `terms` [(label, multiple of the training length, sign)], seed by seed over the seeds every term
        has (refusals left out): ('lower' | 'higher' | 'tie' | 'not known', mean, half-width of its 95% t-interval,
        seeds). 'lower': the interval lies below 0; 'tie': inside +-`EQUIVALENCE_MARGIN`; else, or with fewer than 2
        seeds: 'not known'."""
        vals = []
        for l, mult, _ in terms:
            vals.append({r['seed']: r['evals'][l][protocol].get(str(mult * self.seq)) for r in self.runs(l, phase)})
        common = sorted(set.intersection(*(set(v) for v in vals))) if vals else []
        d = [sum(sg * v[k] for (_, _, sg), v in zip(terms, vals)) for k in common
             if all(isinstance(v[k], (int, float)) for v in vals)]
        if len(d) < 2: return ('not known', statistics.mean(d) if d else math.nan, math.nan, len(d))
        m, half = statistics.mean(d), t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
        return ('lower' if m + half < 0 else 'higher' if m - half > 0 else 'tie' if _inside(m, half) else 'not known',
                m, half, len(d))

    def check_claim(self, claim:dict, protocol='sliding', phase='main') -> tuple:
        """(verdict, [(what, outcome, text)]) for one of `PAPER_CLAIMS`. A check 'agrees' (it comes out as the paper says),
        is 'not shown' (its interval holds 0), 'disagrees' (the opposite) or 'not known' (fewer than 2 seeds, or not
        stored). The claim: 'agrees' when every check does; 'partly' when some do; 'disagrees' when none does and one
        is the opposite; 'not shown' when every check is known and ties; else 'not known'."""
        out = []
        for what, terms, accept in claim['checks']:
            missing = sorted({l for l, _, _ in terms if not self.runs(l, phase)})
            if missing:
                out.append((what, 'not known', 'not stored: ' + ', '.join(f'`{l}`' for l in missing))); continue
            o, m, half, n = self.compare(terms, protocol, phase)
            if o == 'not known' and n >= 2:
                text = f"{m:+.3f} ± {half:.3f} ({n} seeds), the interval reaches past ±{EQUIVALENCE_MARGIN:g}"
            elif o == 'not known':
                few = min((l for l, _, _ in terms), key=lambda l: len(self.runs(l, phase)))
                text = ('–' if math.isnan(m) else f"{m:+.3f}") + f", `{few}` has {self.seed_note(few, phase)}"
            else: text = f"{m:+.3f} ± {half:.3f} ({n} seeds)"
            v = 'agrees' if o in accept else o if o == 'not known' else 'not shown' if o == 'tie' else 'disagrees'
            out.append((what, v, text + {'lower': ', lower', 'higher': ', higher', 'tie': ', interval holds 0'}.get(o, '')))
        got = [o for _, o, _ in out]
        if got and all(o == 'agrees' for o in got): verdict = 'agrees'
        elif 'agrees' in got: verdict = 'partly'             # some checks as the paper says, others not or not known
        elif 'disagrees' in got: verdict = 'disagrees'       # none as the paper says, one the opposite
        elif got and 'not known' not in got: verdict = 'not shown'
        else: verdict = 'not known'
        return verdict, out

    def claims_table(self, claims=None, protocol='sliding', phase='main') -> str:
        """Markdown: each paper's claim about extrapolation, the checks that test it on the stored runs (paired seed
        differences of bits per byte, protocol (b)), the verdict, and what differs between the paper's setting and this one."""
        word = {'agrees': 'as the paper says', 'disagrees': 'the opposite of the paper', 'not shown': 'not shown', 'not known': 'no verdict'}
        rows = []
        for c in (PAPER_CLAIMS if claims is None else claims):
            verdict, checks = self.check_claim(c, protocol, phase)
            absent = {t for _, _, t in checks if t.startswith('not stored')}
            ev = (f"{next(iter(absent))[len('not stored: '):]} not stored yet" if len(absent) == 1 and all(t in absent for _, _, t in checks)   # one line, not one per check
                  else '; '.join(f"{what}: {text}, {word.get(o, o)}" for what, o, text in checks))
            why = c['why'](self) if c.get('why') else ''
            rows.append(f"| {c['paper']} | {c['claim']} | {ev} | **{verdict}** | {c['setting']}{'; ' + why if why else ''} |")
        head = ("| paper | its claim | here: paired difference in bits per byte (b), 95% interval (seeds) | verdict | "
                "its setting; what the stored runs show about the gap |\n|---|---|---|---|---|\n")
        return head + '\n'.join(rows) + '\n\n' + CLAIM_RULE

    def which_to_use(self) -> str:
        "Markdown table: what to pick for which need, each row with the stored numbers it rests on, and the rule under it."
        if not self.one_pass(): return '*No run of the study is stored yet: `make study` runs it.*'
        seq, L, v = self.seq, self.long, self.verdicts()
        b = lambda l, n, p, ph='main': f"{self.mean(l, n, p, ph):.3f}"
        most = max(len(self.runs(l)) for l in self.labels)
        few = lambda l: len(self.runs(l)) < most     # fewer seeds than the rest: a wider interval, said where it counts
        names = lambda ls: ', '.join(f'`{l}`' + (f' ({self.seed_note(l)})' if few(l) else '') for l in ls)
        rows = []
        best, cheap, near = v['best_short'], v['cheapest_near'], v['near']
        ev = '; '.join(f"`{l}` {b(l, seq, 'nonoverlap')}" for l in near) + f" at {seq} (protocol a)"
        if not near: ev = 'no label has 2 seeds stored'
        if near and cheap != best and self.time_ratio(cheap) < self.time_ratio(best):
            ev += f"; `{cheap}` at {self.time_ratio(cheap):.2f}× the CPU time of `none` (`{best}`: {self.time_ratio(best):.2f}×)"
        rows.append(('the best quality at the length you train on', names(near) or 'not known', ev))
        for p, name in (('sliding', 'each byte with the longest context (sliding window)'), ('nonoverlap', 'in consecutive windows')):
            good = v['good_long'][p]
            rows.append((f'texts longer than you trained on, read in one pass, {name}', names(good) or 'not known',
                         '; '.join(f"`{l}` {b(l, L, p)}" for l in good) + f" at {L} ({L // seq}×, protocol {'b' if p == 'sliding' else 'a'})"))
        bm, bo = v['best_memory']['nonoverlap'], v['best_long']['nonoverlap']
        if bm and bo:
            gain = self.mean(bm, L, 'nonoverlap') < self.mean(bo, L, 'nonoverlap')
            base = bm[:-len('+memory')]
            rows.append(('long texts read segment by segment',
                         f"`{base}` with `mem_len`" if gain else f"no memory: `{bo}` read in one pass",
                         f"best with memory `{bm}` {b(bm, L, 'nonoverlap')} at {L} (a), against `{base}` in one pass "
                         f"{b(base, L, 'nonoverlap')} and the best in one pass `{bo}` {b(bo, L, 'nonoverlap')}"
                         + ('' if math.isnan(self.time_ratio(bm)) else f"; `{bm}` at {self.time_ratio(bm):.2f}× the CPU time of `none`")))
        worse, refused = v['worse'], v['refused']
        if worse or refused:
            rows.append((f'beyond the training length, avoid (worse than the best at {L // seq}×, protocol b)', names(worse + refused),
                         f"worse than the best at {L} by the rule (protocol b)" + (f"; {names(refused)} refuse{'s' * (len(refused) == 1)} longer inputs" if refused else '')))
        if v['unknown_long']:
            rows.append(('not known yet (fewer than 2 seeds, or seeds that disagree too much)', names(v['unknown_long']),
                         '; '.join(f"`{l}` {b(l, L, 'sliding')}" for l in v['unknown_long']) + f" at {L} (protocol b)"))
        if any(r['phase'] == 'long' for r in self.all):
            j = self.judge(L, 'sliding', 'long')
            ranked = self.ranking('sliding', L, 'long')
            good = [l for l in ranked if j.get(l, ('',))[0] in ('best', 'as good')]
            open_ = [l for l in ranked if j.get(l, ('',))[0] == 'not known']
            ks = sorted({len(self.runs(l, 'long')) for l in j})
            rows.append(('(after 4× the steps)', names(good),
                         '; '.join(f"`{l}` {b(l, L, 'sliding', 'long')}" for l in good + open_) + f' at {L} (b), among '
                         f"{len(j)} labels of the long phase, {'–'.join(map(str, (ks[0], ks[-1])[:len(set(ks))]))} "
                         f"seed{'s' * (ks[-1] != 1)} each"
                         + (f"; the rule tells neither *as good* nor *worse* ("
                            + ('one seed, or an interval too wide' if ks[0] < 2 else 'an interval too wide') + f") for {names(open_)}"
                            if open_ else '')))
        n = sorted({len(self.runs(l)) for l in self.labels})
        seeds = f"{n[0]} seed{'s' * (n[0] != 1)}" if len(n) == 1 else f"{n[0]}–{n[-1]} seeds"
        # the rows of the long phase have fewer seeds than the main phase's: the header says what each mean is over
        head = (f'| if you need | use | evidence (bits per byte, lower is better; mean over the seeds stored, {seeds} per label '
                f'in the main phase; (a) every byte in '
                f'consecutive windows, (b) sliding window) |\n|---|---|---|\n')
        rule = ("\n\n*Rule:* a row lists the best label (lowest mean among labels with 2 or more seeds) and every label whose "
                f"paired difference with it, seed by seed, has a 95% t-interval inside ±{EQUIVALENCE_MARGIN:g} bits per byte; "
                "an interval that holds 0 but reaches further, or fewer than 2 seeds, give *not known*.")
        return head + '\n'.join(f'| {a} | {u} | {e} |' for a, u, e in rows) + rule

VERDICT_RULE = ("*Rule:* at {length} ({multiple}× the training length), {protocol}: of the labels with 2 or more seeds, the "
                "one of lowest mean is *best*; "
                "every other label's difference with it is taken seed by seed (the same batches and, for runs that record "
                "`init`, the same initial weights of the shared parameters); the 95% t-interval of the mean difference "
                f"lying above 0 gives *worse*, inside ±{EQUIVALENCE_MARGIN:g} bits per byte *as good* (a difference that "
                "small counts as none); otherwise, and with fewer than 2 seeds or paired seeds, *not known*.")

CLAIM_RULE = ("*Rule:* a check sums bits per byte (protocol b) seed by seed over the seeds its labels share, e.g. `fox` "
              "at 8× minus `rotary` at 8×. Its 95% t-interval below 0 is *lower*, above 0 *higher*, inside "
              f"±{EQUIVALENCE_MARGIN:g} a *tie*; otherwise, or with fewer than 2 seeds: *not known*. A tie agrees with 'no rise' and leaves 'lower than' *not shown*. A claim *agrees* when every "
              "check does, *partly* when some do, *disagrees* when none does and one is the opposite, *not shown* when "
              "every check ties; otherwise *not known*.")

def _rise(label, mult):
    return (f"`{label}` {mult}× − 1×", [(label, mult, 1), (label, 1, -1)], {'lower', 'tie'})

def _below(a, b, mult):
    return (f"`{a}` − `{b}` at {mult}×", [(a, mult, 1), (b, mult, -1)], {'lower'})

def _rises_less(a, b, mult):
    return (f"rise 1×→{mult}×, `{a}` − `{b}`", [(a, mult, 1), (a, 1, -1), (b, mult, -1), (b, 1, 1)], {'lower'})

def _inside(m, half): return -EQUIVALENCE_MARGIN <= m - half and m + half <= EQUIVALENCE_MARGIN

def _verdict(m, half) -> str:
    "A label's verdict from its paired difference with the best: mean `m`, half-width `half` of the 95% interval."
    return 'worse' if m - half > 0 else 'as good' if _inside(m, half) else 'not known'

def _fmt(x, spec='.3f'): return '–' if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)

def _why_alibi(R):
    L = R.long
    others = [l for l in ('xl_paper', 'fourier') if R.runs(l) and R.mean(l, L) < R.mean('alibi', L)]
    if not R.runs('alibi'): return ''
    out = (f"attention entropy at 1×: `alibi` {_fmt(R.attention('alibi', R.seq, 'entropy'), '.1f')} bits" +
           ''.join(f", `{l}` {_fmt(R.attention(l, R.seq, 'entropy'), '.1f')}" for l in others) +
           f"; `alibi` reads {_fmt(R.mean('alibi', R.seq))} at 1×")
    if others: out += '; lower at 8×, and not in the paper: ' + ', '.join(f"`{l}` {_fmt(R.mean(l, L))}" for l in others)
    return out

def _fire_bias(R, label):
    r = next((r for r in R.runs(label) if r.get('fire_bias')), None)
    return r['fire_bias'] if r else None

def _why_fire(R):
    fb, out = _fire_bias(R, 'fire'), []
    if fb:
        t = statistics.mean(fb['threshold'])
        # distance 8 read by the last query of a window of 8T gets the bias training gave distance d at the last trained query
        psi = lambda x, c: math.log(abs(c * x) + 1)
        at = [(math.exp(psi(8, c) * psi(max(R.seq - 1, tt), c) / psi(max(R.long - 1, tt), c)) - 1) / c
              for c, tt in zip(fb['c'], fb['threshold'])]
        out.append(f"learned threshold L {t:.0f} (seed 0, mean of layers), below T = {R.seq}: the normaliser acts in training; "
                   f"at 8× distance 8 gets the bias training gave distance {statistics.mean(at):.1f}")
    if R.runs('fire+L512'): out.append(f"with L = 512 (`fire+L512`): {_fmt(R.mean('fire+L512', R.long))} at 8×")
    return '; '.join(out)

def _why_fox(R):
    if not R.runs('fox'): return ''
    return (f"attention mass at distance ≥ T at 8×: `fox` {_fmt(R.attention('fox', R.long), '.2f')}, "
            f"`rotary` {_fmt(R.attention('rotary', R.long), '.2f')} (uniform {1 - R.seq / R.long:.3f})")

def _why_xpos(R):
    if not R.runs('xpos'): return ''
    return (f"read here in one pass, without the blockwise causal attention the paper reads long inputs with; mass at "
            f"distance ≥ T at 8×: `xpos` {_fmt(R.attention('xpos', R.long), '.2f')}, `rotary` {_fmt(R.attention('rotary', R.long), '.2f')}")

def _why_kerple(R):
    if not R.runs('kerple'): return ''
    return (f"mass at distance ≥ T at 8×: `kerple` {_fmt(R.attention('kerple', R.long), '.2f')}, "
            f"`alibi` {_fmt(R.attention('alibi', R.long), '.2f')}")

def _why_cope(R):
    if not R.runs('cope'): return ''
    return f"`cope` at 1×: {_fmt(R.mean('cope', R.seq))}; at 8×: {_fmt(R.mean('cope', R.long))}"

def _why_yarn(R):
    r = next((r for r in R.runs('rotary') if r.get('finetune')), None)
    ft = r['finetune'].get('rotary+yarn+ft') if r else None
    return (f"fine-tune here: {ft['steps']} steps at {ft['length']} bytes" if ft else '') + \
           f"; dynamic NTK raises its base with the length read, YaRN keeps factor {FT_MULTIPLE} after its fine-tune"

def _why_nope(R):
    if not R.runs('none'): return ''
    return (f"`none` reads {_fmt(R.mean('none', R.seq))} at 1× (`rotary` {_fmt(R.mean('rotary', R.seq))}): it learned little "
            f"use of context; its mass at distance ≥ T at 8× is {_fmt(R.attention('none', R.long), '.2f')}, uniform would be "
            f"{1 - R.seq / R.long:.3f}")

# Each paper's claim about reading past the training length, as the paper states it; the checks test it on the stored
# runs at this study's scale (0.66 M parameters, 300 steps, bytes, T = 128), the `why` reads what the runs show about the gap.
PAPER_CLAIMS = [
    dict(paper='ALiBi (Press et al. 2022)', claim='trained short, read longer, it does not degrade, and beats rotary and T5 there',
         checks=[_rise('alibi', 8), _below('alibi', 'rotary', 8), _below('alibi', 't5', 8)],
         setting='WikiText-103, 247 M parameters, trained at 512 tokens or more', why=_why_alibi),
    dict(paper='KERPLE (Chi et al. 2022)', claim='the log kernel extrapolates: no rise beyond the training length, below ALiBi there',
         checks=[_rise('kerple', 8), _below('kerple', 'alibi', 8)],
         setting='three language-modelling sets, trained at 512 tokens', why=_why_kerple),
    dict(paper='xPos (Sun et al. 2022)', claim='extrapolates where rotary does not',
         checks=[_below('xpos', 'rotary', 2), _below('xpos', 'rotary', 4), _below('xpos', 'rotary', 8)],
         setting='trained at 1024 tokens, read at up to 4×', why=_why_xpos),
    dict(paper='FIRE (Li et al. 2024)', claim='extrapolates better than ALiBi, KERPLE, T5 and rotary',
         checks=[_below('fire', 'alibi', 8), _below('fire', 'kerple', 8), _below('fire', 't5', 8), _below('fire', 'rotary', 8)],
         setting='C4, trained at 2048 tokens with L = 512', why=_why_fire),
    dict(paper='FoX (Lin et al. 2025)', claim='extrapolates better than the rotary Transformer, with no position embedding',
         checks=[_rise('fox', 8), _below('fox', 'rotary', 8)],
         setting='hundreds of millions of parameters, billions of tokens', why=_why_fox),
    dict(paper='CoPE (Golovneva et al. 2024)', claim='lower perplexity than token positions in language modelling',
         checks=[_below('cope', 'absolute', 1), _below('cope', 'shaw', 1), _below('cope', 'rotary', 1)],
         setting='WikiText-103 and code, and counting tasks', why=_why_cope),
    dict(paper='YaRN (Peng et al. 2023)', claim='YaRN extends rotary better than dynamic NTK and linear interpolation, '
         'with and without a short fine-tune',
         checks=[_below('rotary+yarn', 'rotary+dynamic', 8), _below('rotary+yarn', 'rotary+linear', 8),
                 _below('rotary+yarn+ft', 'rotary+dynamic+ft', FT_MULTIPLE), _below('rotary+yarn+ft', 'rotary+dynamic+ft', 8)],
         setting='Llama 2 7B and 13B, fine-tuned for hundreds of steps', why=_why_yarn),
    dict(paper='NoPE (Kazemnejad et al. 2023)', claim='a decoder without positions length-generalises better than one with them',
         checks=[_rises_less('none', 'rotary', 8), _below('none', 'rotary', 8)],
         setting='synthetic reasoning and copying tasks', why=_why_nope),
]

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086)

def t975(df:int) -> float:
    "Student's t quantile 0.975 for `df` degrees of freedom (1..20 tabulated; beyond, 1.96 + 2.4/df)."
    if df < 1: raise ValueError(f"df must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df

def _all_derived() -> set: return {d for l in settings() for d in derived_labels(l)}

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--phase', choices=PHASES, default='main')
    ap.add_argument('--list', action='store_true', help="print the phase's runs and which are stored")
    ap.add_argument('--smoke', action='store_true', help='tiny models, a few steps (needs --out)')
    ap.add_argument('--workers', type=int, default=2)
    ap.add_argument('--seeds', type=int, default=None, help='default: main 3, long 2, timing 2')
    ap.add_argument('--steps', type=int, default=None, help=f"main phase's steps (default {COMMON['steps']}; long: 4x)")
    ap.add_argument('--labels', nargs='*', default=None, help='only these labels (default: every label of the phase)')
    ap.add_argument('--out', default=None, help='directory of the stored runs (default nbs/data/study)')
    ap.add_argument('--repeats', type=int, default=5, help='timing phase: rounds (default 5)')
    ap.add_argument('--device', default='cpu', help="where the runs train: 'cpu' (default) or 'cuda'; stored in each run")
    a = ap.parse_args(argv)
    _device(a.device)
    out = Path(a.out or RESULTS)
    if a.smoke and not a.out: sys.exit('--smoke needs --out (a smoke run is never stored with the real study)')
    common = SMOKE if a.smoke else COMMON
    if a.phase == 'timing':   # one process, one thread, every label interleaved: CPU time of a training step
        if a.device != 'cpu': sys.exit('--phase timing measures CPU time: use --device cpu')
        r = cpu_timing(a.labels, a.repeats, common=common)
        write_json(out / CPUTIME_FILE, r, indent=1)
        R = StudyResults([]); R.timing = r
        print('\n'.join(f"{l}: {R.ratio_text(l)}" for l in r['seconds']), flush=True)
        return
    labels = a.labels
    if a.phase == 'long' and labels is None:
        labels = long_labels(StudyResults.load(out))
    runs = [dict(r, device=a.device) for r in all_runs(a.phase, a.seeds, labels, common, a.steps)]
    todo = [dict(r, out_dir=str(out)) for r in runs if not stored_run(a.phase, r, out)]
    if a.list:
        have = {(r['label'], r['seed']) for r in runs} - {(r['label'], r['seed']) for r in todo}
        for r in runs: print(('stored ' if (r['label'], r['seed']) in have else 'todo   ') + f"{a.phase} {r['label']} seed {r['seed']}")
        return
    recipe = out / 'recipe.json'
    if not a.smoke and not recipe.exists(): write_json(recipe, data_recipe(), indent=1)
    print(f"{a.phase}: {len(runs) - len(todo)} of {len(runs)} runs stored; running {len(todo)}", flush=True)
    t0 = time.time()
    results = run_pool(_worker, todo, a.workers)
    print(f"{a.phase}: {len(todo)} runs in {time.time() - t0:.0f} s", flush=True)
    failed = [f"{r['label']} seed {r['seed']}: {r['error']}" for r in results if 'error' in r]
    if failed: sys.exit("failed runs (not stored; rerun to retry):\n" + '\n'.join(failed))

if __name__ == '__main__': main()

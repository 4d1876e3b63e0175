"""The studies train through `relpos.train.fit`: one training code path in the repository.

The stored runs of the studies (nbs/data/study, nbs/data/retrieval, nbs/data/memorizing_study) were trained by each
script's own loop. Those loops are kept below, verbatim from the scripts before they moved onto `relpos.train`
(`_old_*`, with the new functions' signatures), and every test here trains the same model with the old loop and with
the new path and asks for the same losses at every step and the same final weights, bit for bit (float32, CPU, one
thread): a plain label, a label with XL memory carried across steps, the fine-tune (its batches start mid-stream),
the retrieval tasks (answers-only loss, a prompt read in two segments), and the memorizing study with and without kNN
memory, its gate loss, and documents starting mid-run. The last tests run whole smoke-size runs of each script both
ways (the old loop patched in) and compare everything the run stores but its timings.
"""
import copy, math
import pytest
import torch
import torch.nn.functional as F

import bench.study as S
import bench.retrieval as RT
import bench.memorizing_study as M


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------ the old loops (bench/*.py at acb4e4d), verbatim
# but for their clocks: each step records a duration of 0 (no test compares times; timings belong in `make bench`)
def _old_lr_at(step, steps, lr, warmup):
    if step < warmup: return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

def _old_study_train(model, train, steps, batch, seq, lr, warmup, memory_len=0, step0=0, curve=None, eval_fn=None, eval_every=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, times, memory = [], [], None
    for step in range(steps):
        x, y = S.stream_batch(train, step0 + step, batch, seq)
        for g in opt.param_groups: g['lr'] = _old_lr_at(step, steps, lr, warmup)
        logits, memory = model(x, memory) if memory_len else model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(0.0)
        losses.append(loss.item() / math.log(2))
        if eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps): curve.append((step + 1, eval_fn()))
    return losses, times

def _old_retrieval_train(model, steps, batch, length, lr, warmup, seed, segment=0, device='cpu'):
    dev = device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    losses, acc = [], []
    for step in range(steps):
        x, y, ans = (t.to(dev) for t in RT.train_batch(step, batch, length, seed))
        for g in opt.param_groups: g['lr'] = _old_lr_at(step, steps, lr, warmup)
        if segment:
            memory, outs = None, []
            for a in range(0, length, segment):
                logits, memory = model(x[:, a:a + segment], memory)
                outs.append(logits)
            logits = torch.cat(outs, 1)
        else: logits = model(x)[0]
        loss = F.cross_entropy(logits[ans], y[ans])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item()); acc.append((logits[ans].argmax(-1) == y[ans]).float().mean().item())
    return losses, acc

def _old_memorizing_train(model, stream, steps, lr, warmup, gate_loss=False, stateful=True, eval_fn=None, eval_every=0):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    memory, times, cpu, train_bits, curve = None, [], [], [], []
    for step in range(steps):
        x, y, start = stream.next()
        for g in opt.param_groups: g['lr'] = _old_lr_at(step, steps, lr, warmup)
        logits, memory = model(x, memory, doc_start=start) if stateful else model(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), ignore_index=M.IGNORE)
        aux = model.get_loss_component() if model.memorizing_layers else None   # taken every step, added only if asked
        total = loss + aux if gate_loss and aux is not None else loss
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(0.0); cpu.append(0.0)
        train_bits.append(loss.item() / math.log(2))
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            e = eval_fn()
            curve.append((step + 1, e['bits'] / e['bytes']))
    return train_bits, times, cpu, curve


# ------------------------------------------------------------------ helpers
def _weights_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    bad = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not bad, f"weights differ after training: {bad[:5]}"

def _same(a, b) -> bool:
    "Equal to the bit, through dicts, lists and tensors."
    if torch.is_tensor(a): return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)): return type(a) == type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b

def _both(build, old, new):
    "Train two copies of `build()`'s model, one by `old(model)`, one by `new(model)`, from the same RNG state."
    a = build(); b = copy.deepcopy(a)
    torch.manual_seed(1); out_old = old(a)
    torch.manual_seed(1); out_new = new(b)
    return a, b, out_old, out_new

def _study_model(method, mem_len=0, seed=0, seq=16, nope=()):
    def build():
        torch.manual_seed(seed)
        m = S.build_model(method, seq, 32, 2, 3, mem_len, nope)
        S.pair_init(m, seed, 32, 2, 3, seq)
        return m
    return build

STUDY_TEXT = torch.frombuffer(bytearray(S.study_text('train')[:20_000]), dtype=torch.uint8).long()


# ------------------------------------------------------------------ bench.study
@pytest.mark.parametrize('method,mem_len', [('none', 0), ('rotary', 0), ('xl', 16), ('alibi', 16)],
                         ids=['plain none', 'plain rotary', 'xl+memory', 'alibi+memory'])
def test_study_trains_bit_for_bit_as_its_old_loop(method, mem_len):
    "The study's `_train` (SMOKE sizes, 6 steps) gives the old loop's losses at every step, its curve and its weights."
    ev = lambda m: (lambda: sum(p.double().sum().item() for p in m.parameters()))   # reads the weights at each eval step
    kw = dict(steps=6, batch=4, seq=16, lr=2e-3, warmup=2, memory_len=mem_len, eval_every=2)
    def run(fn):
        def go(m):
            curve = []
            losses, _ = fn(m, STUDY_TEXT, curve=curve, eval_fn=ev(m), **kw)
            return losses, curve
        return go
    a, b, (lo, co), (ln, cn) = _both(_study_model(method, mem_len), run(_old_study_train), run(S._train))
    assert ln == lo and cn == co and len(co) == 3
    _weights_equal(a, b)

def test_study_fine_tune_continues_the_stream_bit_for_bit():
    "The fine-tune's call (batches from `step0`, a tenth of the learning rate, longer segments) as the old loop."
    kw = dict(steps=3, batch=2, seq=32, lr=2e-4, warmup=1, step0=6)
    build = _study_model('rotary', seq=16)
    a, b, (lo, _), (ln, _) = _both(build, lambda m: _old_study_train(m, STUDY_TEXT, **kw), lambda m: S._train(m, STUDY_TEXT, **kw))
    assert ln == lo
    _weights_equal(a, b)

def test_study_schedule_is_the_old_one_to_the_bit():
    for steps, warmup in ((300, 30), (1200, 120), (4, 2), (30, 3), (7, 1)):
        assert [S.lr_at(s, steps, 2e-3, warmup) for s in range(steps)] == [_old_lr_at(s, steps, 2e-3, warmup) for s in range(steps)]


# ------------------------------------------------------------------ bench.retrieval
@pytest.mark.parametrize('method,mem_len', [('rotary', 0), ('xl', 32)], ids=['plain', 'memory: two segments'])
def test_retrieval_trains_bit_for_bit_as_its_old_loop(method, mem_len):
    "Retrieval's `_train` (answers-only loss; with memory each prompt read as two segments) as the old loop."
    seq = 32
    def build():
        torch.manual_seed(0)
        m = S.build_model(method, seq, 32, 2, 2, mem_len)
        S.pair_init(m, 0, 32, 2, 2, seq)
        return m
    length, segment = (2 * seq, seq) if mem_len else (seq, 0)
    args = (5, 4, length, 2e-3, 2, 0, segment)
    a, b, old, new = _both(build, lambda m: _old_retrieval_train(m, *args), lambda m: RT._train(m, *args))
    assert new == old and len(new[0]) == 5
    _weights_equal(a, b)


# ------------------------------------------------------------------ bench.memorizing_study
def _docs():
    g = torch.Generator().manual_seed(0)
    return [bytes(torch.randint(97, 123, (n,), generator=g).tolist()) for n in (70, 40, 100, 55, 33)]

@pytest.mark.parametrize('setting,gate_loss', [
    (dict(), True), (dict(mem_len=16), False), (dict(knn_mult=4, knn_layer=1, top_k=4), False),
    (dict(knn_mult=4, knn_layer=1, top_k=4), True), (dict(knn_mult=4, knn_layer=1, top_k=4, mem_len=16), True)],
    ids=['none', 'xl', 'knn', 'knn gate loss', 'knn + xl'])
def test_memorizing_study_trains_bit_for_bit_as_its_old_loop(setting, gate_loss):
    "The memorizing study's `_train` on documents that start mid-run (XL and kNN memories emptied per row) as the old loop."
    seq, docs = 16, _docs()
    def build():
        torch.manual_seed(0)
        m = M.build_model(seq, 16, 2, 2, 'xl_paper', **setting)
        M.pair_init(m, 0, seq, 16, 2, 2, 'xl_paper')
        return m
    stateful = bool(setting.get('knn_mult') or setting.get('mem_len'))
    def run(fn):
        def go(m):
            stream = M.DocStream(docs, 2, seq, data_seed=0)
            ev = lambda: M.evaluate(m, docs[:2], seq, 32)   # as many rows as training: the kNN memories keep their batch
            bits, _, _, curve = fn(m, stream, 8, 1e-2, 2, gate_loss, stateful, ev, 3)
            return bits, curve, m.knn_memory_state_dict()
        return go
    a, b, (lo, co, ko), (ln, cn, kn) = _both(build, run(_old_memorizing_train), run(M._train))
    assert ln == lo and cn == co and len(co) == 2
    assert _same(ko, kn)   # the kNN memories hold the same keys and values
    _weights_equal(a, b)


# ------------------------------------------------------------------ whole runs, both ways
def _strip(r):
    "A run file without what depends on the clock."
    drop = {'step_time', 'step_times_mean', 'step_cpu', 'step_cpu_mean', 'train_seconds', 'train_cpu_seconds',
            'eval_seconds', 'seconds', 'peak_bytes', 'date'}
    out = {k: v for k, v in r.items() if k not in drop}
    if 'finetune' in out: out['finetune'] = {k: {a: b for a, b in v.items() if a != 'seconds'} for k, v in out['finetune'].items()}
    return out

def test_study_smoke_runs_store_what_the_old_loop_stored(monkeypatch):
    "`train_run` at the study's SMOKE sizes, rotary (its scalings and fine-tunes) and xl+memory: the same run file."
    smoke = {k: v for k, v in S.SMOKE.items()}
    for label, kw in (('rotary', dict(method='rotary', rope_variants=True)), ('xl+memory', dict(method='xl', mem_len=16))):
        new = S.train_run(label, seed=0, **kw, **smoke)
        with monkeypatch.context() as mp:
            mp.setattr(S, '_train', _old_study_train)
            old = S.train_run(label, seed=0, **kw, **smoke)
        assert _strip(new) == _strip(old), label

def test_retrieval_smoke_runs_store_what_the_old_loop_stored(monkeypatch):
    for label, kw in (('none', dict(method='none')), ('xl+memory', dict(method='xl', mem_len=32))):
        new = RT.train_run(label, seed=0, **kw, **RT.SMOKE)
        with monkeypatch.context() as mp:
            mp.setattr(RT, '_train', _old_retrieval_train)
            old = RT.train_run(label, seed=0, **kw, **RT.SMOKE)
        assert _strip(new) == _strip(old), label

def test_memorizing_study_smoke_run_stores_what_the_old_loop_stored(monkeypatch):
    tiny = dict(steps=4, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=1e-2, warmup=1,
                eval_docs=2, eval_bytes=64, eval_every=2, label='knn 4x + xl', seed=0, knn_mult=4, knn_layer=1, top_k=4,
                mem_len=16, gate_loss=True)
    new = M.train_run(**tiny)
    with monkeypatch.context() as mp:
        mp.setattr(M, '_train', _old_memorizing_train)
        old = M.train_run(**tiny)
    assert _strip(new) == _strip(old)

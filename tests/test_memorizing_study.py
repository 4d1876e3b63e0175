"""The Memorizing Transformer study on long documents (bench/memorizing_study.py) and what it relies on:
`doc_start` drops a row's Transformer-XL memory as well as its kNN memory; memories never cross documents;
the no-memory score is the ordinary model's; the corpus, its split and its checksums are deterministic."""
import copy, hashlib, json, math, subprocess, sys
import pytest
import torch
import torch.nn.functional as F
from relpos.models import DecoderLM, POSITIONS, KNN_LOCAL_POSITIONS
import bench.memorizing_study as S

V = 13


def _lm(position='xl_paper', seed=0, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(d_model=16, heads=2, n_layers=2, max_len=8, mem_len=8), **kw)
    # FIRE: DecoderLM's default threshold L is a quarter of max_len + mem_len, 4 here, below the positions a segment
    # after the memory reaches (8..15): a restarted row must count its positions from its own document's start
    lm = DecoderLM(V, position=position, **kw).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():   # perturb every parameter: zero-initialised tables and biases make checks vacuous
        for p in lm.parameters(): p.add_(0.3 * torch.randn(p.shape, generator=g))
    return lm


@pytest.mark.parametrize('position', [p for p in POSITIONS if p != 'absolute'])
@pytest.mark.parametrize('knn', [False, True])
def test_doc_start_drops_the_xl_memory_of_that_row_only(position, knn):
    "A row flagged in doc_start gives the logits of a fresh call (no memory); the other rows are unchanged."
    if knn and position not in KNN_LOCAL_POSITIONS: pytest.skip(f'{position} cannot be the local side of a kNN layer')
    lm = _lm(position, **(dict(memorizing_layers=(1,), knn_capacity=32, top_k=4) if knn else {}))
    g = torch.Generator().manual_seed(2)
    first, x = torch.randint(0, V, (3, 8), generator=g), torch.randint(0, V, (3, 8), generator=g)
    flags = torch.tensor([False, True, False])
    with torch.no_grad():
        _, memory = lm(first, doc_start=torch.ones(3, dtype=torch.bool))
        kept, fresh = copy.deepcopy(lm), copy.deepcopy(lm)
        got, new_memory = lm(x, memory, doc_start=flags)
        want_kept, _ = kept(x, memory)                                    # nothing starts: memory attended
        if knn: fresh.release_knn_memory()
        want_new, want_mem = fresh(x[1:2], doc_start=torch.tensor([True]))  # a fresh call, row 1 alone
    torch.testing.assert_close(got[[0, 2]], want_kept[[0, 2]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:2], want_new, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[1], want_kept[1], atol=1e-3)            # the memory did matter
    for a, b in zip(new_memory, want_mem):                                # the next memory is this segment's only
        torch.testing.assert_close(a[1:2], b)


@pytest.mark.parametrize('position', [p for p in POSITIONS if p != 'absolute'])
@pytest.mark.parametrize('knn', [False, True])
def test_doc_start_row_equals_a_fresh_call_float64(position, knn):
    """In float64 to 1e-10, after an XL memory: a restarted row gives a fresh call's logits and the other rows the
    continued call's. FIRE's L (4) is below the queries' stream positions (8..15) but not below the row's own (0..7)."""
    if knn and position not in KNN_LOCAL_POSITIONS: pytest.skip(f'{position} cannot be the local side of a kNN layer')
    lm = _lm(position, **(dict(memorizing_layers=(1,), knn_capacity=32, top_k=4) if knn else {})).double()
    if position == 'fire':
        fires = [f for f in lm.modules() if type(f).__name__ == 'FireMultiHeadAttention']
        assert len(fires) == 2 and all(f.positions.threshold.item() < 8 for f in fires)
    g = torch.Generator().manual_seed(3)
    first, x = torch.randint(0, V, (3, 8), generator=g), torch.randint(0, V, (3, 8), generator=g)
    flags = torch.tensor([True, False, True])
    with torch.no_grad():
        _, memory = lm(first, doc_start=torch.ones(3, dtype=torch.bool))
        kept, fresh = copy.deepcopy(lm), copy.deepcopy(lm)
        got, _ = lm(x, memory, doc_start=flags)
        want_kept, _ = kept(x, memory)
        if knn: fresh.release_knn_memory()
        want_new, _ = fresh(x[flags], doc_start=torch.ones(2, dtype=torch.bool))
    assert (got[flags] - want_new).abs().max() <= 1e-10, position
    assert (got[~flags] - want_kept[~flags]).abs().max() <= 1e-10, position


@pytest.mark.parametrize('position', POSITIONS)
def test_doc_start_with_the_kv_cache_equals_a_fresh_call_float64(position):
    "The K/V cache: a row reset by doc_start counts its positions from 0 again; float64 to 1e-10 against a fresh call."
    lm = _lm(position, mem_len=0, max_len=16).double()
    g = torch.Generator().manual_seed(4)
    first, x = torch.randint(0, V, (3, 8), generator=g), torch.randint(0, V, (3, 6), generator=g)
    flags = torch.tensor([False, True, False])
    with torch.no_grad():
        cache = lm.new_cache(3, 16)
        lm(first, cache=cache)
        got = torch.cat([lm(x[:, :4], cache=cache, doc_start=flags)[0]] + [lm(x[:, t:t + 1], cache=cache)[0] for t in (4, 5)], 1)
        want_new, _ = lm(x[1:2])
        want_kept, _ = lm(torch.cat([first, x], 1))
    assert (got[1:2] - want_new).abs().max() <= 1e-10, position
    assert (got[[0, 2]] - want_kept[[0, 2], 8:]).abs().max() <= 1e-10, position


def test_doc_start_every_row_drops_the_whole_memory_and_longer_memory_is_refused():
    lm = _lm('xl', mem_len=16)
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, memory = lm(x)
        _, memory = lm(x, memory)
        got, mem = lm(x, memory, doc_start=torch.ones(2, dtype=torch.bool))
        want, want_mem = lm(x)
    torch.testing.assert_close(got, want)
    assert [t.shape for t in mem] == [t.shape for t in want_mem]
    # mem_len 16 > seq_len 8: the returned memory would keep 8 positions of the old document in row 0: refused
    before = [t.clone() for t in memory]
    with pytest.raises(ValueError, match='mem_len=16 > tokens seq_len=8'):
        lm(x, memory, doc_start=torch.tensor([True, False]))
    assert all(torch.equal(a, b) for a, b in zip(before, memory))


def test_generate_doc_start_equals_a_fresh_model():
    "generate keeps no XL memory between calls: a row that starts a document sees only its prompt (kNN emptied)."
    lm = _lm('xl_paper', memorizing_layers=(1,), knn_capacity=32, top_k=4, mem_len=8)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        lm(torch.randint(0, V, (2, 8), generator=g), doc_start=torch.ones(2, dtype=torch.bool))
    fresh = copy.deepcopy(lm); fresh.release_knn_memory()
    prompt = torch.randint(0, V, (2, 4), generator=g)
    out = lm.generate(prompt, 4, temperature=0, doc_start=torch.tensor([True, False]))
    want = fresh.generate(prompt[:1], 4, temperature=0, doc_start=torch.tensor([True]))
    assert torch.equal(out[:1], want)


# ---------------------------------------------------------------- the corpus
def _fake_stdlib(root, sizes):
    for i, n in enumerate(sizes):
        p = root / ('pkg' if i % 2 else '') / f'mod{i}.py'
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes((i * 7 + j) % 97 + 30 for j in range(n)))
    (root / 'site-packages').mkdir()
    (root / 'site-packages' / 'big.py').write_bytes(b'x' * 40000)   # never part of the corpus
    (root / 'notes.txt').write_bytes(b'y' * 40000)                   # nor anything but .py


def test_corpus_is_deterministic_checksummed_and_split_by_path(tmp_path):
    _fake_stdlib(tmp_path, [S.MIN_BYTES - 1, S.MIN_BYTES, 20000, 30000, 17000, 50000] + [S.MIN_BYTES + i for i in range(40)])
    a, b = S.build_manifest(tmp_path), S.build_manifest(tmp_path)
    assert a == b
    paths = [f[0] for f in a['files']]
    assert paths == sorted(paths) and 'mod0.py' not in paths and len(paths) == 45
    assert not any('site-packages' in p for p in paths)
    assert all(f[2] == hashlib.sha256((tmp_path / f[0]).read_bytes()).hexdigest() for f in a['files'])
    assert {f[3] for f in a['files']} == {'train', 'val'}                # both splits occur
    assert all(S.split_of(f[0]) == f[3] for f in a['files'])            # the split is a function of the path alone
    corpus = S.load_corpus(tmp_path, a)
    for split in ('train', 'val'):   # the documents, in manifest order, are the files' bytes
        assert corpus[split] == [(tmp_path / f[0]).read_bytes() for f in a['files'] if f[3] == split]
    # another interpreter's stdlib: one file changed, one added: detected, reported, and loading refuses
    (tmp_path / 'mod2.py').write_bytes(b'z' * 20000)
    (tmp_path / 'new.py').write_bytes(b'w' * 20000)
    diff = S.compare_manifests(a, S.build_manifest(tmp_path))
    assert any('differ in content' in d for d in diff) and any('not in the stored list' in d for d in diff)
    with pytest.raises(ValueError, match='mod2.py'): S.load_corpus(tmp_path, a)


def test_stored_corpus_matches_this_python_or_says_why():
    stored = S.stored_manifest()
    here = S.build_manifest()
    diff = S.compare_manifests(stored, here)
    if stored['python'] == here['python'] and stored['implementation'] == here['implementation'] and not diff:
        assert stored['sha256'] == here['sha256']
    else:
        assert diff, 'another Python gives another corpus: compare_manifests must say so'


# ---------------------------------------------------------------- reading documents
def test_doc_stream_rows_read_whole_documents():
    "Each row reads whole documents in order, one segment per step; doc_start marks exactly each document's first segment."
    docs = [bytes(range(10 + 3 * i, 10 + 3 * i + n)) for i, n in enumerate([21, 9, 40, 17, 33])]
    stream = S.DocStream(docs, batch=2, seq=8)
    rows = [[] for _ in range(2)]
    for _ in range(30):
        x, y, start = stream.next()
        for r in range(2):
            if start[r]: rows[r].append([])
            rows[r][-1].append((x[r], y[r]))
    seen = []
    for r in range(2):
        for doc in rows[r][:-1]:                               # every finished document of the row
            xs, ys = torch.cat([s[0] for s in doc]), torch.cat([s[1] for s in doc])
            keep = ys != S.IGNORE
            text = bytes(xs[keep].tolist()[:1] + ys[keep].tolist())
            assert text in docs                                  # exactly one document: never two in a segment run
            assert len(xs) == -(-(len(text) - 1) // 8) * 8       # padding only in the last segment
            seen.append(docs.index(text))
    assert stream.order == torch.randperm(5, generator=torch.Generator().manual_seed(0)).tolist()
    assert set(seen) == set(range(5))


def _knn_xl(seed=0):
    return _lm('xl_paper', seed=seed, memorizing_layers=(1,), knn_capacity=64, top_k=4)


def test_memory_is_reset_per_document():
    "Two documents in one row do not see each other's memory: the second reads as it would in a fresh model."
    a, b = bytes(range(40, 40 + 30)), bytes(range(60, 60 + 26))
    docs = [bytes(v % V for v in d) for d in (a, b)]
    lm = _knn_xl()
    fresh = copy.deepcopy(lm)
    stream = S.DocStream(docs, batch=1, seq=8)
    out, memory = [], None
    with torch.no_grad():
        for _ in range(8):   # 4 segments of the first document, 4 of the second
            x, _, start = stream.next()
            logits, memory = lm(x, memory, doc_start=start)
            out.append((bool(start[0]), x, logits))
        second = [i for i, (s, _, _) in enumerate(out) if s][1]
        memory = None
        for i in range(second, 8):
            x = out[i][1]
            want, memory = fresh(x, memory, doc_start=torch.tensor([i == second]))
            torch.testing.assert_close(out[i][2], want, rtol=1e-5, atol=1e-5)
    # and the first document did leave memory behind (the check above is not vacuous)
    lm2 = copy.deepcopy(fresh); lm2.release_knn_memory()
    with torch.no_grad():
        _, m = lm2(out[0][1], doc_start=torch.tensor([True]))
        leak, _ = lm2(out[second][1], m)
    assert not torch.allclose(leak, out[second][2], atol=1e-3)


def test_evaluate_without_memory_is_the_ordinary_models_score():
    "The no-memory setting's validation score: the sum over segments of the model's cross-entropy on each segment alone."
    lm = _lm('xl_paper', mem_len=0)
    docs = [bytes(v % V for v in range(i, i + n)) for i, n in ((3, 37), (5, 20), (1, 50))]
    got = S.evaluate(lm, docs, 8, max_bytes=40)
    bits, count = 0.0, 0
    with torch.no_grad():
        for d in docs:
            t = torch.tensor(list(d[:41]))
            for s in range(0, len(t) - 1, 8):
                x, y = t[s:min(s + 8, len(t) - 1)], t[s + 1:s + 9]
                logits, _ = lm(x[None])
                bits += F.cross_entropy(logits[0], y, reduction='sum').item() / math.log(2); count += len(y)
    assert got['bytes'] == count == sum(min(len(d), 41) - 1 for d in docs) == sum(got['bucket_bytes'])
    assert math.isclose(got['bits'], bits, rel_tol=1e-6)
    assert math.isclose(sum(got['bucket_bits']), got['bits'], rel_tol=1e-9)


def test_evaluate_rows_are_independent_documents():
    "With XL and kNN memory, scoring documents together equals scoring each alone (padding rows never leak)."
    lm = _knn_xl()
    docs = [bytes(v % V for v in range(i, i + n)) for i, n in ((3, 37), (5, 20))]
    both = S.evaluate(copy.deepcopy(lm), docs, 8, max_bytes=64)
    alone = [S.evaluate(copy.deepcopy(lm), [d], 8, max_bytes=64) for d in docs]
    assert both['bytes'] == sum(e['bytes'] for e in alone)
    assert math.isclose(both['bits'], sum(e['bits'] for e in alone), rel_tol=1e-5)


def test_a_run_at_toy_size_is_stored_and_skipped_when_rerun(tmp_path):
    "One study run end to end (tiny model, 3 steps): stored as one JSON file; the listing then counts it as stored."
    tiny = dict(steps=3, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=1e-3, warmup=1,
                eval_docs=2, eval_bytes=64)
    kw = dict(label='knn 16x + xl', seed=0, out_dir=str(tmp_path), knn_mult=4, knn_layer=1, top_k=4, mem_len=16, **tiny)
    r = S._worker(dict(kw))
    assert 'error' not in r and math.isfinite(r['bpb']) and r['eval']['bytes'] == 2 * 64
    assert r['setting'] == dict(knn_mult=4, knn_layer=1, top_k=4, mem_len=16) and len(r['train_bpb']) == 3
    stored = S.load_results(tmp_path)
    assert [(s['label'], s['seed'], s['bpb']) for s in stored] == [('knn 16x + xl', 0, r['bpb'])]
    assert (tmp_path / S.run_file('knn 16x + xl', 0).name).exists()


def _fake_run(label, seed, late_bpb, early_bpb=3.0, cpu=0.1):
    sizes = [511, 512, 1024, 2048, 4096, 8192, 1]
    bits = [early_bpb * n for n in sizes[:5]] + [late_bpb * sizes[5], 3.0]
    return dict(label=label, seed=seed, setting=S.settings().get(label, {}), bpb=0.0, step_cpu=cpu, step_time=2 * cpu,
                eval=dict(buckets=list(S.BUCKETS), bucket_bits=bits, bucket_bytes=sizes, bytes=sum(sizes)))


def test_results_reader_pairs_seeds_and_two_agreeing_seeds_are_not_a_verdict():
    runs = [_fake_run('none', 0, 2.0), _fake_run('none', 1, 2.2),
            _fake_run('knn 16x', 0, 1.9, cpu=0.3), _fake_run('knn 16x', 1, 2.15, cpu=0.3),   # -0.10, -0.05: same sign
            _fake_run('xl', 0, 2.1), _fake_run('xl', 1, 2.1),                                 # +0.1 and -0.1
            {'label': 'knn 1x', 'seed': 0, 'error': 'RuntimeError: x'}]                       # failed runs are ignored
    R = S.MemStudyResults(runs)
    assert R.labels == ['none', 'xl', 'knn 16x']
    assert math.isclose(R.gain('knn 16x', 'none', *S.LATE), -0.075)
    assert math.isclose(R.gain('xl', 'none', *S.LATE), 0.0, abs_tol=1e-12)
    # the old rule ("every seed agrees on the sign, |mean| >= 0.005") called knn 16x better: its 95% interval,
    # 12.706 * 0.0354 / sqrt 2 = 0.318, holds 0 and reaches past the margin
    m, half, n, paired = R.interval('knn 16x')
    assert n == 2 and not paired and math.isclose(half, 12.706 * 0.05 / 2, rel_tol=1e-6)
    assert R.paired_verdict('knn 16x') == 'not known' and R.paired_verdict('xl') == 'not known'
    assert R.paired_verdict('knn 64x') is None                                           # not run
    assert math.isclose(R.bpb('none', *S.EARLY)[0], 3.0) and math.isclose(R.cost('knn 16x'), 3.0)
    assert [b for b, _ in R.curve('none')] == [(0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 16384)]
    assert R.interval('knn 16x', early=S.EARLY)[:3] == R.interval('knn 16x')[:3]   # early bytes are 3.0 everywhere
    table = R.table()
    assert '| `knn 16x` | 2 |' in table and '-0.075 ± 0.318, not known' in table and '3.00×' in table
    assert table.endswith(R.rule()) and 'both seeds' not in table
    claims = dict((c, v) for c, v, _ in R.paper_ordering())
    assert claims['a kNN memory lowers bits per byte'] == 'not known'
    assert claims['memory + XL cache beats the XL cache alone'] is None                       # not run
    R1 = S.MemStudyResults([r for r in runs if r.get('seed') == 0])          # one seed: no verdict either way
    assert R1.paired_verdict('knn 16x') == 'not known' and R1.paired_verdict('none', 'knn 16x') == 'not known'
    assert '-0.100 bits per byte (1 seed), not known' in R1.interval_text('knn 16x')


def test_more_memory_claim_is_mixed_when_size_steps_disagree():
    runs = [_fake_run(l, s, v + 0.01 * s) for s in (0, 1)
            for l, v in (('none', 2.0), ('knn 1x', 2.1), ('knn 4x', 2.05), ('knn 16x', 2.2), ('knn 64x', 2.2))]
    R = S.MemStudyResults(runs)   # every difference the same in both seeds: intervals of width 0
    assert [R.paired_verdict(b, a) for a, b in (('knn 1x', 'knn 4x'), ('knn 4x', 'knn 16x'), ('knn 16x', 'knn 64x'))] \
        == ['better', 'worse', 'no difference']
    claims = {c: v for c, v, _ in R.paper_ordering()}
    assert claims['more memory lowers it more (1× → 4× → 16× → 64× the segment)'] == 'mixed'
    assert claims['a kNN memory lowers bits per byte'] == 'worse'
    runs = [r for r in runs if r['label'] != 'knn 4x'] + [_fake_run('knn 4x', s, 2.15 + 0.2 * s) for s in (0, 1)]
    claims = {c: v for c, v, _ in S.MemStudyResults(runs).paper_ordering()}   # 1x -> 4x now not known, 4x -> 16x too
    assert claims['more memory lowers it more (1× → 4× → 16× → 64× the segment)'] == 'not known'


def test_phases_have_their_own_files_and_readers():
    "Each budget's runs are stored under their phase and read back only by that phase's reader."
    assert S.run_file('knn 16x + xl', 1, 'long').name == 'long__knn_16x_plus_xl__seed1.json'
    assert S.run_file('none', 0, 'short').name != S.run_file('none', 0, 'long').name
    for phase, cfg in S.PHASES.items():
        runs = S.all_runs((0, 1), phase)
        assert len(runs) == 2 * len(S.settings(phase)) and {r['phase'] for r in runs} == {phase}
        assert all(r['steps'] == cfg['steps'] and r['d_model'] == cfg['d_model'] for r in runs)
    runs = [dict(_fake_run('none', 0, 2.0), phase='short'), dict(_fake_run('none', 0, 1.5), phase='long'),
            dict(_fake_run('knn 16x', 0, 1.4), phase='long', gate_local=[[0.75, 0.25]],
                 config={k: S.PHASES['long'][k] for k in ('seq', 'd_model', 'heads', 'n_layers', 'position')})]
    long, short = S.MemStudyResults(runs, 'long'), S.MemStudyResults(runs, 'short')
    assert long.labels == ['none', 'knn 16x'] and short.labels == ['none']
    assert math.isclose(long.run_bpb(long.runs('none')[0], *S.LATE), 1.5)
    assert math.isclose(long.memory_weight('knn 16x'), 0.5) and math.isnan(long.memory_weight('none'))
    # beside it, the same weight at initialisation: the model of that seed and setting built again
    c = S.PHASES['long']
    torch.manual_seed(0)
    gates = [a.gate.bias.detach() for a in S.build_model(c['seq'], c['d_model'], c['heads'], c['n_layers'], c['position'],
                                                          **S.settings('long')['knn 16x']).memorizing]
    at_init = float(torch.cat([1 - torch.sigmoid(g) for g in gates]).mean())
    assert f"| 0.50 ({at_init:.2f}) |" in long.table() and 'weight on memory: trained (at initialisation)' in long.table()
    assert 'weight on memory' not in short.table()


def test_every_stored_run_belongs_to_a_phase_and_its_file():
    "The stored results: each file is named by its phase, label and seed, with the phase's sizes."
    for p in sorted(S.RESULTS.glob('*.json')):
        r = json.loads(p.read_text())
        assert p.name == S.run_file(r['label'], r['seed'], r['phase']).name
        cfg, kw = S.PHASES[r['phase']], S.settings(r['phase'])[r['label']]
        assert {k: r['config'][k] for k in cfg} == {**cfg, **{k: v for k, v in kw.items() if k in cfg}}
        assert r['setting'] == {k: v for k, v in kw.items() if k not in cfg}


def test_gate_loss_is_trained_on_only_when_asked(tmp_path):
    "The gates' auxiliary loss changes training only with gate_loss=True; the run records which."
    tiny = dict(steps=3, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=1e-2, warmup=1,
                eval_docs=1, eval_bytes=32, label='knn 4x', seed=0, knn_mult=4, knn_layer=1, top_k=4)
    with_loss, without = S.train_run(**tiny, gate_loss=True), S.train_run(**tiny, gate_loss=False)
    assert with_loss['config']['gate_loss'] and not without['config']['gate_loss']
    assert with_loss['gate_local'] != without['gate_local'] and len(without['gate_local'][0]) == 2
    assert without['knn_memory'][0]['kind'] == 'KNNMemory' and without['knn_memory'][0]['capacity'] == 64
    assert 'knn 16x + gate loss' in S.settings('long') and 'knn 16x + gate loss' not in S.settings('short')


def test_short_answer_is_generated_from_the_runs():
    cfg = dict(steps=10, batch=2, seq=4, d_model=8)
    runs = [dict(_fake_run(l, s, v + 0.01 * s, cpu=c), config=cfg)
            for s in (0, 1) for l, v, c in (('none', 2.0, .1), ('xl', 1.9, .1), ('knn 16x', 2.1, .2), ('knn 16x + xl', 1.8, .3),
                                            ('knn 64x', 2.0, .3), ('knn 64x faiss', 2.0, .15))]
    text = S.MemStudyResults(runs).short_answer()
    assert '10 steps (80 training bytes' in text and '2 seeds per setting' in text
    assert '`knn 16x` − `none`: +0.100 ± 0.000 bits per byte (2 seeds), worse' in text
    assert 'of 5 settings with a memory: better: `xl`, `knn 16x + xl`; worse: `knn 16x`; no difference: `knn 64x`, `knn 64x faiss`.' in text and 'took 3.00×' in text and '1.50× with faiss' in text
    assert text.endswith(S.MemStudyResults(runs).rule()) and 'best setting' not in text
    assert S.MemStudyResults([]).short_answer().startswith('The study has not been run')


def test_initial_gates_are_rebuilt_from_the_run():
    "With lr 0 nothing moves: the gates a run recorded after training are the ones rebuilt for its initialisation."
    tiny = dict(steps=2, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=0.0, warmup=1,
                eval_docs=1, eval_bytes=32, label='knn 4x', seed=3, knn_mult=4, knn_layer=1, top_k=4)
    r = S.train_run(**tiny)
    assert S.initial_gate_local(r) == r['gate_local'] and len(r['gate_local'][0]) == 2
    R = S.MemStudyResults([dict(r, phase='long')], 'long')
    assert math.isclose(R.memory_weight('knn 4x', initial=True), R.memory_weight('knn 4x'))


# ---------------------------------------------------------------- paired initialisation, paired differences with an interval
def test_every_setting_of_a_seed_starts_from_the_same_shared_weights():
    "Before pairing a kNN layer's draws moved the weights built after it; `pair_init` gives every shared parameter `none`'s."
    size = dict(seq=16, d_model=16, heads=2, n_layers=4, position='xl_paper')
    def built(label, paired=True):
        torch.manual_seed(5)
        m = S.build_model(**size, **S.settings('long')[label])
        info = S.pair_init(m, 5, **size) if paired else None
        return m, info
    none = dict(built('none')[0].named_parameters())
    unpaired = dict(built('knn 16x', paired=False)[0].named_parameters())
    assert not torch.equal(unpaired['generator.weight'], none['generator.weight'])          # the audit's finding
    for label in ('xl', 'knn 1x', 'knn 16x + xl', f'knn 16x layer {S.OTHER_LAYER}', 'knn 16x top-128'):
        m, info = built(label)
        own = set(info['own'])
        assert own == {n for n, _ in m.named_parameters() if n.endswith(('.gate.bias', '.knn_log_scale'))}   # kNN's own only
        for n, p in m.named_parameters():
            if n not in own: assert torch.equal(p, none[n.replace('.module.local.', '.module.')]), (label, n)
        assert info['tensors'] == len(none)

def test_a_run_records_its_paired_initialisation():
    tiny = dict(steps=1, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=0.0, warmup=1,
                eval_docs=1, eval_bytes=32, seed=1)
    a = S.train_run(label='none', **tiny)
    b = S.train_run(label='knn 4x', knn_mult=4, knn_layer=1, top_k=4, **tiny)
    assert S.is_paired(a) and S.is_paired(b) and b['init']['paired_with'] == 'none'
    assert not S.is_paired({'label': 'none', 'seed': 0})                                      # stored before pairing: rerun
    assert S.SEEDS >= 4

def test_paired_verdicts_follow_the_interval_rule():
    late = {'none': (2.00, 2.10, 2.05, 2.20), 'knn 16x': (1.95, 2.06, 2.00, 2.14),      # -0.05, -0.04, -0.05, -0.06: better
            'xl': (2.05, 2.05, 2.10, 2.15),                                              # +0.05, -0.05, +0.05, -0.05: not known
            'knn 4x': (2.10, 2.21, 2.14, 2.31),                                          # +0.10, +0.11, +0.09, +0.11: worse
            'knn 1x': (2.002, 2.098, 2.051, 2.199)}                                      # +-0.002, +-0.001: no difference
    runs = [dict(_fake_run(l, s, v[s]), init={'paired_with': 'none'}) for l, v in late.items() for s in range(4)]
    runs.append(dict(_fake_run('knn 64x', 0, 1.0), init={'paired_with': 'none'}))        # one seed: not known
    R = S.MemStudyResults(runs)
    d = [a - b for a, b in zip(late['knn 16x'], late['none'])]
    m, half, n, paired = R.interval('knn 16x')
    assert n == 4 and paired and math.isclose(m, sum(d) / 4, abs_tol=1e-9)
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 3)
    assert math.isclose(half, 3.182 * sd / 2, rel_tol=1e-9)                                 # t(0.975, 3) = 3.182
    assert [R.paired_verdict(l) for l in ('knn 16x', 'xl', 'knn 4x', 'knn 1x', 'knn 64x')] == \
        ['better', 'not known', 'worse', 'no difference', 'not known']
    assert R.paired_verdict('knn 16x top-128') is None
    assert '`knn 16x` − `none`: -0.050 ± ' in R.interval_text('knn 16x') and '(4 paired seeds), better' in R.interval_text('knn 16x')
    unpaired = S.MemStudyResults([{k: v for k, v in r.items() if k != 'init'} for r in runs])
    assert not unpaired.interval('knn 16x')[3] and '(4 seeds)' in unpaired.interval_text('knn 16x')
    assert '95% t-interval' in S.PAIRED_RULE and '{margin' in S.PAIRED_RULE


# ---------------------------------------------------------------- the rule, branch by branch
@pytest.mark.parametrize('d, verdict', [
    ([-0.05, -0.04, -0.05, -0.06], 'better'),            # interval below 0
    ([0.10, 0.11, 0.09, 0.11], 'worse'),                 # interval above 0
    ([0.002, -0.002, 0.001, -0.001], 'no difference'),   # interval holds 0, inside +-MARGIN
    ([0.05, -0.05, 0.05, -0.05], 'not known'),           # interval holds 0, reaches past the margin
    ([-0.05, -0.0001], 'not known'),                     # a null seed does not make a verdict (the old rule: better)
    ([-0.3], 'not known'),                               # fewer than 2 seeds
    ([], 'not known'),
    ([-0.004, -0.004], 'better'),                        # below 0 though inside the margin: the sign is known
])
def test_rule_branches(d, verdict):
    v, m, half, n = S.judge(d)
    assert v == verdict and n == len(d)
    if len(d) >= 2:
        mean = sum(d) / len(d); sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
        assert math.isclose(m, mean) and math.isclose(half, S.t975(len(d) - 1) * sd / math.sqrt(len(d)))
    else: assert math.isnan(half)

def test_rule_margin_edge():
    "An interval around 0 is *no difference* just inside +-MARGIN and *not known* just past it (2 seeds: t = 12.706)."
    x = lambda reach: reach * S.MARGIN / 12.706      # the seeds +-x give the interval 0 +- reach * MARGIN
    assert S.judge([x(0.99), -x(0.99)])[0] == 'no difference'
    assert S.judge([x(1.01), -x(1.01)])[0] == 'not known'
    assert S.judge([S.MARGIN / 2 + 1e-9, S.MARGIN / 2 - 1e-9])[0] == 'worse'   # the sign first, then the margin
    assert S.MARGIN == 0.01 and f'±{S.MARGIN:g} bits per byte' in S.MemStudyResults([_fake_run('none', 0, 2.0)]).rule()

def test_rule_says_whether_the_runs_were_paired():
    runs = [_fake_run(l, s, 2.0 + 0.01 * s) for l in ('none', 'knn 16x') for s in (0, 1)]
    unpaired = S.MemStudyResults(runs).rule()
    assert '2 seeds per setting, stored before paired initialisation' in unpaired and 'initialisation noise' in unpaired
    paired = S.MemStudyResults([dict(r, init={}) for r in runs]).rule()
    assert 'paired: every run records `init`' in paired and 'noise' not in paired
    mixed = S.MemStudyResults([dict(r, init={}) if r['seed'] == 0 else r for r in runs]).rule()
    assert '2 of 4 runs paired' in mixed
    more = S.MemStudyResults(runs + [_fake_run('none', 2, 2.0), _fake_run('none', 3, 2.0)]).rule()
    assert '2 to 4 seeds per setting' in more
    for rule in (unpaired, paired, mixed):
        assert rule.startswith(S.PAIRED_RULE.split('{')[0]) and len(rule.split()) <= 100   # one paragraph

# ---------------------------------------------------------------- the chapter and the docs home
NBS = S.ROOT / 'nbs'
OLD_RULE = ('every seed agrees', 'both seeds', 'in every seed', 'the same seed gives the same initialisation')

def _cells(name):
    for c in json.loads((NBS / name).read_text())['cells']:
        yield ''.join(c['source']), [''.join(o.get('data', {}).get('text/markdown', '')) + ''.join(o.get('text', ''))
                                     for o in c.get('outputs', [])]

@pytest.mark.parametrize('name', ['10_memorizing.ipynb', 'index.ipynb'])
def test_no_old_rule_phrase(name):
    "Neither the cells nor their outputs use the old rule ('every seed agrees', a mean of 0.005) or claim pairing."
    for source, outputs in _cells(name):
        for text in [source] + outputs:
            assert not any(p in text.lower() for p in OLD_RULE), (name, text[:200])
    assert '0.005' not in ''.join(s for s, _ in _cells(name) if 'MS.' in s or 'short_answer' in s)

def test_chapter_prints_the_rule_of_the_stored_runs():
    "Every verdict table and list of the chapter ends with the rule, formatted from `PAIRED_RULE` for the stored runs."
    long, short = S.MemStudyResults.load(phase='long'), S.MemStudyResults.load(phase='short')
    outputs = [o for _, outs in _cells('10_memorizing.ipynb') for o in outs]
    rule_outputs = [o for o in outputs if '*Rule:*' in o]
    assert len(rule_outputs) == 4, len(rule_outputs)   # the two tables, the findings, the claims against the paper
    assert all(o.rstrip().endswith((long.rule(), short.rule())) for o in rule_outputs)
    assert sum(long.rule() in o for o in rule_outputs) >= 3   # the long table, the findings, the claims (both rules where they differ)
    assert any(o.rstrip().endswith(short.rule()) for o in rule_outputs)
    assert f"±{S.MARGIN:g} bits per byte" in long.rule() and long.seeds_text() in long.rule()
    home = [o for _, outs in _cells('index.ipynb') for o in outs if 'On bytes 8–16 KB' in o]
    assert len(home) == 1 and home[0].rstrip().endswith(long.rule())


def test_device_option_is_checked_recorded_and_kept_apart_in_costs():
    tiny = dict(steps=1, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=0.0, warmup=1,
                eval_docs=1, eval_bytes=32, seed=0)
    r = S.train_run(label='knn 4x', knn_mult=4, knn_layer=1, top_k=4, **tiny)
    assert r['device'] == 'cpu (1 thread)' and 'device' not in r['setting']      # the device is not a setting
    with pytest.raises(ValueError, match="FaissKNNMemory .* run this setting with device='cpu'"):   # before any CUDA
        S.train_run(label='knn 64x faiss', knn_mult=4, knn_layer=1, faiss=True, device='cuda', **tiny)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match='no CUDA device here'): S.train_run(label='none', device='cuda', **tiny)
        cli = subprocess.run([sys.executable, '-m', 'bench.memorizing_study', '--device', 'cuda', '--list'],
                             capture_output=True, text=True, cwd=S.ROOT)
        assert cli.returncode != 0 and 'no CUDA device here; use --device cpu' in cli.stderr
    # stored runs without a device ran on the CPU harness; a cost across devices is not a ratio of the same machine
    runs = [_fake_run('none', 0, 2.0), _fake_run('knn 16x', 0, 1.9),
            dict(_fake_run('xl', 0, 1.9), device='NVIDIA H200')]
    R = S.MemStudyResults(runs)
    assert R.cost('knn 16x') == pytest.approx(1.0) and math.isnan(R.cost('xl'))
    assert '| – | – |' in [l for l in R.table().splitlines() if l.startswith('| `xl`')][0]
    assert R.devices_text() == 'cpu (1 thread) (2 runs), NVIDIA H200 (1 run)'
    assert S.MemStudyResults(runs[:2]).devices_text() == 'cpu (1 thread)'

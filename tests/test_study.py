"The study harness (bench/study.py) end to end at toy size: data, protocols, runs, resumable storage, the summaries."
import json, math, subprocess, sys
import pytest, torch
import bench.study as S
from bench.study import study_text, data_recipe, stream_batch, train_run, lr_at, StudyResults
from relpos.relative_mha import extend_position_tables
from relpos.models import DecoderLM

TINY = dict(steps=6, batch=4, seq=16, d_model=32, heads=2, n_layers=2, warmup=2, eval_every=3, scored=8, stride=16,
            attn_windows=2, data_scale=0.05)

def test_data_is_split_and_fixed():
    tr, va = study_text('train'), study_text('val')
    assert len(tr) > 8 * len(va) > 0
    assert va[:200] not in tr   # validation topics are not in the training text
    r = data_recipe()
    assert r['train_bytes'] == len(tr) and len(r['train_sha256']) == 64
    with pytest.raises(ValueError, match='split'): study_text('test')

def test_stream_batches_continue_each_other():
    data = torch.arange(10_000)
    x0, y0 = stream_batch(data, 0, 4, 16)
    x1, _ = stream_batch(data, 1, 4, 16)
    assert torch.equal(y0[:, :-1], x0[:, 1:])          # targets are the next bytes
    assert torch.equal(x1[:, 0], x0[:, -1] + 1)         # step 1 continues step 0 in every stream

def test_schedule():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(99, 100, 1.0, 10) == pytest.approx(0.1, abs=0.01)

def test_protocol_windows_score_the_bytes_they_claim():
    n = 1000
    for L in (16, 64, 100):
        wins = S.nonoverlap_windows(n, L)
        targets = [t for s, m in wins for t in range(s + 1, s + m + 1)]
        assert targets == list(range(1, n))                 # (a): every byte after the first, once
    ends = S.sliding_ends(n, 128, 32)
    assert ends[0] == 129 and ends[-1] <= n and all(b - a == 32 for a, b in zip(ends, ends[1:]))

class Uniform(torch.nn.Module):   # a model with no opinion: exactly 8 bits per byte, with or without memory
    def forward(self, x, memory=None): return torch.zeros(*x.shape, 256), []

def test_evaluate_counts_bits_exactly_and_reports_refusals():
    val = torch.randint(0, 256, (500,))
    for seg in (0, 16):
        e = S.evaluate(Uniform(), val, [16, 32, 64], scored=8, stride=16, segment=seg)
        for p in ('nonoverlap', 'sliding'):
            assert all(v == pytest.approx(8.0) for v in e[p].values()) and list(e[p]) == ['16', '32', '64']
    m = DecoderLM(256, d_model=16, heads=2, n_layers=1, position='absolute', max_len=16)
    e = S.evaluate(m, val, [16, 32], scored=8, stride=16)
    assert isinstance(e['sliding']['16'], float) and e['sliding']['32'].startswith('refused') and e['nonoverlap']['32'].startswith('refused')

@pytest.mark.parametrize('method,mem_len', [('none', 0), ('xl', 16), ('t5', 0)])
def test_smoke_run(method, mem_len):
    r = train_run(method, method, seed=0, mem_len=mem_len, **TINY)
    assert len(r['curve']) == 2 and r['train_bpb'][-1][1] < r['train_bpb'][0][1]   # it learns
    assert set(r['evals'][method]) == {'nonoverlap', 'sliding'} and list(r['evals'][method]['sliding']) == ['16', '32', '64', '128']
    assert all(isinstance(v, float) for p in r['evals'][method].values() for v in p.values()) and r['step_time'] > 0
    if mem_len: assert r['attention'][method] is None
    else:
        a = r['attention'][method]
        assert [x['far'] for x in a['16']] == [0.0, 0.0]          # no key is `seq` or more bytes back in a window of `seq`
        assert all(0 < x['far'] < 1 for x in a['128'])
        if method == 't5': assert all(0 <= x['last_bucket'] <= 1 for x in a['128'])

def test_rotary_run_holds_its_scalings_and_fine_tunes():
    r = train_run('rotary', 'rotary', seed=0, rope_variants=True, **TINY)
    assert list(r['evals']) == S.derived_labels('rotary') and set(r['finetune']) == {f'rotary+{k}+ft' for k in S.SCALINGS}
    for k in ('linear', 'yarn'):   # factor L / seq = 1 at the training length: the plain rotary numbers
        assert r['evals'][f'rotary+{k}']['sliding']['16'] == pytest.approx(r['evals']['rotary']['sliding']['16'], rel=1e-5)
    assert r['evals']['rotary+linear']['sliding']['128'] != pytest.approx(r['evals']['rotary']['sliding']['128'], rel=1e-6)
    assert r['finetune']['rotary+yarn+ft']['length'] == 4 * 16 and r['finetune']['rotary+yarn+ft']['steps'] == 1

def test_set_rope_scaling_changes_angles_not_weights():
    torch.manual_seed(0)
    m = DecoderLM(256, d_model=32, heads=2, n_layers=2, position='rotary', max_len=16, nope_layers=(1,)).eval()
    x = torch.randint(0, 256, (1, 64))
    w = {k: v.clone() for k, v in m.state_dict().items()}
    base = m(x)[0]
    assert S.set_rope_scaling(m, 'linear', 4, 16) == 1            # the NoPE layer has no rotation to scale
    assert not torch.allclose(m(x)[0], base) and all(torch.equal(w[k], v) for k, v in m.state_dict().items())
    S.set_rope_scaling(m, None, 1, 16)
    torch.testing.assert_close(m(x)[0], base)

def test_runs_are_ordered_seed_first_and_labelled():
    runs = S.all_runs('main')
    labels = list(S.settings())
    assert [r['seed'] for r in runs] == sorted(r['seed'] for r in runs) and len(runs) == 3 * len(labels)
    assert runs[0]['label'] == 'rotary' and runs[0]['rope_variants'] and {r['label'] for r in runs[:len(labels)]} == set(labels)
    assert 'absolute+memory' not in labels and all(S.settings()[f'{m}+memory']['mem_len'] == S.MEM_LEN for m in ('xl', 'rotary', 'fire'))
    assert S.settings()['rotary+nope']['nope_layers'] == (2,)
    timing = S.all_runs('timing')
    assert all(not r['evaluation'] and not r.get('rope_variants') and r['steps'] == 40 for r in timing)
    assert {r['steps'] for r in S.all_runs('long', labels=['alibi'])} == {4 * S.COMMON['steps']}
    assert S.run_label('rotary+yarn+ft') == 'rotary' and S.run_label('xl+clip') == 'xl'
    with pytest.raises(ValueError, match='label'): S.run_label('nope')

def test_cli_stores_each_run_skips_stored_ones_and_loads_a_partial_store(tmp_path):
    cmd = [sys.executable, '-m', 'bench.study', '--smoke', '--workers', '1', '--seeds', '1', '--labels', 'none', 'alibi',
           '--out', str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.glob('*.json'))
    assert files == ['main__alibi__seed0.json', 'main__none__seed0.json']
    before = (tmp_path / files[0]).read_text()
    r = subprocess.run(cmd, capture_output=True, text=True)          # a second call runs nothing
    assert r.returncode == 0 and 'main: 2 of 2 runs stored; running 0' in r.stdout
    assert (tmp_path / files[0]).read_text() == before
    listing = subprocess.run(cmd + ['--list'], capture_output=True, text=True).stdout
    assert 'stored main none seed 0' in listing
    (tmp_path / files[0]).unlink()                                    # a partial store loads and says what is missing
    R = StudyResults(S.load_results(tmp_path), {'main': [('alibi', 0), ('none', 0)]})
    assert R.labels == ['none'] and R.missing() == [('alibi', 0)] and 'seed 0: `alibi`' in R.coverage()
    assert R.table().count('\n') == 2 and R.seq == 16
    assert R.table().endswith('| – |') and R.ratio_text('none') == '–'   # no timing phase: no step time (never the quality runs' own)

def _fake(label, seed, bpb, phase='main', step=1.0, seq=128):
    "A stored run of `label` whose evals are `bpb`: {derived label: (nonoverlap {L: v}, sliding {L: v})}."
    L = [seq * m for m in S.MULTIPLES]
    ev = {l: {'nonoverlap': dict(zip(map(str, L), a)), 'sliding': dict(zip(map(str, L), b))} for l, (a, b) in bpb.items()}
    return {'phase': phase, 'label': label, 'seed': seed, 'evals': ev, 'setting': {'seq': seq}, 'step_time': step}

def _synthetic(long_phase=False):
    R = 'refused: max_len'
    spec = {   # label: ({derived: (nonoverlap 1x..8x, sliding 1x..8x)}, step time)
        'none': ({'none': ((2.5, 2.5, 2.5, 2.5), (2.4, 2.4, 2.4, 2.5))}, 1.0),
        'absolute': ({'absolute': ((2.2, R, R, R), (2.1, R, R, R))}, 0.9),
        'alibi': ({'alibi': ((2.00, 1.95, 1.93, 1.92), (1.90, 1.85, 1.84, 1.84))}, 1.1),
        'fourier': ({'fourier': ((1.99, 2.0, 2.1, 2.2), (1.89, 1.9, 2.0, 2.1))}, 1.5),
        'rotary': ({'rotary': ((2.05, 2.3, 2.6, 2.9), (1.95, 2.2, 2.5, 2.8)),
                    'rotary+yarn+ft': ((1.90, 1.96, 1.90, 1.91), (1.96, 1.86, 1.80, 1.86))}, 1.2),   # best at 128 by (a): fine-tuned longer
        'alibi+memory': ({'alibi+memory': ((2.0, 1.9, 1.88, 1.87), (1.9, 1.88, 1.88, 1.88))}, 1.3)}
    runs = [_fake(l, s, {d: tuple(tuple(x + 0.001 * s if isinstance(x, float) else x for x in p) for p in v) for d, v in b.items()}, step=t)
            for s in range(3) for l, (b, t) in spec.items()]
    runs += [_fake(l, s, {}, 'timing', t) for s in range(2) for l, (_, t) in spec.items()]
    if long_phase:
        runs += [_fake('alibi', s, {'alibi': ((1.5,) * 4, (1.4, 1.4, 1.4, 1.45))}, 'long') for s in range(2)]
        runs += [_fake('rotary', s, {'rotary+yarn+ft': ((1.6,) * 4, (1.5, 1.5, 1.5, 1.42))}, 'long') for s in range(2)]
    return StudyResults(runs)

def test_summaries_follow_the_numbers():
    R = _synthetic()
    assert (R.seq, R.long, R.lengths) == (128, 1024, [128, 256, 512, 1024])
    assert R.labels == ['none', 'absolute', 'fourier', 'rotary', 'rotary+yarn+ft', 'alibi', 'alibi+memory']
    v = R.verdicts()
    # at the training length only models as trained compete (the fine-tuned variant had 10% more steps)
    assert v['best_short'] == 'fourier' and v['near'] == ['fourier', 'alibi'] and v['cheapest_near'] == 'alibi'
    assert v['best_long'] == {'nonoverlap': 'rotary+yarn+ft', 'sliding': 'alibi'}        # the protocols disagree
    assert v['best_memory']['nonoverlap'] == 'alibi+memory' and v['refused'] == ['absolute'] and v['worse'] == ['rotary']
    assert R.fmt('absolute', 1024) == 'refused' and R.mean('absolute', 1024) == math.inf and math.isnan(R.mean('xl', 128))
    assert abs(R.time_ratio('rotary+yarn+ft') - 1.2) < 1e-12
    t = R.which_to_use()
    assert '| the best quality at the length you train on | `fourier` (or `alibi`, cheaper) |' in t and '1.99' in t
    assert 'sliding window) | `alibi` | `alibi` 1.841 against `rotary+yarn+ft` 1.861 at 1024' in t
    assert 'in consecutive windows | `rotary+yarn+ft` |' in t
    assert '| long texts read segment by segment | `alibi` with `mem_len` |' in t   # 1.871 < 1.901 (protocol a at 8x)
    assert '`rotary` 1.951 → 2.801' in t and '`absolute` refuses longer inputs' in t and 'mean over 3 seeds' in t
    assert '4× the steps' not in t
    assert R.table().count('\n') == 1 + len(R.labels) and R.ranking('sliding')[0] == 'alibi'

def test_memory_that_does_not_beat_one_pass_is_not_recommended_and_the_long_phase_is_cited():
    R = _synthetic(long_phase=True)
    # alibi+memory at 8x under (a): 1.871 against the best one-pass 1.901: recommended; make it worse
    for r in R.all:
        if r['label'] == 'alibi+memory' and r['phase'] == 'main': r['evals']['alibi+memory']['nonoverlap']['1024'] = 2.0
    t = R.which_to_use()
    assert '| long texts read segment by segment | no memory: `rotary+yarn+ft` read in one pass |' in t
    assert '| (after 4× the steps) | `rotary+yarn+ft` | `rotary+yarn+ft` 1.420; `alibi` 1.450 at 1024 (b), 2 seeds |' in t

def test_long_phase_takes_the_best_runs_and_rotary():
    R = _synthetic()
    assert S.long_labels(R, top=3) == ['alibi', 'rotary', 'alibi+memory', 't5', 'fire']   # alibi, rotary+yarn+ft -> rotary, alibi+memory
    assert S.long_labels(R, top=1) == ['alibi', 'rotary', 't5', 'fire']
    assert S.long_labels(R, top=1, also=('rotary',)) == ['alibi', 'rotary']

def test_extend_position_tables_keeps_trained_lengths_and_clips_beyond():
    torch.manual_seed(0)
    m = DecoderLM(256, d_model=32, heads=2, n_layers=2, position='xl', max_len=16).eval()
    for p in m.parameters(): torch.nn.init.normal_(p, std=0.1)   # every table row different, as if trained
    x = torch.randint(0, 256, (2, 48))
    before_short, before_long = m(x[:, :16])[0], m(x)[0]
    assert extend_position_tables(m, 15) == 2
    torch.testing.assert_close(m(x[:, :16])[0], before_short)            # distances 0..15: unchanged
    assert not torch.allclose(m(x)[0], before_long)                        # distances beyond 15 now read row 15
    for a in (mod for mod in m.modules() if hasattr(mod, 'key_pos_bias')):
        P = a.P
        assert torch.equal(a.key_pos_bias[:P - 15], a.key_pos_bias[P - 15].expand(P - 15, -1))

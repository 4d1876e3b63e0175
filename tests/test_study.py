"The study harness (bench/study.py) end to end at toy size: data recipe, batches, training, evaluation, refusals."
import json, subprocess, sys
import pytest, torch
from bench.study import study_text, data_recipe, stream_batch, train_run, lr_at
from relpos.relative_mha import extend_position_tables
from relpos.models import DecoderLM

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

@pytest.mark.parametrize('method,mem_len', [('none', 0), ('xl', 32), ('absolute', 0)])
def test_smoke_run(method, mem_len):
    r = train_run(method, seed=0, steps=6, batch=4, seq=32, d_model=32, heads=2, n_layers=1, mem_len=mem_len,
                  eval_every=3, eval_windows=(32, 64), n_eval=4, data_scale=0.05, warmup=2)
    assert len(r['curve']) == 2 and r['train_bpb'][-1] < r['train_bpb'][0]   # it learns
    assert isinstance(r['bpb']['32'], float) and r['step_time'] > 0
    if method == 'absolute': assert r['bpb']['64'].startswith('refused')  # a refusal is reported, never a number
    else: assert isinstance(r['bpb']['64'], float)

def test_cli_smoke(tmp_path):
    out = tmp_path / 'study.json'
    r = subprocess.run([sys.executable, '-m', 'bench.study', '--smoke', '--workers', '1', '--methods', 'none', 'xl',
                        '--out', str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r['label'] for r in res['results']] == ['none', 'xl'] and set(res['phases']) == {'train', 'timing', 'long'}
    assert all(r['step_time'] > 0 and r['bpb'] == {} for r in res['timing'])

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

def _fake(label, seed, b128, b1024, step):
    bpb = {'128': b128, '1024': b1024}
    return {'label': label, 'seed': seed, 'bpb': bpb, 'bpb_extended': None, 'step_time': step, 'peak_bytes': 2**20, 'params': 10}

def test_study_results_summaries_follow_the_numbers():
    from bench.study import StudyResults
    spec = {'none': (2.0, 2.1, 1.0), 'xl': (1.50, 2.5, 1.5), 'alibi': (1.51, 1.45, 1.1), 'absolute': (1.8, 'refused: max_len', 0.9),
            'xl+memory': (1.49, 1.40, 1.6)}
    res = {'results': [_fake(l, s, a + 0.001 * s, b if isinstance(b, str) else b + 0.001 * s, t) for s in range(3) for l, (a, b, t) in spec.items()]}
    res['timing'] = [_fake(l, s, 0, 0, t) for s in range(2) for l, (_, _, t) in spec.items()]
    R = StudyResults(res)
    assert (R.seq, R.long) == (128, 1024)
    v = R.verdicts()
    assert v['best_short'] == 'xl' and v['near'] == ['xl', 'alibi'] and v['cheapest_near'] == 'alibi'
    assert v['best_long'] == 'alibi' and v['refused'] == ['absolute'] and v['worse'] == ['xl']   # xl+memory: not one pass
    assert v['memory_helps'] and '| long texts read segment by segment | `xl` with `mem_len` |' in R.which_to_use()
    assert R.fmt('absolute', 1024) == 'refused' and R.mean('absolute', 1024) == float('inf')
    assert abs(R.time_ratio('xl') - 1.5) < 1e-12
    table = R.which_to_use()
    assert '| texts longer than you trained on, read in one pass | `alibi` |' in table and '`absolute` refuses longer inputs' in table
    assert R.table().count('\n') == 1 + len(spec)

def test_study_results_never_recommend_memory_that_did_not_help():
    from bench.study import StudyResults
    spec = {'none': (2.0, 2.1), 'xl': (1.5, 1.6), 'xl+memory': (1.6, 1.7)}
    res = {'results': [_fake(l, s, a, b, 1.0) for s in range(2) for l, (a, b) in spec.items()],
           'timing': [_fake(l, 0, 0, 0, 1.0) for l in spec]}
    R = StudyResults(res)
    assert not R.verdicts()['memory_helps'] and 'no method gained from memory here' in R.which_to_use()

def test_study_results_with_a_larger_budget_name_both_and_qualify_memory():
    from bench.study import StudyResults
    spec = {'none': (2.0, 2.1), 'xl': (1.5, 1.6), 'xl+memory': (1.6, 1.7)}
    longer = {'none': (1.5, 1.9), 'xl': (1.2, 1.3), 'xl+memory': (1.3, 1.25)}   # memory helps only with more steps
    res = {'results': [_fake(l, s, a, b, 1.0) for s in range(2) for l, (a, b) in spec.items()],
           'long': [_fake(l, 0, a, b, 1.0) for l, (a, b) in longer.items()],
           'timing': [_fake(l, 0, 0, 0, 1.0) for l in spec]}
    R = StudyResults(res)
    assert R.parts() == ['results', 'long'] and R.mean('xl', 128, part='long') == 1.2
    assert not R.verdicts()['memory_helps'] and R.verdicts('long')['memory_helps']
    table = R.which_to_use()
    assert '`xl` with `mem_len`, given enough training' in table and 'after 4× the steps: 1.200' in table
    assert '`none` 1.500 → 1.900' in table   # the larger budget's rise beyond the training length

def test_study_results_do_not_recommend_memory_that_one_pass_methods_beat():
    "Memory that beats `xl` but not a method read in one pass is no recommendation: the row says what is unknown."
    from bench.study import StudyResults
    spec = {'none': (2.0, 2.1), 'xl': (1.5, 2.0), 'alibi': (1.5, 1.45), 'xl+memory': (1.6, 1.7)}
    res = {'results': [_fake(l, s, a, b, 1.0) for s in range(2) for l, (a, b) in spec.items()],
           'timing': [_fake(l, 0, 0, 0, 1.0 + (l == 'xl+memory')) for l in spec]}
    R = StudyResults(res)
    assert R.verdicts()['memory_helps']
    table = R.which_to_use()
    assert '| long texts read segment by segment | not known: only `xl` was trained with memory' in table
    assert '`xl` with `mem_len`' not in table and 'read in one pass, `alibi` 1.450' in table and '2.00× the step time' in table

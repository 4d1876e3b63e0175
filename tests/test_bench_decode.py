"The benchmarks' own logic (no timing is asserted): bench_table's second ratio, the training-step tables' cases, and the decode benchmark's clock and stored table."
import json
import pytest
import torch
import relpos.bench
from relpos.bench import bench_table, parse_tables
from relpos.models import DecoderLM, POSITIONS
import bench.decode as decode
import bench.models


def test_bench_table_also_divides_by_a_second_case():
    tbl = bench_table({'one': 'relpos.bench:make_alloc_case', 'two': 'relpos.bench:make_alloc_case',
                       'bad': 'relpos.bench:nope'}, [dict(mib=16)], baseline='one', also='two', reps=1, memory=False)
    t, = parse_tables(tbl)
    assert tbl.splitlines()[0].endswith('| time / two |')
    rows = {r['case']: r for r in t['rows']}
    assert rows['two']['also_ratio'] == 1.0
    # the ratio of the unrounded times; the table shows times to 0.1 ms (16 MiB: some ms, so rounding moves it little)
    assert rows['one']['also_ratio'] == pytest.approx(rows['one']['time_ms'] / rows['two']['time_ms'], rel=0.05, abs=0.01)
    assert rows['bad']['also_ratio'] is None and rows['bad']['time_ms'] is None     # a failed case: its error, no ratio
    with pytest.raises(ValueError, match="also='three'"):
        bench_table({'one': 'relpos.bench:make_alloc_case'}, [{}], baseline='one', also='three')


def test_training_step_tables_hold_every_position_and_rotary_ratio(monkeypatch):
    "`make bench`'s model tables: every method of POSITIONS a case ('absolute' is 'none' at the layer), each also divided by rotary."
    calls = []
    monkeypatch.setattr(relpos.bench, 'bench_table', lambda cases, configs, **kw: calls.append((cases, kw)) or '')
    bench.models.main()
    assert len(calls) == 3
    for cases, kw in calls:
        assert kw.get('also') == 'rotary', kw
        assert set(POSITIONS) - {'absolute'} <= set(cases), sorted(cases)
    layer_cases, layer_kw = calls[1]
    assert layer_kw['baseline'] == 'sdpa_causal' and {'fire', 'kerple', 'xpos', 'fox'} <= set(layer_cases)


def _tiny_llama(window=None):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = (MistralForCausalLM(MistralConfig(sliding_window=window, **shape)) if window else LlamaForCausalLM(LlamaConfig(**shape))).eval()
    hf.generation_config.eos_token_id = hf.generation_config.pad_token_id = None
    return hf


@pytest.mark.parametrize("window", [None, 5])
def test_decode_clock_sees_every_new_token_of_both_generates(monkeypatch, window):
    """The benchmark times transformers' generate and the converted model's by the same streamer: the prompt, then one
    put per new token in both, so that both give NEW - 1 step times (the steps after the first new token)."""
    monkeypatch.setattr(decode, 'NEW', 9)
    hf = _tiny_llama(window)
    lm = DecoderLM.from_transformers(hf).eval()
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    ours = decode.timed(lambda s: lm.generate(prompt, 9, streamer=s))
    theirs = decode.timed(lambda s: hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9,
                                                do_sample=False, use_cache=True, streamer=s))
    for r in (ours, theirs):
        assert len(r['step_cpu']) == len(r['step_wall']) == 8 and all(t >= 0 for t in r['step_cpu'])
        assert r['tokens'].shape == (2, 16)
    assert torch.equal(ours['tokens'], theirs['tokens'])


def test_edge_ratio_and_summary():
    e = decode.EDGE
    steps = [1.0] * e + [5.0] * 10 + [2.0] * e
    assert decode.edge_ratio(steps) == 2.0
    assert decode.summary([3, 1, 2]) == dict(median=2, min=1, max=3)


def test_stored_decode_table_covers_every_method_with_its_conditions():
    "nbs/data/decode_bench.json: every method at batch 1 and 8, both converted models, and the conditions it was measured in."
    result = json.loads(decode.OUT.read_text())
    assert {'torch', 'transformers', 'threads', 'date', 'commit', 'clock', 'machine'} <= set(result['conditions'])
    for b in (1, 8):
        assert [r['position'] for r in result['methods'] if r['batch'] == b] == list(POSITIONS)
        # every model of the code's list once `python -m bench decode` has re-run; LLaMA and Mistral in any case
        assert {r['model'] for r in result['transformers'] if r['batch'] == b} == set(decode.HF_MODELS)
    assert result['rounds'] >= 5
    md = decode.markdown(result)
    for p in POSITIONS: assert f"| {p} | 1 |" in md and f"| {p} | 8 |" in md


def test_gemma3_row_measured_and_shown(monkeypatch):
    """The Gemma 3 case: three sliding layers and a global one, converted with the same greedy tokens as transformers'
    generate, and a row of the table chapter 90 shows (`markdown`); a partial run is not stored."""
    monkeypatch.setattr(decode, 'NEW', 9)
    monkeypatch.setattr(decode, 'PROMPT', 12)
    hf = decode.hf_models(models=('gemma3',))['gemma3']
    lm = DecoderLM.from_transformers(hf)
    assert lm.layer_types == ('sliding_attention',) * 3 + ('full_attention',) and lm.sliding_window == decode.WINDOW
    assert lm.layer_positions == {'sliding_attention': {'base': 10000.0}}   # the global layers': 1,000,000
    stored = decode.OUT.read_text()
    md = decode.main(batch_sizes=(1,), rounds=1, models=('gemma3',), positions=())
    assert decode.OUT.read_text() == stored
    assert "| gemma3 | 1 |" in md and md.count('| True |') == 1 and "Gemma 3's (every layer but the 4th)" in md
    with pytest.raises(ValueError, match=r"models: \['gpt5'\]"): decode.hf_models(models=('gpt5',))


def test_a_partial_run_is_printed_not_stored(monkeypatch, tmp_path):
    "`main(positions=...)` (the `--positions` of `python -m bench.decode`) runs those methods and leaves the stored table alone."
    out = tmp_path / 'decode_bench.json'
    monkeypatch.setattr(decode, 'OUT', out)
    monkeypatch.setattr(decode, 'NEW', 40)
    monkeypatch.setattr(decode, 'PROMPT', 4)
    monkeypatch.setattr(decode, 'transformers_table', lambda *a, **k: pytest.fail('the transformers table was run'))
    monkeypatch.setattr(decode, 'make', lambda p: DecoderLM(decode.N_VOCAB, d_model=16, heads=2, n_layers=1, position=p, max_len=64).eval())
    md = decode.main(batch_sizes=(1,), rounds=1, positions=('xpos', 'rotary'), models=())
    assert not out.exists()
    assert '| xpos | 1 |' in md and '| rotary | 1 |' in md and '| alibi |' not in md and 'transformers tok/s' not in md
    with pytest.raises(ValueError, match="must include 'rotary'"): decode.main(batch_sizes=(1,), rounds=1, positions=('xpos',), models=())

"""Decode benchmark (nbs/90_bench.ipynb): greedy `generate` with the K/V cache, timed token by token through a streamer
(transformers' `put(tokens)` / `end()` interface, which both libraries call once per new token).

- methods: `DecoderLM(position=p).generate` for every position method (batch 1 and 8): tokens/s, its ratio to rotary's
  in the same round, and the per-token time of the last 32 new tokens over the first 32.
- transformers: a Llama, a Mistral (sliding window) and a Gemma 3 (three sliding layers, then a global one) of
  transformers built from tiny-but-not-trivial configs, and the same weights converted with
  `DecoderLM.from_transformers`: relpos's `generate` against transformers' own (`use_cache=True`, greedy), tokens/s
  ratio and last 32 / first 32 of each.

Every case runs once per round, the cases of a batch interleaved (the order reversed every other round), so that a
shared machine's slow minutes fall on all of them; each number is the median over the rounds, with the smallest and
largest. Time is the CPU time of the process (one thread), which the time slices other jobs take do not inflate; wall
time is stored too. Writes nbs/data/decode_bench.json with the conditions (torch, transformers, threads, date, commit).

`python -m bench.decode --positions xpos rotary --models gemma3 [--batch 1 8] [--rounds 5]` runs a part (`--positions`
or `--models` with no names: no such table) and prints its tables without storing them: the stored file holds a
complete run only."""
import argparse, json, statistics, subprocess, time
from pathlib import Path
import torch
from relpos.models import DecoderLM, POSITIONS
import relpos.cache  # noqa: F401  (DecoderLM's cached methods)

N_VOCAB, D_MODEL, HEADS, LAYERS, PROMPT, NEW = 256, 256, 4, 4, 128, 256
EDGE = 32                    # first and last EDGE new tokens compared
WINDOW = 128                 # Mistral's and Gemma 3's sliding window: shorter than prompt + new tokens, so the window is used
HF_MODELS = ('llama', 'mistral', 'gemma3')   # the transformers models of the second table
GEMMA3_PATTERN = 4           # Gemma 3: every 4th layer global, the others sliding (of 4 layers: 3 sliding, then 1 global)
OUT = Path(__file__).resolve().parent.parent / 'nbs' / 'data' / 'decode_bench.json'


class StepClock:
    "A streamer noting both clocks at every `put`: the prompt's, then one per new token (transformers' `BaseStreamer` interface)."
    def __init__(self): self.cpu, self.wall = [], []
    def put(self, tokens): self.cpu.append(time.process_time()); self.wall.append(time.perf_counter())
    def end(self): pass


def timed(call) -> dict:
    """Run `call(streamer)` (a greedy `generate` of NEW tokens): total CPU and wall seconds, and the seconds between
    consecutive new tokens (NEW - 1 decode steps; the first new token, which follows the prefill, is left out)."""
    clock = StepClock()
    c0, w0 = time.process_time(), time.perf_counter()
    out = call(clock)
    c1, w1 = time.process_time(), time.perf_counter()
    if len(clock.cpu) != NEW + 1: raise RuntimeError(f"the streamer saw {len(clock.cpu)} puts, expected prompt + {NEW}")
    steps = lambda t: [b - a for a, b in zip(t[1:], t[2:])]
    return dict(cpu=c1 - c0, wall=w1 - w0, step_cpu=steps(clock.cpu), step_wall=steps(clock.wall), tokens=out)


def summary(xs) -> dict:
    "Median, smallest and largest of the rounds' values."
    return dict(median=statistics.median(xs), min=min(xs), max=max(xs))


def edge_ratio(steps) -> float:
    "Per-token time of the last EDGE new tokens over the first EDGE (each the median of its steps)."
    return statistics.median(steps[-EDGE:]) / statistics.median(steps[:EDGE])


def interleaved(cases:dict, batch:int, rounds:int) -> dict:
    "`timed` of every case (name -> `call(streamer)`), once per round in alternating order; one warm-up each first."
    for call in cases.values(): call(StepClock())
    runs = {name: [] for name in cases}
    for r in range(rounds):
        for name in (list(cases) if r % 2 == 0 else list(reversed(cases))):
            runs[name].append(timed(cases[name]))
    return runs


def stats(run_list, batch:int, clock='cpu') -> dict:
    "Per case: tokens/s (batch x NEW / total time of `generate`) and last/first per-token ratio, per round and summarised."
    tok_s = [batch * NEW / r[clock] for r in run_list]
    edge = [edge_ratio(r['step_' + clock]) for r in run_list]
    return dict(tok_s=summary(tok_s), last_over_first=summary(edge), rounds=dict(tok_s=tok_s, last_over_first=edge))


def make(position):
    "A `DecoderLM` of the chapters' default sizes; `max_len` covers prompt + new tokens (the `absolute` table)."
    torch.manual_seed(0)
    return DecoderLM(N_VOCAB, d_model=D_MODEL, heads=HEADS, n_layers=LAYERS, position=position, max_len=PROMPT + NEW).eval()


def prompt_of(batch, vocab=N_VOCAB):
    return torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


def methods(batch_sizes=(1, 8), positions=POSITIONS, rounds=5) -> list:
    "One row per method and batch: tokens/s, its ratio to rotary's in the same round, last 32 / first 32."
    if 'rotary' not in positions: raise ValueError(f"positions must include 'rotary' (the ratios' baseline), got {positions}")
    rows = []
    for b in batch_sizes:
        prompt = prompt_of(b)
        models = {p: make(p) for p in positions}
        cases = {p: (lambda s, lm=lm: lm.generate(prompt, NEW, streamer=s)) for p, lm in models.items()}
        runs = interleaved(cases, b, rounds)
        base = [b * NEW / r['cpu'] for r in runs['rotary']]
        for p in positions:
            st = stats(runs[p], b)
            ratio = [x / y for x, y in zip(st['rounds']['tok_s'], base)]
            rows.append(dict(position=p, batch=b, **st, over_rotary=summary(ratio),
                             wall=stats(runs[p], b, 'wall')['tok_s']))
            print(f"{p:9s} batch {b}: {st['tok_s']['median']:.0f} tok/s, {rows[-1]['over_rotary']['median']:.2f}x rotary, "
                  f"last {EDGE} / first {EDGE} {st['last_over_first']['median']:.2f}", flush=True)
    return rows


def hf_models(vocab=1024, hidden=256, heads=8, kv_heads=2, layers=4, intermediate=688, models=HF_MODELS):
    """transformers' Llama, Mistral (sliding window WINDOW) and Gemma 3 (sliding window WINDOW in all layers but every
    GEMMA3_PATTERN-th, its own rope bases) of the same tiny-but-not-trivial shape, random weights, float32; `models`: which."""
    import transformers
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Gemma3TextConfig,
                              Gemma3ForCausalLM)
    transformers.logging.set_verbosity_error()
    unknown = set(models) - set(HF_MODELS)
    if unknown: raise ValueError(f"models: {sorted(unknown)} are not among {HF_MODELS}")
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=PROMPT + NEW,
                 eos_token_id=None, bos_token_id=None, pad_token_id=None)
    make = {'llama': lambda: LlamaForCausalLM(LlamaConfig(**shape)),
            'mistral': lambda: MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **shape)),
            'gemma3': lambda: Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=WINDOW, sliding_window_pattern=GEMMA3_PATTERN,
                                                                 head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads,
                                                                 **shape))}
    out = {}
    for name in models:
        torch.manual_seed(0)
        hf = make[name]().eval()
        hf.generation_config.eos_token_id = hf.generation_config.pad_token_id = None   # every row runs NEW tokens
        out[name] = hf
    return out


def transformers_table(batch_sizes=(1, 8), rounds=5, models=HF_MODELS) -> list:
    "One row per model and batch: relpos (converted) and transformers' `generate`, interleaved; ratios per round."
    rows = []
    for name, hf in hf_models(models=models).items():
        lm = DecoderLM.from_transformers(hf).eval()
        for b in batch_sizes:
            prompt = prompt_of(b, hf.config.vocab_size)
            mask = torch.ones_like(prompt)
            cases = {'relpos': lambda s: lm.generate(prompt, NEW, streamer=s),
                     'transformers': lambda s: hf.generate(prompt, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                                           use_cache=True, streamer=s)}
            runs = interleaved(cases, b, rounds)
            same = all(torch.equal(runs['relpos'][i]['tokens'], runs['transformers'][i]['tokens']) for i in range(rounds))
            st = {k: stats(v, b) for k, v in runs.items()}
            ratio = [x / y for x, y in zip(st['relpos']['rounds']['tok_s'], st['transformers']['rounds']['tok_s'])]
            rows.append(dict(model=name, batch=b, relpos=st['relpos'], transformers=st['transformers'],
                             relpos_over_transformers=summary(ratio), same_tokens=same,
                             wall_ratio=summary([y['wall'] / x['wall'] for x, y in zip(runs['relpos'], runs['transformers'])])))
            print(f"{name:8s} batch {b}: relpos {st['relpos']['tok_s']['median']:.0f} tok/s, transformers "
                  f"{st['transformers']['tok_s']['median']:.0f} tok/s, ratio {rows[-1]['relpos_over_transformers']['median']:.2f}x; "
                  f"last/first relpos {st['relpos']['last_over_first']['median']:.2f}, transformers "
                  f"{st['transformers']['last_over_first']['median']:.2f}; same tokens {same}", flush=True)
    return rows


def _commit() -> str:
    "The checkout's commit, with '+changes' when its tracked files differ from it (what the numbers were measured on)."
    git = lambda *a: subprocess.run(['git', *a], cwd=OUT.parent, capture_output=True, text=True).stdout.strip()
    head = git('rev-parse', '--short', 'HEAD') or 'unknown'
    return head + ('+changes' if git('status', '--porcelain', '--untracked-files=no') else '')


def conditions(threads:int) -> dict:
    import os, transformers
    return dict(torch=torch.__version__, transformers=transformers.__version__, device='cpu', threads=threads,
                cpus=os.cpu_count(), clock='CPU time of the process', dtype='float32', commit=_commit(),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()),
                machine='shared with other jobs', load_average_at_start=round(os.getloadavg()[0], 1))


def config() -> dict:
    return dict(n_vocab=N_VOCAB, d_model=D_MODEL, heads=HEADS, n_layers=LAYERS, prompt=PROMPT, new=NEW, edge=EDGE,
                window=WINDOW, gemma3_pattern=GEMMA3_PATTERN, hf=dict(vocab=1024, hidden=256, heads=8, kv_heads=2, layers=4, intermediate=688))


def main(batch_sizes=(1, 8), rounds=5, store=True, threads=1, positions=POSITIONS, models=HF_MODELS):
    """Both tables, stored with their conditions; `threads` intra-op threads for the run (a decode step is many small ops).
    Only a whole run is stored: a subset of `positions` (rotary among them, the ratios' baseline; empty: no methods'
    table) or of `models` (some of HF_MODELS; empty: no transformers table) gives the tables without writing them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cond = conditions(threads)
        hf = transformers_table(batch_sizes, rounds, tuple(models)) if models else []
        rows = methods(batch_sizes, positions=tuple(positions), rounds=rounds) if positions else []
    finally:
        torch.set_num_threads(before)
    result = dict(conditions=cond, config=config(), rounds=rounds, methods=rows, transformers=hf)
    whole = tuple(positions) == tuple(POSITIONS) and tuple(models) == tuple(HF_MODELS) and tuple(batch_sizes) == (1, 8)
    if store and whole: OUT.write_text(json.dumps(result, indent=1))
    return markdown(result)


def _cell(s:dict, fmt:str) -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def markdown(result:dict) -> str:
    "The two tables of a stored result, each cell the median over the rounds (smallest–largest)."
    c, cfg = result['conditions'], result['config']
    lines = [f"**Greedy decoding with the cache per method: prompt {cfg['prompt']}, {cfg['new']} new tokens, d_model "
             f"{cfg['d_model']}, {cfg['heads']} heads, {cfg['n_layers']} layers**", '',
             f"| method | batch | tok/s | / rotary | last {cfg['edge']} / first {cfg['edge']} |", '|---|---|---|---|---|']
    lines += [f"| {r['position']} | {r['batch']} | {_cell(r['tok_s'], '.0f')} | {_cell(r['over_rotary'], '.2f')} | "
              f"{_cell(r['last_over_first'], '.2f')} |" for r in result['methods']]
    h = cfg['hf']
    if result['transformers']:   # a run of some methods only leaves it out
        gemma = any(r['model'] == 'gemma3' for r in result['transformers'])
        windows = "Mistral's window" + (f" and Gemma 3's (every layer but the {cfg['gemma3_pattern']}th)" if gemma else "")
        lines += ['', f"**Converted transformers models against transformers' generate (same weights): hidden {h['hidden']}, "
                      f"{h['heads']} heads ({h['kv_heads']} key/value), {h['layers']} layers, vocabulary {h['vocab']}; {windows} "
                      f"{cfg['window']}**", '',
                  '| model | batch | relpos tok/s | transformers tok/s | relpos / transformers | last / first, relpos | '
                  'last / first, transformers | same tokens |', '|---|---|---|---|---|---|---|---|']
    lines += [f"| {r['model']} | {r['batch']} | {_cell(r['relpos']['tok_s'], '.0f')} | {_cell(r['transformers']['tok_s'], '.0f')} | "
              f"{_cell(r['relpos_over_transformers'], '.2f')} | {_cell(r['relpos']['last_over_first'], '.2f')} | "
              f"{_cell(r['transformers']['last_over_first'], '.2f')} | {r['same_tokens']} |" for r in result['transformers']]
    lines += ['', f"torch {c['torch']}, transformers {c['transformers']}, {c['device']}, {c['threads']} thread(s), "
                  f"{c['dtype']}; time: {c['clock']}; median of {result['rounds']} interleaved rounds (smallest–largest); "
                  f"relpos at {c['commit']}, {c['date']}; {c['machine']}"]
    return '\n'.join(lines)


if __name__ == '__main__':   # `python -m bench.decode --positions xpos rotary --models`: a part of the run, printed only
    ap = argparse.ArgumentParser(description="The decode benchmark; with a subset of --positions or --models a partial run, printed only.")
    ap.add_argument('--positions', nargs='*', default=list(POSITIONS), choices=POSITIONS,
                    help="methods (rotary among them); none given: no methods' table")
    ap.add_argument('--models', nargs='*', default=list(HF_MODELS), choices=HF_MODELS,
                    help="transformers models to compare; none given: no transformers table")
    ap.add_argument('--batch', nargs='+', type=int, default=[1, 8], help="batch sizes")
    ap.add_argument('--rounds', type=int, default=5)
    a = ap.parse_args()
    print(main(tuple(a.batch), a.rounds, positions=tuple(a.positions), models=tuple(a.models)))

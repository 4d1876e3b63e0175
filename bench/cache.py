"""Benchmark for `relpos.cache` (nbs/09a_cache.ipynb): `DecoderLM.generate` with the K/V cache and with the hidden-state
memory (`use_cache=False`), per position method, timed step by step; and `DecoderLM(position='rotary').generate` against
transformers' `LlamaForCausalLM.generate(use_cache=True)` of the same width, depth and heads, in the same run.
CPU, float32, prompt 128, 256 new tokens, d_model 256, 4 heads, 4 layers, vocabulary 256. Writes nbs/data/cache_bench.json."""
import json, statistics, time
from pathlib import Path
import torch
from relpos.models import DecoderLM, POSITIONS
import relpos.cache  # noqa: F401  (DecoderLM's cached methods)

N_VOCAB, D_MODEL, HEADS, LAYERS, PROMPT, NEW = 256, 256, 4, 4, 128, 256
OUT = Path(__file__).resolve().parent.parent / 'nbs' / 'data' / 'cache_bench.json'


def make(position):
    "A `DecoderLM` of the default sizes; `max_len` covers prompt + new tokens (the `absolute` table)."
    torch.manual_seed(0)
    return DecoderLM(N_VOCAB, d_model=D_MODEL, heads=HEADS, n_layers=LAYERS, position=position, max_len=PROMPT + NEW).eval()


def prompt_of(batch):
    return torch.randint(0, N_VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


class Decoder:
    "One row-batch being decoded greedily, cached (`generate(use_cache=True)`'s loop) or not (the hidden-state memory of `use_cache=False`)."
    def __init__(self, lm, prompt, use_cache, max_cache_len=PROMPT + NEW - 1):
        self.lm, self.use_cache = lm, use_cache
        with torch.no_grad():
            if use_cache:
                self.cache = lm.new_cache(prompt.shape[0], max_cache_len)
                q_pos, valid = lm._cache_positions(self.cache, prompt.shape[1], None, None, None)
                self.logits = lm._cached_run(prompt, self.cache, q_pos, valid, last_only=True)[:, -1]
            else:
                logits, self.memory = lm._run(prompt, None, None)
                self.logits = logits[:, -1]

    @torch.no_grad()
    def step(self) -> float:
        "One new token; returns its time in seconds."
        s = time.perf_counter()
        nxt = self.logits.argmax(-1, keepdim=True)
        if self.use_cache:
            self.logits = self.lm._cached_run(nxt, self.cache, self.cache.next_position[:, None], None)[:, -1]
        else:
            logits, self.memory = self.lm._run(nxt, self.memory, None)
            self.logits = logits[:, -1]
        return time.perf_counter() - s


def generate_seconds(lm, prompt, use_cache):
    "Wall time of greedy `generate` of NEW tokens after `prompt`."
    s = time.perf_counter()
    lm.generate(prompt, NEW, temperature=0, use_cache=use_cache)
    return time.perf_counter() - s


def interleaved_steps(lm, prompts, use_cache, steps, rounds):
    """Per-token seconds of `steps` decode steps after each prompt of `prompts` (different lengths), the prompts' steps
    interleaved one by one so that a busy machine slows them alike; each step keeps its fastest of `rounds` rounds.
    Returns one list of `steps` times per prompt."""
    best = [[float('inf')] * steps for _ in prompts]
    for _ in range(rounds):
        decoders = [Decoder(lm, p, use_cache) for p in prompts]
        for i in range(steps):
            order = range(len(prompts)) if i % 2 == 0 else reversed(range(len(prompts)))
            for j in order: best[j][i] = min(best[j][i], decoders[j].step())
    return best


def llama(batch_sizes=(1, 8), rounds=3):
    "Tokens/s of `DecoderLM(position='rotary').generate` and of transformers' Llama `generate(use_cache=True)`, interleaved; fastest round each."
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    transformers.logging.set_verbosity_error()
    lm = make('rotary')
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=N_VOCAB, hidden_size=D_MODEL, intermediate_size=4 * D_MODEL, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=PROMPT + NEW)
    hf = LlamaForCausalLM(cfg).eval()
    out = dict(transformers=transformers.__version__, relpos_params=sum(p.numel() for p in lm.parameters()),
               llama_params=sum(p.numel() for p in hf.parameters()), by_batch={})
    for b in batch_sizes:
        prompt = prompt_of(b)
        mask = torch.ones_like(prompt)
        best = dict(relpos=float('inf'), llama=float('inf'))
        for _ in range(rounds):
            s = time.perf_counter(); got = lm.generate(prompt, NEW, temperature=0, use_cache=True)
            best['relpos'] = min(best['relpos'], time.perf_counter() - s)
            s = time.perf_counter()
            with torch.no_grad():
                ref = hf.generate(prompt, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  use_cache=True, pad_token_id=0)
            best['llama'] = min(best['llama'], time.perf_counter() - s)
            assert got.shape == ref.shape == (b, PROMPT + NEW)
        out['by_batch'][str(b)] = dict(relpos_tok_s=b * NEW / best['relpos'], llama_tok_s=b * NEW / best['llama'])
        print(f"batch {b}: relpos rotary {b * NEW / best['relpos']:.0f} tok/s, transformers Llama {b * NEW / best['llama']:.0f} tok/s",
              flush=True)
    return out


def per_method(batch_sizes=(1, 8), positions=POSITIONS, contexts=(128, 192, 256, 320, 376), steps=8, rounds=5,
               uncached_rounds=2):
    """Per method and batch: tokens/s of `generate` cached (fastest of 2) and uncached (one run); the time of a token at each
    context of `contexts` (median of `steps` steps, each the fastest of `rounds` rounds -- `uncached_rounds` without the
    cache --, contexts interleaved); and the first and last 32 tokens of the benchmark's generation (contexts 128..159 and
    351..382), timed the same way against each other."""
    table, per_token = [], {str(b): {} for b in batch_sizes}
    for b in batch_sizes:
        long = torch.randint(0, N_VOCAB, (b, PROMPT + NEW), generator=torch.Generator().manual_seed(2))
        for p in positions:
            lm = make(p)
            Decoder(lm, long[:, :16], True).step()                       # warm-up
            total_c = min(generate_seconds(lm, long[:, :PROMPT], True) for _ in range(2))
            total_u = generate_seconds(lm, long[:, :PROMPT], False)
            first, last = interleaved_steps(lm, [long[:, :PROMPT], long[:, :PROMPT + NEW - 32 - 1]], True, 32, rounds)
            f32, l32 = statistics.median(first), statistics.median(last)
            curve = {}
            for use_cache in (True, False):
                ts = interleaved_steps(lm, [long[:, :c] for c in contexts], use_cache, steps, rounds if use_cache else uncached_rounds)
                curve['cached_ms' if use_cache else 'uncached_ms'] = [1e3 * statistics.median(t) for t in ts]
            per_token[str(b)][p] = dict(context=list(contexts), **curve)
            table.append(dict(position=p, batch=b, cached_tok_s=b * NEW / total_c, uncached_tok_s=b * NEW / total_u,
                              first32_ms=1e3 * f32, last32_ms=1e3 * l32, last_over_first=l32 / f32))
            print(f"{p:9s} batch {b}: cached {table[-1]['cached_tok_s']:.0f} tok/s, uncached {table[-1]['uncached_tok_s']:.0f} tok/s, "
                  f"last 32 / first 32 {table[-1]['last_over_first']:.2f}", flush=True)
    return table, per_token


ATTENTION_OPS = ('aten::_scaled_dot_product_flash_attention_for_cpu', 'aten::_scaled_dot_product_attention_math', 'aten::bmm')
LINEAR_OPS = ('aten::addmm', 'aten::mm')


def step_profile(lm, prompt, steps=5, rounds=4, warmup=2) -> dict:
    """Where a cached decode step's time goes after `prompt`: torch.profiler's self time per step (ms) of the attention
    products (SDPA's kernel, and the batched matmuls: Shaw's q·K and p·V, XL's q·R), of the linear layers (`addmm`, `mm`:
    projections, feed-forward, head) and of every other op; each class the fastest of `rounds` rounds of `steps` steps,
    each round from a fresh prefill (the context stays within `prompt` + `warmup` + `steps`)."""
    from torch.profiler import profile, ProfilerActivity
    best = dict(attention_ms=float('inf'), linear_ms=float('inf'), other_ms=float('inf'))
    for _ in range(rounds):
        d = Decoder(lm, prompt, True)
        for _ in range(warmup): d.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps): d.step()
        got = dict(attention_ms=0.0, linear_ms=0.0, other_ms=0.0)
        for e in prof.key_averages():
            k = 'attention_ms' if e.key in ATTENTION_OPS else 'linear_ms' if e.key in LINEAR_OPS else 'other_ms'
            got[k] += e.self_cpu_time_total / 1e3 / steps
        best = {k: min(best[k], got[k]) for k in best}
    return best


def step_profiles(batch=8, positions=POSITIONS, contexts=(PROMPT, PROMPT + NEW - 8)) -> dict:
    "`step_profile` of every method at a short and a long context (batch `batch`)."
    long = torch.randint(0, N_VOCAB, (batch, PROMPT + NEW), generator=torch.Generator().manual_seed(2))
    out = dict(batch=batch, context=list(contexts), by_method={})
    for p in positions:
        lm = make(p)
        out['by_method'][p] = [step_profile(lm, long[:, :c]) for c in contexts]
        a, z = out['by_method'][p]
        print(f"{p:9s} batch {batch} step profile, context {contexts[0]} -> {contexts[1]}: "
              + ', '.join(f"{k[:-3]} {a[k]:.2f} -> {z[k]:.2f} ms" for k in a), flush=True)
    return out


def config() -> dict:
    return dict(n_vocab=N_VOCAB, d_model=D_MODEL, heads=HEADS, n_layers=LAYERS, prompt=PROMPT, new=NEW)


def main(batch_sizes=(1, 8), store=True, threads=1):
    "Both tables; `threads` intra-op threads for the whole run (1: a decode step is many small ops, which a shared machine's thread wake-ups would dominate)."
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        hf = llama(batch_sizes)
        table, per_token = per_method(batch_sizes)
        profiles = step_profiles(max(batch_sizes))
    finally:
        torch.set_num_threads(before)
    note = (f"torch {torch.__version__}, cpu, {threads} threads; float32, prompt {PROMPT}, {NEW} new tokens (greedy), "
            f"d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers, vocabulary {N_VOCAB}; tokens/s: generate, cached fastest of 2, "
            f"uncached one run; per-token times: steps interleaved, each the fastest of 5 rounds (uncached: 2); step profile: "
            f"torch.profiler self time per step, fastest of 4 rounds of 5 steps; measured on a machine shared with other jobs")
    result = dict(title=f"Time per generated token against the context: prompt {PROMPT}, {NEW} new tokens, d_model {D_MODEL}, "
                        f"{HEADS} heads, {LAYERS} layers (CPU, float32)",
                  note=note, table=table, per_token=per_token, llama=hf, step_profile=profiles, config=config())
    if store: OUT.write_text(json.dumps(result, indent=1))
    return markdown(result)


def markdown(result:dict) -> str:
    "The tables of a result (as `main` stores it in nbs/data/cache_bench.json)."
    table, hf, note = result['table'], result['llama'], result['note']
    lines = ['**Generation: tokens/s per method, with the K/V cache and with the hidden-state memory (use_cache=False)**', '',
             '| method | batch | cached tok/s | uncached tok/s | cached / uncached | last 32 / first 32 (cached) |',
             '|---|---|---|---|---|---|']
    lines += [f"| {r['position']} | {r['batch']} | {r['cached_tok_s']:.0f} | {r['uncached_tok_s']:.0f} | "
              f"{r['cached_tok_s'] / r['uncached_tok_s']:.1f}× | {r['last_over_first']:.2f} |" for r in table]
    lines += ['', f"**DecoderLM(position='rotary').generate against transformers {hf['transformers']} LlamaForCausalLM.generate"
                  f"(use_cache=True)** (parameters: relpos {hf['relpos_params']:,}, Llama {hf['llama_params']:,})", '',
              '| batch | relpos tok/s | Llama tok/s | relpos / Llama |', '|---|---|---|---|']
    lines += [f"| {b} | {x['relpos_tok_s']:.0f} | {x['llama_tok_s']:.0f} | {x['relpos_tok_s'] / x['llama_tok_s']:.2f}× |"
              for b, x in hf['by_batch'].items()]
    if 'step_profile' in result:
        sp = result['step_profile']
        c0, c1 = sp['context']
        lines += ['', f"**Where a cached decode step's time goes, batch {sp['batch']}, context {c0} → {c1}** (ms per step, profiler self time)", '',
                  '| method | attention (SDPA, bmm) | linear layers (addmm, mm) | other ops | step |', '|---|---|---|---|---|']
        for p, (a, z) in sp['by_method'].items():
            lines.append(f"| {p} | " + ' | '.join(f"{a[k]:.2f} → {z[k]:.2f}" for k in ('attention_ms', 'linear_ms', 'other_ms'))
                         + f" | {sum(a.values()):.2f} → {sum(z.values()):.2f} |")
    return '\n'.join(lines + ['', note])


if __name__ == '__main__':
    print(main())

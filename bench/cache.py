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


@torch.no_grad()
def step_times(lm, prompt, new=NEW, use_cache=True):
    """Greedy decoding as `generate` runs it, timed step by step: `(total seconds, per-token seconds [new - 1])`.
    The cached loop is `generate(use_cache=True)`'s (prefill, then one position per token); the uncached one keeps every
    layer's inputs (`use_cache=False`) and projects them again at every token."""
    times = []
    t0 = time.perf_counter()
    if use_cache:
        b, n = prompt.shape
        cache = lm.new_cache(b, n + new - 1)
        q_pos, valid = lm._cache_positions(cache, n, None, None, None)
        logits = lm._cached_run(prompt, cache, q_pos, valid, last_only=True)[:, -1]
        for t in range(new - 1):
            s = time.perf_counter()
            nxt = logits.argmax(-1, keepdim=True)
            logits = lm._cached_run(nxt, cache, cache.next_position[:, None], None)[:, -1]
            times.append(time.perf_counter() - s)
    else:
        logits, memory = lm._run(prompt, None, None)
        logits = logits[:, -1]
        for t in range(new - 1):
            s = time.perf_counter()
            nxt = logits.argmax(-1, keepdim=True)
            logits, memory = lm._run(nxt, memory, None)
            logits = logits[:, -1]
            times.append(time.perf_counter() - s)
    return time.perf_counter() - t0, times


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


def per_method(batch_sizes=(1, 8), positions=POSITIONS, window=16):
    "Per method and batch: tokens/s cached and uncached, the per-token time against the context (medians over `window` steps)."
    table, per_token = [], {str(b): {} for b in batch_sizes}
    for b in batch_sizes:
        prompt = prompt_of(b)
        for p in positions:
            lm = make(p)
            step_times(lm, prompt[:, :16], 8)                # warm-up
            total_c, tc = step_times(lm, prompt, use_cache=True)
            total_u, tu = step_times(lm, prompt, use_cache=False)
            f32, l32 = statistics.median(tc[:32]), statistics.median(tc[-32:])
            table.append(dict(position=p, batch=b, cached_tok_s=b * NEW / total_c, uncached_tok_s=b * NEW / total_u,
                              first32_ms=1e3 * f32, last32_ms=1e3 * l32, last_over_first=l32 / f32))
            med = lambda ts: [1e3 * statistics.median(ts[i:i + window]) for i in range(0, len(ts) - window + 1, window)]
            per_token[str(b)][p] = dict(context=[PROMPT + i + window // 2 for i in range(0, len(tc) - window + 1, window)],
                                        cached_ms=med(tc), uncached_ms=med(tu))
            print(f"{p:9s} batch {b}: cached {table[-1]['cached_tok_s']:.0f} tok/s, uncached {table[-1]['uncached_tok_s']:.0f} tok/s, "
                  f"last 32 / first 32 {table[-1]['last_over_first']:.2f}", flush=True)
    return table, per_token


def main(batch_sizes=(1, 8), store=True):
    threads = torch.get_num_threads()
    hf = llama(batch_sizes)
    table, per_token = per_method(batch_sizes)
    note = (f"torch {torch.__version__}, cpu, {threads} threads; float32, prompt {PROMPT}, {NEW} new tokens (greedy), "
            f"d_model {D_MODEL}, {HEADS} heads, {LAYERS} layers, vocabulary {N_VOCAB}; one run per method, measured on a "
            f"machine shared with other jobs")
    result = dict(title=f"Time per generated token against the context: prompt {PROMPT}, {NEW} new tokens, d_model {D_MODEL}, "
                        f"{HEADS} heads, {LAYERS} layers (CPU, float32)",
                  note=note, table=table, per_token=per_token, llama=hf)
    if store: OUT.write_text(json.dumps(result, indent=1))
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
    return '\n'.join(lines + ['', note])


if __name__ == '__main__':
    print(main())

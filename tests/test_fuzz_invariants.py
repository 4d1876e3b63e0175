"""Property test: invariants every `DecoderLM` configuration must keep exactly (float64, <= 1e-10).

hypothesis draws a small valid configuration for each position method (norms, feed-forward blocks, biases, grouped
key/value heads, qk-norm, layer types with sliding windows and chunks, per-type positions, NoPE layers, softcaps,
query temperature, memory length, kNN layers, tied embeddings, ...), perturbs every parameter (zeros and ones hide bugs), then checks:
1. cached decoding (a prefill, then one token at a time) equals the full forward, and greedy `generate` is the same
   with and without the cache;
2. left padding with `attention_mask` (and the position ids that skip the padding) equals the unpadded row, in the
   full forward and in the cached prefill; a model that cannot honour it must refuse, never differ (not checked with
   `query_temperature`, which counts the padding as transformers' Llama 4 does);
3. a row's logits do not depend on the other rows of the batch;
4. `save_pretrained` / `from_pretrained`, `copy.deepcopy`, `pickle` and `DecoderLM(**to_config())` keep the logits;
5. `to_transformers()`, where it converts, gives the same logits (transformers' float32 steps in float64);
6. eval, train mode (every dropout 0), `no_grad` and `inference_mode` give the same logits;
7. a Transformer-XL memory holding the whole first segment gives the one-pass logits of the second.
Derandomized, no example database: the same examples on every run (`RELPOS_FUZZ_EXAMPLES` sets how many)."""
import copy, io, math, os, pickle, warnings
from collections import Counter
import pytest
import torch
from hypothesis import given, settings, HealthCheck, strategies as st, reject, note

from relpos.models import (DecoderLM, POSITIONS, GQA_POSITIONS, BIAS_POSITIONS, SOFTCAP_POSITIONS, FFNS, QK_NORMS,
                           KNN_LOCAL_POSITIONS)

TOL = 1e-10
V = 20
# RELPOS_FUZZ_EXAMPLES=100: a deeper search (minutes), e.g. after adding a switch
FUZZ = settings(max_examples=int(os.environ.get('RELPOS_FUZZ_EXAMPLES', 15)), deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))
MHA_POSITIONS = tuple(p for p in POSITIONS if p != 'shaw')   # relpos.mha.MultiHeadAttention subclasses: qk_norm, bias switches
SEEN = Counter()


@st.composite
def configs(draw, position):
    "Keyword arguments of a tiny valid `DecoderLM` with `position`, and a seed for its parameters."
    heads = draw(st.sampled_from([1, 2, 4]))
    d_model = draw(st.sampled_from([16, 24, 32]))
    n_layers = draw(st.integers(1, 3))
    kw = dict(n_vocab=V, d_model=d_model, heads=heads, n_layers=n_layers, d_ff=draw(st.sampled_from([8, 24])),
              position=position, max_len=16)
    kw['norm'] = draw(st.sampled_from(['layer', 'rms']))
    kw['ffn'] = draw(st.sampled_from(FFNS))
    if position in BIAS_POSITIONS: kw['bias'] = draw(st.booleans())
    if draw(st.booleans()): kw['qkv_bias'] = draw(st.booleans()) if position in BIAS_POSITIONS else True
    if draw(st.booleans()): kw['output_bias'] = draw(st.booleans())
    if draw(st.booleans()): kw['head_bias'] = draw(st.booleans())
    if position in GQA_POSITIONS and draw(st.booleans()):
        kw['kv_heads'] = draw(st.sampled_from([k for k in (1, 2) if heads % k == 0]))
        if draw(st.booleans()): kw['head_dim'] = draw(st.sampled_from([4, 8]))
    if position in MHA_POSITIONS and draw(st.booleans()): kw['qk_norm'] = draw(st.sampled_from(QK_NORMS[1:]))
    # layer types: full, sliding, chunked
    kinds = draw(st.lists(st.sampled_from(['full_attention', 'sliding_attention', 'chunked_attention']),
                          min_size=n_layers, max_size=n_layers))
    if draw(st.booleans()):
        kw['layer_types'] = kinds
        if 'sliding_attention' in kinds: kw['sliding_window'] = draw(st.integers(1, 6))
        if 'chunked_attention' in kinds: kw['attention_chunk_size'] = draw(st.integers(1, 6))
    elif draw(st.booleans()):
        if draw(st.booleans()): kw['sliding_window'] = draw(st.integers(1, 6))
        else: kw['attention_chunk_size'] = draw(st.integers(1, 6))
    if kw.get('layer_types') and draw(st.booleans()):
        kind = draw(st.sampled_from(sorted(set(kw['layer_types']))))
        other = draw(st.sampled_from(GQA_POSITIONS if 'kv_heads' in kw or 'head_dim' in kw else
                                     tuple(p for p in POSITIONS if p not in ('absolute',))))
        own = {'position': other}
        if other == 'rotary' and draw(st.booleans()): own = {'position': other, 'base': 100.0}
        kw['layer_positions'] = {kind: own}
    if position != 'absolute' and n_layers > 1 and draw(st.booleans()):
        kw['nope_layers'] = tuple(sorted(draw(st.sets(st.integers(0, n_layers - 1), min_size=1, max_size=n_layers - 1))))
    if position in SOFTCAP_POSITIONS:
        if draw(st.booleans()): kw['attn_softcap'] = draw(st.sampled_from([0.5, 3.0]))
        if draw(st.booleans()): kw['score_scale'] = 0.3
        if draw(st.booleans()): kw['query_temperature'] = (draw(st.sampled_from([1, 2, 3])), 0.4)
    if draw(st.booleans()): kw['logit_softcap'] = draw(st.sampled_from([0.7, 4.0]))
    if draw(st.booleans()): kw['embed_scale'] = math.sqrt(d_model)
    if draw(st.booleans()): kw['norm_offset'] = 1.0
    kw['parallel_residual'] = draw(st.booleans())
    kw['pre_norm'] = draw(st.booleans()) or kw['parallel_residual']
    kw['post_norm'] = draw(st.booleans())
    if kw['parallel_residual'] and draw(st.booleans()): kw['shared_norm'] = True
    if draw(st.booleans()): kw['embedding_norm'] = True
    if draw(st.booleans()): kw['tie_embeddings'] = True
    if position != 'absolute' and draw(st.booleans()): kw['mem_len'] = draw(st.integers(1, 6))
    if position == 'kerple': kw['kernel'] = draw(st.sampled_from(['log', 'power']))
    if position == 'shaw': kw['k'] = draw(st.integers(1, 4))
    if position in KNN_LOCAL_POSITIONS and draw(st.integers(0, 4)) == 0:   # kNN layers: every call starts with empty memories
        kw.update(memorizing_layers=(draw(st.integers(0, n_layers - 1)),), knn_capacity=64, top_k=draw(st.integers(1, 4)))
    return kw, draw(st.integers(0, 2 ** 16))


def build(kw, seed):
    "The model in float64 and eval mode with every parameter perturbed; None (reject) where the constructor refuses."
    torch.manual_seed(seed)
    try: lm = DecoderLM(**kw)
    except ValueError as e:
        note(f"refused: {e}")
        reject()
    lm = lm.double().eval()
    with torch.no_grad():
        for name, p in lm.named_parameters(): p.add_(0.2 * torch.randn_like(p))
    SEEN[kw['position']] += 1
    return lm


def tokens(seed, b, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, n), generator=g)


def close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= TOL, f"{what}: max abs error {err:.3g}"


def logits(lm, t, **kw):
    "The logits of a call that starts every document (kNN memories emptied first)."
    lm.release_knn_memory()
    return lm(t, **kw)[0]


# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_cached_decoding_equals_full_forward(position, data):
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    n, k = data.draw(st.integers(2, 12)), None
    k = data.draw(st.integers(1, n - 1))
    t = tokens(seed, 2, n)
    full = logits(lm, t)
    if not lm.supports_cache(): return
    cache = lm.new_cache(2, n)
    parts = [lm(t[:, :k], cache=cache)[0]] + [lm(t[:, j:j + 1], cache=cache)[0] for j in range(k, n)]
    close(torch.cat(parts, 1), full, f"cached (prefill {k}, then one by one) vs full forward")
    new = data.draw(st.integers(1, 3))
    prompt = t[:, :max(1, n - new)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        lm.release_knn_memory(); a = lm.generate(prompt, new, temperature=0, use_cache=True)
        lm.release_knn_memory(); b = lm.generate(prompt, new, temperature=0, use_cache=False)
    assert torch.equal(a, b), "greedy generate: cache vs no cache"


@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_left_padding_equals_unpadded(position, data):
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    # Llama 4's query temperature counts the stream index, padding included, as transformers' `cache_position` does
    # (tests/test_hf_families.py checks left-padded Llama 4 against transformers): not padding-invariant, by choice
    if lm.query_temperature is not None: return
    n, p = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4))
    # a batch of two: row 0 left-padded by p, row 1 without padding
    t, full_row = tokens(seed, 1, n), tokens(seed + 3, 1, p + n)
    padded = torch.cat((torch.cat((tokens(seed + 1, 1, p), t), 1), full_row))
    mask = torch.ones(2, p + n, dtype=torch.long); mask[0, :p] = 0
    ids = (mask.cumsum(-1) - 1).clamp(min=0)
    def check(out, what):
        close(out[:1, p:], logits(lm, t), what + ", padded row")
        close(out[1:], logits(lm, full_row), what + ", unpadded row")
    try: out = logits(lm, padded, attention_mask=mask, position_ids=ids)
    except (TypeError, ValueError) as e:
        assert 'position_ids' in str(e), e
        try: out = logits(lm, padded, attention_mask=mask)   # a method whose positions are the index's: only the mask
        except (TypeError, ValueError) as e:
            assert 'attention_mask' in str(e), e
            out = None
    if out is not None: check(out, "left padding (attention_mask, position_ids) vs none")
    if not lm.supports_cache(): return
    cache = lm.new_cache(2, p + n + 2)
    try: pre = lm(padded, cache=cache, attention_mask=mask)[0]
    except (TypeError, ValueError) as e:
        assert 'attention_mask' in str(e), e
        return
    nxt = tokens(seed + 2, 2, 2)
    got = torch.cat([pre] + [lm(nxt[:, j:j + 1], cache=cache)[0] for j in range(2)], 1)
    close(got[:1, p:], logits(lm, torch.cat((t, nxt[:1]), 1)), "cache: left padded prefill then steps vs unpadded")
    close(got[1:], logits(lm, torch.cat((full_row, nxt[1:]), 1)), "cache: the unpadded row beside a padded one")


@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_batch_independence(position, data):
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    n = data.draw(st.integers(1, 12))
    t = tokens(seed, 3, n)
    close(logits(lm, t)[1:2], logits(lm, t[1:2]), "row 1 in a batch of 3 vs alone")
    if lm.mem_len and not lm.memorizing_layers:   # and the memory it returns: the next segment's logits too
        (_, m3), (_, m1) = lm(t), lm(t[1:2])
        u = tokens(seed + 1, 3, 2)
        close(lm(u, memory=m3)[0][1:2], lm(u[1:2], memory=m1)[0], "after memory: row 1 in a batch of 3 vs alone")
    if lm.memorizing_layers:   # the kNN memories: a row's second segment reads only its own first one
        u = tokens(seed + 1, 3, 3)
        lm.release_knn_memory(); lm(t); b3 = lm(u)[0][1:2]
        lm.release_knn_memory(); lm(t[1:2]); b1 = lm(u[1:2])[0]
        close(b3, b1, "after the kNN memory: row 1 in a batch of 3 vs alone")


@pytest.mark.parametrize('position', [p for p in POSITIONS if p != 'absolute'])
@FUZZ
@given(data=st.data())
def test_memory_equals_one_pass(position, data):
    "With a memory that holds all of the first segment, the second segment's logits are the one-pass forward's."
    kw, seed = data.draw(configs(position))
    n1, n2 = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    kw = {**kw, 'mem_len': n1 + data.draw(st.integers(0, 2))}
    if kw.get('attention_chunk_size'): return   # chunks count from the first token: refused with a memory
    kw.pop('memorizing_layers', None)           # a kNN layer retrieves the first segment besides attending it
    lm = build(kw, seed)
    t = tokens(seed, 2, n1 + n2)
    _, memory = lm(t[:, :n1])
    close(lm(t[:, n1:], memory=memory)[0], logits(lm, t)[:, n1:], "second segment after the memory vs one pass")


@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_copies_keep_logits(position, data, tmp_path_factory):
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    t = tokens(seed, 2, data.draw(st.integers(1, 12)))
    ref = logits(lm, t)
    d = tmp_path_factory.mktemp('lm')
    lm.save_pretrained(d)
    close(logits(DecoderLM.from_pretrained(d), t), ref, "save_pretrained / from_pretrained")
    close(logits(copy.deepcopy(lm), t), ref, "copy.deepcopy")
    close(logits(pickle.loads(pickle.dumps(lm)), t), ref, "pickle")
    buf = io.BytesIO(); torch.save(lm.state_dict(), buf); buf.seek(0)
    fresh = DecoderLM(**lm.to_config()).double().eval()
    fresh.load_state_dict(torch.load(buf))
    close(logits(fresh, t), ref, "DecoderLM(**to_config()) + state_dict")


@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_modes_keep_logits(position, data):
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    t = tokens(seed, 2, data.draw(st.integers(1, 12)))
    ref = logits(lm, t)
    with torch.no_grad(): close(logits(lm, t), ref, "no_grad")
    with torch.inference_mode(): close(logits(lm, t), ref, "inference_mode")
    lm.train()
    close(logits(lm, t), ref, "train mode, dropout 0")
    # dropouts in eval mode: nothing dropped
    drop = DecoderLM(**{**kw, 'dropout': 0.3, 'embedding_dropout': 0.2}).double()
    drop.load_state_dict(lm.state_dict())
    close(logits(drop.eval(), t), ref, "eval mode with dropout 0.3")


transformers = pytest.importorskip("transformers")
from test_modern import float32_as_float64
CONVERTED = Counter()


# the layouts transformers has (GPT-2, BLOOM, GPT-NeoX, GPT-J, Falcon, LLaMA and its relatives): random configurations
# almost never land on one, so each starts from a template, then hypothesis varies the sizes and some switches
TEMPLATES = {
    'gpt2': dict(position='absolute', norm='layer', ffn='gelu_tanh', head_bias=False),
    'bloom': dict(position='alibi', norm='layer', ffn='bloom_gelu', head_bias=False, embedding_norm=True, d_ff=None),
    'neox': dict(position='rotary', norm='layer', ffn='gelu', head_bias=False, parallel_residual=True),
    'gptj': dict(position='rotary', norm='layer', ffn='gelu_tanh', parallel_residual=True, shared_norm=True, qkv_bias=False,
                 output_bias=False, interleaved=True),
    'falcon': dict(position='rotary', norm='layer', ffn='gelu', head_bias=False, parallel_residual=True, shared_norm=True),
    'llama': dict(position='rotary', norm='rms', ffn='swiglu', bias=False),
    'mistral': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, sliding_window=3),
    'qwen2': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, qkv_bias=True,
                  layer_types=['sliding_attention', 'full_attention'], sliding_window=2),
    'qwen3': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, qk_norm='head'),
    'olmo2': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, qk_norm='full', pre_norm=False, post_norm=True),
    'gemma': dict(position='rotary', norm='rms', ffn='geglu', bias=False, norm_offset=1.0, tie_embeddings=True),
    'gemma2': dict(position='rotary', norm='rms', ffn='geglu', bias=False, norm_offset=1.0, post_norm=True, attn_softcap=5.0,
                   logit_softcap=3.0, score_scale=0.25, layer_types=['sliding_attention', 'full_attention'], sliding_window=3),
    'gemma3': dict(position='rotary', norm='rms', ffn='geglu', bias=False, norm_offset=1.0, post_norm=True, qk_norm='head',
                   score_scale=0.25, layer_types=['sliding_attention', 'full_attention'], sliding_window=3,
                   layer_positions={'sliding_attention': dict(base=100.0)}),
    'smollm3': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, nope_layers=(1,)),
    'llama4': dict(position='rotary', norm='rms', ffn='swiglu', bias=False, interleaved=True, nope_layers=(1,),
                   layer_types=['chunked_attention', 'full_attention'], attention_chunk_size=3, qk_norm='head_unscaled',
                   layer_positions={'full_attention': dict(qk_norm=None, query_temperature=(2, 0.3))}),
}


@st.composite
def hf_configs(draw, family):
    "A `DecoderLM` of transformers' `family`: the template's switches, random sizes, and now and then one more switch."
    kw = dict(TEMPLATES[family])
    heads = draw(st.sampled_from([2, 4]))
    kw.update(n_vocab=V, d_model=draw(st.sampled_from([16, 32])), heads=heads, n_layers=2, max_len=16,
              d_ff=kw.get('d_ff', draw(st.sampled_from([8, 24]))), norm_eps=draw(st.sampled_from([1e-5, 1e-6])))
    if family.startswith('gemma'): kw['embed_scale'] = math.sqrt(kw['d_model'])
    if kw['position'] == 'rotary' and draw(st.booleans()):
        kw['kv_heads'] = draw(st.sampled_from([1, heads]))
    if kw['position'] == 'rotary' and family not in ('gemma3',) and draw(st.booleans()): kw['base'] = 500.0
    if draw(st.booleans()): kw['tie_embeddings'] = not kw.get('tie_embeddings', False)
    if draw(st.integers(0, 3)) == 0:   # one switch more: the class then refuses, or converts it
        extra = draw(st.sampled_from(['logit_softcap', 'embed_scale', 'output_bias', 'post_norm', 'head_bias']))
        kw[extra] = {'logit_softcap': 2.0, 'embed_scale': 4.0, 'output_bias': True, 'post_norm': True, 'head_bias': True}[extra]
    return kw, draw(st.integers(0, 2 ** 16))


@pytest.mark.parametrize('family', list(TEMPLATES))
@FUZZ
@given(data=st.data())
def test_to_transformers_same_logits(family, data):
    kw, seed = data.draw(hf_configs(family))
    lm = build(kw, seed)
    t = tokens(seed, 2, data.draw(st.integers(1, 12)))
    ref = logits(lm, t)
    with float32_as_float64():
        try: hf = lm.to_transformers()
        except ValueError as e:
            assert str(e).startswith('to_transformers'), e
            note(f"to_transformers refused: {e}")
            return
        CONVERTED[f"{family}->{type(hf).__name__}"] += 1
        hf = hf.double().eval()
        with torch.no_grad(): out = hf(input_ids=t).logits
    close(out, ref, f"to_transformers ({type(hf).__name__})")


@pytest.mark.parametrize('position', POSITIONS)
@FUZZ
@given(data=st.data())
def test_to_transformers_refuses_or_agrees(position, data):
    "Any configuration: to_transformers converts it exactly or refuses with a ValueError, never another error."
    kw, seed = data.draw(configs(position))
    lm = build(kw, seed)
    t = tokens(seed, 2, data.draw(st.integers(1, 12)))
    ref = logits(lm, t)
    with float32_as_float64():
        try: hf = lm.to_transformers()
        except ValueError as e:
            assert str(e).startswith('to_transformers'), e
            return
        CONVERTED[f"{position}->{type(hf).__name__}"] += 1
        hf = hf.double().eval()
        with torch.no_grad(): out = hf(input_ids=t).logits
    close(out, ref, f"to_transformers ({type(hf).__name__})")


def test_report_coverage():
    "Not a check: prints how many configurations each position got (run with -s)."
    print('\nconfigurations per position:', dict(SEEN), '\nconverted to transformers:', dict(CONVERTED))

"""The way back for LLaMA's relatives: `DecoderLM.to_transformers()` builds Mistral, Qwen2, Qwen3, OLMo 2, Phi-3, Gemma,
Gemma 2, Gemma 3 (text), SmolLM3 and Llama 4 (dense text) from the switches the model uses, not from where it came from.
Against transformers in float64 (its float32 steps in float64, see test_modern.float32_as_float64): every family of
test_hf_families converted and handed back (same class, every weight in place, the config values that matter, the same
logits and greedy tokens), a hand-built `DecoderLM` per class there and back, GPT-NeoX without attention biases both
ways, and the refusals, each naming the argument. Bound 1e-10."""
import math
import pytest
import torch

transformers = pytest.importorskip("transformers")
from relpos.hf import TO_TRANSFORMERS
from relpos.models import DecoderLM
from test_modern import float32_as_float64, max_err
from test_hf_families import CASES, case, ref_logits, tokens, V

TOL = 1e-10
# a source whose DecoderLM a class tried earlier expresses: the same model under that class
SIMPLER = {'mistral_head_dim': 'LlamaForCausalLM',   # no window: LLaMA's layer
           'phi3': 'LlamaForCausalLM'}               # whole-head rotary, no window, no dropout: LLaMA's layer
MATTERS = ('num_key_value_heads', 'head_dim', 'rms_norm_eps', 'tie_word_embeddings', 'rope_parameters', 'attention_bias',
           'mlp_bias', 'layer_types', 'query_pre_attn_scalar', 'final_logit_softcapping', 'attn_logit_softcapping',
           'no_rope_layers', 'attention_chunk_size', 'use_qk_norm', 'attn_temperature_tuning', 'floor_scale', 'attn_scale',
           'intermediate_size', 'intermediate_size_mlp', 'hidden_act', 'hidden_activation')


def to_hf(lm, **kw):
    with float32_as_float64(): return lm.to_transformers(**kw)   # rotary tables built as the source's were


def greedy(model, x, n=8):
    with float32_as_float64(), torch.no_grad():
        return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_through_relpos(name):
    "transformers -> DecoderLM -> transformers: the class, every weight, the config values that matter, logits, greedy tokens."
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    cfg = model.config
    back = to_hf(lm, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    assert type(back).__name__ == SIMPLER.get(name, type(model).__name__)
    if type(back) is type(model):
        sa, sb = model.state_dict(), back.state_dict()
        assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
        for k in MATTERS:   # Llama 4's intermediate_size is its experts' (a dense model has none)
            if hasattr(cfg, k) and not (k == 'intermediate_size' and name.startswith('llama4')):
                assert getattr(back.config, k) == getattr(cfg, k), k
        windowed = 'sliding_attention' in (getattr(cfg, 'layer_types', None) or ['sliding_attention'])   # Mistral, Phi-3: every layer
        if windowed and hasattr(cfg, 'sliding_window'): assert back.config.sliding_window == cfg.sliding_window
    x = tokens(2, 15)
    assert max_err(ref_logits(back, x), ref_logits(model, x)) <= TOL
    assert torch.equal(greedy(back, x[:, :6]), greedy(model, x[:, :6]))


BUILT = [   # the class to_transformers picks <- DecoderLM arguments (rotary, RMSNorm, no head bias)
    ('MistralForCausalLM', dict(bias=False, sliding_window=4, kv_heads=2)),
    ('Qwen2ForCausalLM', dict(bias=False, qkv_bias=True, layer_types=['full_attention', 'sliding_attention', 'sliding_attention'],
                              sliding_window=3)),
    ('Qwen3ForCausalLM', dict(bias=False, qk_norm='head', kv_heads=2, head_dim=8)),
    ('Olmo2ForCausalLM', dict(bias=False, qk_norm='full', pre_norm=False, post_norm=True)),
    ('Phi3ForCausalLM', dict(bias=False, rotary_dim=4, sliding_window=5, residual_dropout=0.1, embedding_dropout=0.0)),
    ('GemmaForCausalLM', dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=math.sqrt(24), tie_embeddings=True)),
    ('Gemma2ForCausalLM', dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=math.sqrt(24), post_norm=True,
                               score_scale=20 ** -0.5, attn_softcap=8.0, logit_softcap=30.0, sliding_window=3,
                               layer_types=['sliding_attention', 'full_attention', 'sliding_attention'])),
    ('Gemma3ForCausalLM', dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=math.sqrt(24), post_norm=True,
                               qk_norm='head', logit_softcap=30.0, sliding_window=3, base=1e6,
                               layer_types=['sliding_attention', 'sliding_attention', 'full_attention'],
                               layer_positions={'sliding_attention': dict(base=1e4)})),
    ('SmolLM3ForCausalLM', dict(bias=False, nope_layers=(1,), sliding_window=3,
                                layer_types=['full_attention', 'sliding_attention', 'full_attention'])),
    ('Llama4ForCausalLM', dict(bias=False, interleaved=True, nope_layers=(2,), attention_chunk_size=4, kv_heads=2,
                               layer_types=['chunked_attention', 'chunked_attention', 'full_attention'], query_temperature=(3, 0.5),
                               layer_positions={'chunked_attention': dict(qk_norm='head_unscaled', query_temperature=None)})),
]


def built(kw, seed=0):
    torch.manual_seed(seed)
    lm = DecoderLM(V, d_model=24, heads=4, n_layers=3, d_ff=40, position='rotary', norm='rms',
                   **{'ffn': 'swiglu', 'head_bias': False, **kw}).double().eval()
    with torch.no_grad():   # norms moved off their initial values, so that a misplaced one shows
        for p in lm.parameters(): p.add_(0.1 * torch.randn_like(p))
    return lm


@pytest.mark.parametrize("cls,kw", BUILT, ids=[c for c, _ in BUILT])
def test_a_built_decoder_lm_goes_to_the_class_of_its_switches(cls, kw):
    "A DecoderLM built by hand: the class its arguments name, the same logits there, and the same model back from it."
    lm = built(kw)
    back = to_hf(lm)
    assert type(back).__name__ == cls
    x = tokens(2, 14)
    with torch.no_grad(): want = lm(x)[0]
    assert max_err(ref_logits(back, x), want) <= TOL
    again = DecoderLM.from_transformers(back)
    with torch.no_grad(): assert max_err(again(x)[0], want) <= TOL
    for k in ('sliding_window', 'layer_types', 'nope_layers', 'qk_norm', 'pre_norm', 'post_norm', 'attention_chunk_size'):
        assert getattr(again, k) == getattr(lm, k), k


def test_each_class_is_built_from_the_arguments_not_the_source():
    "A Qwen3 whose q/k norms are gone is LLaMA's layer; a LLaMA given a window is Mistral's."
    lm = DecoderLM.from_transformers(case('qwen3'))
    assert type(to_hf(lm)).__name__ == 'Qwen3ForCausalLM'
    lm2 = DecoderLM(**{**lm.to_config(), 'qk_norm': None}).double()
    state = {k: v for k, v in lm.state_dict().items() if '.norm.' not in k or 'self_attn' not in k}
    lm2.load_state_dict(state)
    assert type(to_hf(lm2)).__name__ == 'LlamaForCausalLM'
    llama = DecoderLM.from_transformers(case('llama'))
    llama.sliding_window = 5   # read at each call, as `layer_patterns` does
    assert type(to_hf(llama)).__name__ == 'MistralForCausalLM'


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox_without_attention_biases_both_ways(parallel):
    "GPT-NeoX with attention_bias=False: q/k/v and output without biases, the MLP with them (`qkv_bias`, `output_bias`)."
    with float32_as_float64():
        cfg = transformers.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, rotary_pct=0.5, attention_bias=False,
                                         use_parallel_residual=parallel)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(0)
        model = transformers.GPTNeoXForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'norm' in n or n.endswith('bias'): p.add_(0.2 * torch.randn_like(p))
    lm = DecoderLM.from_transformers(model)
    assert (lm.bias, lm.qkv_bias, lm.output_bias) == (True, False, False)
    a = lm.layers[0].self_attn.module
    assert a.query.linear.bias is None and a.output.bias is None and lm.layers[0].feed_forward.layer1.bias is not None
    x = tokens(2, 15)
    want = ref_logits(model, x)
    with torch.no_grad(): assert max_err(lm(x)[0], want) <= TOL
    back = to_hf(lm)
    assert type(back) is transformers.GPTNeoXForCausalLM and back.config.attention_bias is False
    sa, sb = model.state_dict(), back.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert max_err(ref_logits(back, x), want) <= TOL


REFUSED = [   # DecoderLM arguments no class expresses -> the argument the refusal names
    (dict(bias=False, qk_norm='head', pre_norm=False, post_norm=True), r"Olmo2ForCausalLM needs qk_norm='head' \(needs 'full'\)"),
    (dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=math.sqrt(24), post_norm=True, score_scale=0.3),
     r"Gemma2ForCausalLM needs score_scale=0.3 \(needs 'n \*\* -0.5"),
    (dict(bias=False, qk_norm='head', sliding_window=3, layer_types=['sliding_attention', 'full_attention', 'full_attention'],
          layer_positions={'sliding_attention': dict(base=100.0)}), r"Qwen3ForCausalLM needs layer_positions=.*one rope for every layer"),
    (dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=math.sqrt(24), post_norm=True, qk_norm='head', attn_softcap=5.0),
     r"Gemma3ForCausalLM needs attn_softcap=5.0 \(needs None\)"),
    (dict(ffn='geglu', bias=False, norm_offset=1.0, embed_scale=2.0), r"GemmaForCausalLM needs embed_scale=2.0"),
    (dict(bias=False, interleaved=True, nope_layers=(2,), query_temperature=(3.5, 0.5)), r"Llama4ForCausalLM needs query_temperature="),
    (dict(bias=False, interleaved=True, qk_norm='head'), r"Llama4ForCausalLM needs qk_norm="),
    (dict(bias=True, qkv_bias=True, output_bias=False), r"Qwen2ForCausalLM needs bias=True \(needs False\)"),
    (dict(bias=False, sliding_window=3, attention_chunk_size=4,
          layer_types=['sliding_attention', 'chunked_attention', 'full_attention']), r"Llama4ForCausalLM needs .*layer_types="),
    (dict(bias=False, memorizing_layers=(1,)), r"memorizing_layers=\(1,\) has no counterpart"),
]


@pytest.mark.parametrize("kw,msg", REFUSED)
def test_what_no_class_expresses_is_refused_naming_the_argument(kw, msg):
    with pytest.raises(ValueError, match=msg): built(kw).to_transformers()


def test_every_class_has_a_way_back():
    "Every whole-model converter has a class to hand back to."
    from relpos.hf import MODEL_CONVERTERS
    assert set(MODEL_CONVERTERS) <= set(TO_TRANSFORMERS)


def test_a_pattern_no_layer_uses_is_llamas():
    "layer_types all 'full_attention' (a window no layer uses) is LLaMA's layer; one sliding layer is refused by LLaMA by name."
    kw = dict(bias=False, layer_types=['full_attention'] * 3)
    for extra in ({}, dict(sliding_window=3)):
        lm = built({**kw, **extra})
        back = to_hf(lm)
        assert type(back).__name__ == 'LlamaForCausalLM'
        x = tokens(2, 10)
        with torch.no_grad(): assert max_err(ref_logits(back, x), lm(x)[0]) <= TOL
    with pytest.raises(ValueError, match=r"LlamaForCausalLM needs sliding_window=3 \(needs None\)"):
        DecoderLM(V, d_model=16, heads=2, n_layers=1, position='rotary', norm='layer', ffn='gelu', sliding_window=3).to_transformers()

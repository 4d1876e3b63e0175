"""DecoderLM.from_transformers for LLaMA's relatives -- Mistral (sliding window), Qwen2 (q/k/v biases; windows in some
layers), Qwen3 and OLMo 2 (q/k norms; OLMo 2's post-norm block), Phi-3 (fused projections, partial rotary, longrope),
Gemma, Gemma 2 and Gemma 3 ((1 + w) norms, scaled embeddings, GeGLU, soft-capping, local/global layers with their own
rope bases) -- against transformers in
float64 (its float32 steps in float64, see test_modern.float32_as_float64): logits, greedy tokens of `generate`, cached
decoding against the full forward, a position swap (FIRE on grouped-query weights), and every refusal the converter
registry lists. Tiny random models built from configs (no hub). Bound 1e-10."""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from relpos.hf import (from_transformers, decoder_from_transformers, ATTENTION_CONVERTERS, MODEL_CONVERTERS,
                       CONFIG_REFUSALS, SWAP_POSITIONS)
from relpos.models import DecoderLM, NormedHeads, causal_mask
from relpos.cache import full_logits
from relpos.rotary import RotaryMultiHeadAttention
from relpos.fire import FireMultiHeadAttention
from test_modern import float32_as_float64, max_err, run, causal

TOL = 1e-10
V = 64
LONGROPE = {'rope_type': 'longrope', 'rope_theta': 1000.0, 'partial_rotary_factor': 0.5,
            'short_factor': [1.0 + 0.1 * i for i in range(2)], 'long_factor': [1.0 + 1.5 * i for i in range(2)]}
CASES = {   # id: (family, config overrides)
    'llama': ('Llama', {}),
    'llama_attention_bias': ('Llama', dict(attention_bias=True)),   # q/k/v/o biases, none in the MLP
    'llama_mlp_bias': ('Llama', dict(mlp_bias=True)),               # MLP biases, none in the attention
    'mistral_window': ('Mistral', dict(sliding_window=5)),
    'mistral_head_dim': ('Mistral', dict(sliding_window=None, head_dim=12)),
    'qwen2': ('Qwen2', {}),
    'qwen2_window': ('Qwen2', dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    'qwen3': ('Qwen3', dict(head_dim=12)),
    'qwen3_mqa_tied': ('Qwen3', dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)),
    'olmo2': ('Olmo2', {}),
    'olmo2_yarn': ('Olmo2', dict(rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16,
                                                  'rope_theta': 500.0})),
    'phi3': ('Phi3', {}),
    'phi3_longrope_window': ('Phi3', dict(sliding_window=6, rope_parameters=dict(LONGROPE), original_max_position_embeddings=16)),
    'qwen2_some_windows': ('Qwen2', dict(use_sliding_window=True, sliding_window=4, max_window_layers=1, num_hidden_layers=3)),
    'gemma': ('Gemma', dict(head_dim=12)),
    'gemma2': ('Gemma2', dict(head_dim=12, sliding_window=4, query_pre_attn_scalar=20, attn_logit_softcapping=8.0,
                              final_logit_softcapping=30.0, num_hidden_layers=3)),
    'gemma3': ('Gemma3', dict(head_dim=12, sliding_window=4, num_hidden_layers=4, sliding_window_pattern=3,
                              query_pre_attn_scalar=20, final_logit_softcapping=30.0)),
    'gemma3_scaled_global': ('Gemma3', dict(num_hidden_layers=3, sliding_window=5, sliding_window_pattern=3, rope_parameters={
        'full_attention': {'rope_type': 'linear', 'factor': 4.0, 'rope_theta': 1e6},
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 100.0}}, num_key_value_heads=1, head_dim=8)),
    'smollm3': ('SmolLM3', dict(num_hidden_layers=4)),   # every 4th layer without rotation: layer 3
    'smollm3_windows': ('SmolLM3', dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                                        sliding_window=4)),   # NoPE layers 1 and 3, windowed
    'llama4': ('Llama4', dict(num_hidden_layers=4, head_dim=8, moe_layers=[], intermediate_size_mlp=96, attention_chunk_size=4,
                              floor_scale=3, attn_scale=0.5)),   # chunked rotary layers 0-2 (q/k norms), NoPE layer 3 (temperature)
    'llama4_plain': ('Llama4', dict(num_hidden_layers=4, head_dim=8, moe_layers=[], intermediate_size_mlp=96, attention_chunk_size=6,
                                    no_rope_layer_interval=2, use_qk_norm=False, attn_temperature_tuning=False,
                                    tie_word_embeddings=True)),
}
CONFIGS = {'Gemma3': 'Gemma3TextConfig', 'Llama4': 'Llama4TextConfig'}   # config class names that are not <family>Config
EAGER = {'Gemma2'}   # transformers' SDPA path drops Gemma 2's soft-capping: its eager attention is the reference


def make(family, scale=1.0, **over):
    "A tiny random `<family>ForCausalLM` in float64; norms and biases moved off their initial ones and zeros (so they matter)."
    cfg_cls = getattr(transformers, CONFIGS.get(family, family + 'Config'))
    model_cls = getattr(transformers, family + 'ForCausalLM')
    kw = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=1,
              initializer_range=0.2)
    kw.update(over)
    with float32_as_float64():
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = 'eager' if family in EAGER else 'sdpa'
        torch.manual_seed(0)
        model = model_cls(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name or name.endswith('bias'): p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            p.mul_(scale)
    return model


def case(name, **kw):
    family, over = CASES[name]
    return make(family, **{**over, **kw})


def ref_logits(model, tokens, **kw):
    with float32_as_float64(), torch.no_grad():
        return model(tokens, **kw).logits


def tokens(b, n, seed=2): return torch.randint(2, V, (b, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- logits
@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    x = tokens(2, 20)   # longer than every window and than longrope's original 16
    with torch.no_grad():
        assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2', 'qwen3', 'olmo2', 'phi3_longrope_window', 'qwen2_some_windows',
                                  'gemma', 'gemma2', 'gemma3', 'smollm3_windows', 'llama4'])
def test_logits_with_left_padding(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    x = tokens(2, 18, seed=3)
    keep = torch.ones(2, 18, dtype=torch.long); keep[0, :5] = 0
    ids = (keep.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = lm(x, position_ids=ids, attention_mask=keep)[0]
    assert max_err(got, ref_logits(model, x, attention_mask=keep, position_ids=ids), keep.bool()) <= TOL


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2_window', 'phi3_longrope_window'])
def test_the_window_is_the_sources(name):
    "Without its window the converted model gives other logits beyond it: the window is converted, not ignored."
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    assert lm.sliding_window == model.config.sliding_window
    x = tokens(2, 20)
    want = ref_logits(model, x)
    lm.sliding_window = None
    with torch.no_grad(): unwindowed = lm(x)[0]
    w = model.config.sliding_window
    assert max_err(unwindowed[:, :w], want[:, :w]) <= TOL and max_err(unwindowed[:, w:], want[:, w:]) > 1e-4


def test_architecture_read_from_the_modules():
    "What each family converts to: DecoderLM's arguments, and the relpos modules they build."
    arch = lambda lm: (lm.bias, lm.qkv_bias, lm.qk_norm, lm.sliding_window, lm.pre_norm, lm.post_norm)
    assert arch(DecoderLM.from_transformers(case('llama'))) == (False, None, None, None, True, False)
    assert arch(DecoderLM.from_transformers(case('mistral_window'))) == (False, None, None, 5, True, False)
    qwen2 = DecoderLM.from_transformers(case('qwen2'))
    assert arch(qwen2) == (False, True, None, None, True, False)
    a = qwen2.layers[0].self_attn.module
    assert a.query.linear.bias is not None and a.value.linear.bias is not None and a.output.bias is None
    qwen3 = DecoderLM.from_transformers(case('qwen3'))
    assert arch(qwen3) == (False, None, 'head', None, True, False)
    q = qwen3.layers[0].self_attn.module.query
    assert isinstance(q, NormedHeads) and q.norm.weight.shape == (12,)
    olmo2 = DecoderLM.from_transformers(case('olmo2'))
    assert arch(olmo2) == (False, None, 'full', None, False, True)
    a = olmo2.layers[0].self_attn.module
    assert a.query.norm.weight.shape == (48,) and a.key.norm.weight.shape == (16,)
    assert isinstance(olmo2.layers[0].norm_self_attn, nn.Identity) and olmo2.layers[0].post_norm_ff is not None
    phi3 = DecoderLM.from_transformers(case('phi3_longrope_window'))
    a = phi3.layers[0].self_attn.module
    assert a.rotary_dim == 4 and a.rope_scaling['rope_type'] == 'longrope' and phi3.sliding_window == 6


# ---------------------------------------------------------------- greedy tokens and cached decoding
GEMMAS = ['gemma', 'gemma2', 'gemma3', 'gemma3_scaled_global']
BIASES = ['llama_attention_bias', 'llama_mlp_bias']
PATTERNS = ['qwen2_some_windows', 'smollm3', 'smollm3_windows', 'llama4', 'llama4_plain'] + GEMMAS


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2_window', 'qwen3', 'olmo2', 'phi3', 'phi3_longrope_window'] + BIASES + PATTERNS)
def test_greedy_tokens_equal_transformers_generate(name):
    model = case(name, scale=4.0)   # larger weights: peaked distributions, many different tokens
    if name in GEMMAS:   # embeddings times sqrt(d_model) would drown the post-normed branches: each row one token
        with torch.no_grad(): model.model.embed_tokens.weight.mul_(0.1)
    lm = DecoderLM.from_transformers(model)
    n = 6 if name.startswith('phi3_longrope') else 20   # longrope: within its original length (see 09a: cache_exact_len)
    prompt = tokens(3, 6, seed=4)
    with float32_as_float64(), torch.no_grad():
        want = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = lm.generate(prompt, n, temperature=0)
    assert torch.equal(got, want)
    assert len(set(want[:, 6:].flatten().tolist())) > 5   # not one token repeated


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2_window', 'qwen3', 'qwen3_mqa_tied', 'olmo2', 'phi3',
                                  'phi3_longrope_window'] + BIASES + PATTERNS)
def test_cached_decoding_equals_the_full_forward(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    total = 16 if name.startswith('phi3_longrope') else 22
    x = tokens(2, total, seed=5)
    with torch.no_grad():
        want = lm(x)[0]
        assert max_err(want, ref_logits(model, x)) <= TOL
        cache = lm.new_cache(2, 64)
        window = model.config.sliding_window if lm.sliding_window is not None and lm.layer_types is None else None
        assert cache.max_cache_len == (window or 64)   # a model windowed in every layer keeps its window, no more
        got = [lm(x[:, :7], cache=cache)[0], lm(x[:, 7:10], cache=cache)[0]]            # prefill, then a chunk
        got += [lm(x[:, t:t + 1], cache=cache)[0] for t in range(10, total)]           # then one token at a time
        assert max_err(torch.cat(got, 1), want) <= TOL
        assert max_err(full_logits(lm, x), want) <= TOL


def test_window_with_transformer_xl_memory_and_uncached_generate():
    "The window holds across calls with memory, and generate without the cache picks the cached tokens."
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='rotary', norm='rms', ffn='swiglu', bias=False,
                   sliding_window=3, mem_len=8).double().eval()
    x = torch.randint(0, 13, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = lm(x)[0]
        first, memory = lm(x[:, :8])
        second, _ = lm(x[:, 8:], memory)
        assert max_err(torch.cat([first, second], 1), whole) <= TOL
        lm.sliding_window = None
        assert max_err(lm(x)[0][:, 3:], whole[:, 3:]) > 1e-4
        lm.sliding_window = 3
    assert torch.equal(lm.generate(x[:, :4], 8, temperature=0, use_cache=False), lm.generate(x[:, :4], 8, temperature=0))
    assert torch.equal(causal_mask(3, 5, window=2), torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]).bool())


# ---------------------------------------------------------------- the position swap
@pytest.mark.parametrize("name", ['qwen2', 'olmo2', 'qwen3_mqa_tied'])
def test_fire_on_grouped_query_weights(name):
    """`position='fire'` (no grouped-query heads) repeats each key/value head for its query heads: with FIRE's bias
    zeroed it is exactly the model under `position='none'`, which keeps the grouped heads."""
    model = case(name)
    fire = DecoderLM.from_transformers(model, position='fire')
    none = DecoderLM.from_transformers(model, position='none')
    a = fire.layers[0].self_attn.module
    assert isinstance(a, FireMultiHeadAttention) and a.kv_heads == a.heads == 6
    x = tokens(2, 14, seed=6)
    with torch.no_grad():
        out = fire(x)[0]
        assert out.isfinite().all() and max_err(out, none(x)[0]) > 1e-6    # FIRE's own bias, freshly initialised
        for layer in fire.layers: layer.self_attn.module.positions.mlp[2].weight.zero_(); layer.self_attn.module.positions.mlp[2].bias.zero_()
        assert max_err(fire(x)[0], none(x)[0]) <= TOL
        cache = fire.new_cache(2, 14)   # the swapped model decodes with the cache too
        got = torch.cat([fire(x[:, :5], cache=cache)[0]] + [fire(x[:, t:t + 1], cache=cache)[0] for t in range(5, 14)], 1)
        assert max_err(got, fire(x)[0]) <= TOL
    loss = nn.functional.cross_entropy(fire(x)[0].flatten(0, 1), x.flatten())
    loss.backward()   # trains: the research use
    assert a.positions.mlp[0].weight.grad is not None


def test_swaps_keep_the_families_architecture():
    model = case('mistral_window')
    alibi = DecoderLM.from_transformers(model, position='alibi')
    assert alibi.sliding_window == 5 and alibi.kv_heads == 2
    qwen3 = DecoderLM.from_transformers(case('qwen3_mqa_tied'), position='t5', num_buckets=8, max_distance=16)
    assert qwen3.qk_norm == 'head' and isinstance(qwen3.layers[0].self_attn.module.query, NormedHeads)
    with torch.no_grad(): assert qwen3(tokens(1, 9))[0].isfinite().all()
    assert 'fire' in SWAP_POSITIONS


def test_fire_refuses_a_head_dim_it_cannot_take():
    with pytest.raises(ValueError, match="head_dim=12"):
        DecoderLM.from_transformers(case('qwen3'), position='fire')


# ---------------------------------------------------------------- attention modules
@pytest.mark.parametrize("name", ['mistral_window', 'qwen2', 'qwen3', 'olmo2', 'phi3_longrope_window'])
def test_attention_modules_convert(name):
    model = case(name)
    ref = model.model.layers[0].self_attn
    ours = from_transformers(ref)
    assert type(ours) is RotaryMultiHeadAttention and type(ref).__name__ in ATTENTION_CONVERTERS
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randn(2, 12, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ids = torch.arange(12)[None].expand(2, 12)
    with float32_as_float64(), torch.no_grad():
        cos_sin = model.model.rotary_emb(x, ids)
        mask = torch.zeros(2, 1, 12, 12, dtype=torch.float64).masked_fill(~causal(2, 12)[:, None], float('-inf'))
        want = ref(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask)[0]
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, 12)), want) <= TOL


# ---------------------------------------------------------------- dropout and refusals
def test_phi3_drops_its_branches_not_its_embeddings():
    lm = DecoderLM.from_transformers(make('Phi3', resid_pdrop=0.1, attention_dropout=0.2))
    assert lm.drop.p == 0.0 and lm.layers[0].dropout.p == 0.1 and lm.layers[0].self_attn.module.dropout.p == 0.2
    assert lm.layers[0].feed_forward.dropout.p == 0.0


YARN_PARTIAL = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16, 'rope_theta': 500.0,
                'partial_rotary_factor': 0.5}
REFUSED = {   # (model class, config key): overrides that set it to a value DecoderLM cannot express
    ('Llama', 'hidden_act'): dict(hidden_act='gelu'),
    ('Llama', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('GPTNeoX', 'hidden_act'): dict(hidden_act='relu'),
    ('Mistral', 'hidden_act'): dict(hidden_act='gelu'),
    ('Mistral', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Qwen2', 'hidden_act'): dict(hidden_act='gelu'),
    ('Qwen2', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Qwen3', 'hidden_act'): dict(hidden_act='gelu'),
    ('Qwen3', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Olmo2', 'hidden_act'): dict(hidden_act='gelu'),
    ('Olmo2', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Phi3', 'hidden_act'): dict(hidden_act='gelu'),
    ('Gemma', 'hidden_act'): dict(hidden_act='relu'),
    ('Gemma', 'use_bidirectional_attention'): dict(use_bidirectional_attention=True),
    ('Gemma2', 'hidden_activation'): dict(hidden_activation='relu'),
    ('Gemma2', 'use_bidirectional_attention'): dict(use_bidirectional_attention=True),
    ('Gemma3', 'hidden_activation'): dict(hidden_activation='relu'),
    ('Gemma3', 'use_bidirectional_attention'): dict(use_bidirectional_attention=True),
    ('SmolLM3', 'hidden_act'): dict(hidden_act='gelu'),
    ('SmolLM3', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Llama4', 'hidden_act'): dict(hidden_act='gelu', moe_layers=[]),
    ('Llama4', 'moe_layers'): dict(moe_layers=[1], num_local_experts=2),
}


def test_every_listed_refusal_is_tested():
    from test_hf_families_classic import FAMILIES   # GPT-2, GPT-J, BLOOM, Falcon: their refusals are tested there
    listed = {(cls[:-len('ForCausalLM')], key) for cls, keys in CONFIG_REFUSALS.items() for key in keys
              if cls not in FAMILIES.values()}
    assert listed == set(REFUSED) and set(CONFIG_REFUSALS) == set(MODEL_CONVERTERS)


@pytest.mark.parametrize("family,key", list(REFUSED))
def test_refused_by_config_key(family, key):
    over = REFUSED[(family, key)]
    if family == 'GPTNeoX':
        with float32_as_float64():
            model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
                vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, **over))
    else:
        model = make(family, **over)
    with pytest.raises(ValueError, match=key):
        DecoderLM.from_transformers(model)


# ---------------------------------------------------------------- DecoderLM's new arguments
def test_decoder_lm_arguments_are_checked():
    with pytest.raises(ValueError, match="qk_norm must be one of"): DecoderLM(11, position='rotary', qk_norm='layer')
    with pytest.raises(ValueError, match="qk_norm='head'"): DecoderLM(11, position='shaw', qk_norm='head')
    with pytest.raises(ValueError, match="sliding_window must be an int >= 1"): DecoderLM(11, sliding_window=0)
    with pytest.raises(TypeError, match="qkv_bias must be None"): DecoderLM(11, qkv_bias='yes')
    with pytest.raises(ValueError, match="qkv_bias=False: position='xl'"): DecoderLM(11, qkv_bias=False)
    with pytest.raises(ValueError, match="bias=False: layer 0's attention"): DecoderLM(11, position='shaw', bias=False, qkv_bias=True)
    with pytest.raises(TypeError, match="post_norm must be a bool"): DecoderLM(11, post_norm=1)
    with pytest.raises(ValueError, match=r"embedding_dropout must be a float in \[0, 1\) or None \(residual_dropout's value\)"):
        DecoderLM(11, embedding_dropout=1.5)


def test_qkv_bias_and_norms_where_they_belong():
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='rotary', bias=False, qkv_bias=True, kv_heads=1,
                   qk_norm='full', pre_norm=False, post_norm=True, norm='rms')
    a, layer = lm.layers[0].self_attn.module, lm.layers[0]
    assert a.query.linear.bias is not None and a.key.linear.bias is not None and a.value.linear.bias is not None
    assert a.output.bias is None and lm.generator.bias is None
    assert a.query.norm.weight.shape == (16,) and a.key.norm.weight.shape == (8,)   # whole projections: 2 x 8, 1 x 8
    assert isinstance(layer.norm_ff, nn.Identity) and isinstance(layer.post_norm_self_attn, nn.RMSNorm)
    default = DecoderLM(11, d_model=16, heads=2, n_layers=1)
    assert default.layers[0].post_norm_self_attn is None and not any('norm' in k and 'post' in k for k in default.state_dict())


def test_a_cache_wider_than_the_window_is_refused():
    "A cache made by hand with more slots than the model's window would attend past it: refused, naming the window."
    from relpos.cache import KVCache
    lm = DecoderLM.from_transformers(case('mistral_window'))
    wide = KVCache([l.self_attn.module for l in lm.layers], 1, 8, dtype=torch.float64, owner=lm)
    with pytest.raises(ValueError, match="sliding_window=5"):
        lm(tokens(1, 3), cache=wide)
    assert wide.seen == 0


@pytest.mark.parametrize("name", list(CASES))
def test_every_swap_builds_and_runs(name):
    "Each converted family under each position method it may take: the same weights outside the attention's positions."
    model = case(name)
    own = DecoderLM.from_transformers(model).state_dict()
    d_k = model.model.layers[0].self_attn.head_dim
    for position in SWAP_POSITIONS:
        if position == 'fire' and d_k * model.config.num_attention_heads != model.config.hidden_size:
            with pytest.raises(ValueError, match=f"head_dim={d_k}"): DecoderLM.from_transformers(model, position=position)
            continue
        lm = DecoderLM.from_transformers(model, position=position)
        with torch.no_grad(): assert lm(tokens(1, 9))[0].isfinite().all(), position
        for k, v in lm.state_dict().items():
            if '.positions.' in k or k not in own: continue
            if v.shape == own[k].shape: assert torch.equal(v, own[k]), (position, k)


# ---------------------------------------------------------------- Gemma, Gemma 2, Gemma 3 and layer patterns
def test_gemma_architecture_read_from_the_modules():
    "Each Gemma difference is a DecoderLM argument with the source's value."
    g = DecoderLM.from_transformers(case('gemma'))
    assert (g.ffn_kind, g.norm_offset, g.embed_scale, g.tie_embeddings) == ('geglu', 1.0, 48 ** 0.5, True)
    assert (g.score_scale, g.attn_softcap, g.logit_softcap, g.layer_types, g.pre_norm, g.post_norm) == (None,) * 4 + (True, False)
    g2 = DecoderLM.from_transformers(case('gemma2'))
    assert (g2.score_scale, g2.attn_softcap, g2.logit_softcap) == (20 ** -0.5, 8.0, 30.0) and g2.post_norm
    assert g2.layer_types == ('sliding_attention', 'full_attention', 'sliding_attention') and g2.sliding_window == 4
    assert g2.layers[0].self_attn.module.softcap == 8.0
    g3 = DecoderLM.from_transformers(case('gemma3'))
    assert g3.layer_types == ('sliding_attention', 'sliding_attention', 'full_attention', 'sliding_attention')
    assert g3.qk_norm == 'head' and g3.attn_softcap is None and g3.layers[0].self_attn.module.query.norm.offset == 1.0
    assert [l.self_attn.module.base for l in g3.layers] == [1e4, 1e4, 1e6, 1e4]   # local and global rope bases
    s = DecoderLM.from_transformers(case('gemma3_scaled_global'))
    assert [l.self_attn.module.rope_scaling['rope_type'] for l in s.layers] == ['default', 'default', 'linear']
    assert s.layer_positions == {'sliding_attention': dict(base=100.0, rope_scaling=None)}   # the global layers' linear scaling, not theirs
    assert g3.layer_positions == {'sliding_attention': dict(base=1e4)}


@pytest.mark.parametrize("name", ['gemma2', 'gemma3', 'qwen2_some_windows', 'smollm3_windows'])
def test_per_layer_windows_and_bases_are_the_sources(name):
    "Without the sliding layers' window, or with the global rope base in them, the logits beyond the window differ."
    model = case(name)
    x = tokens(2, 20)
    want = ref_logits(model, x)
    lm = DecoderLM.from_transformers(model)
    w = lm.sliding_window
    lm.sliding_window = None
    with torch.no_grad(): unwindowed = lm(x)[0]
    assert max_err(unwindowed[:, :w], want[:, :w]) <= TOL and max_err(unwindowed[:, w:], want[:, w:]) > 1e-4
    if name == 'gemma3':
        lm.sliding_window = w
        for l in lm.layers: l.self_attn.module.base = 1e6
        with torch.no_grad(): assert max_err(lm(x)[0], want) > 1e-4


def test_gemma3_attention_module_converts():
    model = case('gemma3')
    x = torch.randn(2, 12, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ids = torch.arange(12)[None].expand(2, 12)
    for i in (0, 2):   # a sliding layer (base 10,000) and the global one (1,000,000): the window is the mask's business
        ref = model.model.layers[i].self_attn
        ours = from_transformers(ref)
        assert ours.base == (1e4 if i == 0 else 1e6) and ours.scale == 20 ** -0.5
        with float32_as_float64(), torch.no_grad():
            cos_sin = model.model.rotary_emb(x, ids, ref.layer_type)
            mask = torch.zeros(2, 1, 12, 12, dtype=torch.float64).masked_fill(~causal(2, 12)[:, None], float('-inf'))
            want = ref(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask)[0]
        with torch.no_grad(): assert max_err(run(ours, x, causal(2, 12)), want) <= TOL


def test_gemma2_attention_module_keeps_its_softcap():
    model = case('gemma2')
    ref = model.model.layers[1].self_attn
    ours = from_transformers(ref)
    assert ours.softcap == 8.0
    x = 3 * torch.randn(2, 10, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(8))   # large scores: the cap bites
    ids = torch.arange(10)[None].expand(2, 10)
    with float32_as_float64(), torch.no_grad():
        cos_sin = model.model.rotary_emb(x, ids)
        mask = torch.zeros(2, 1, 10, 10, dtype=torch.float64).masked_fill(~causal(2, 10)[:, None], float('-inf'))
        want = ref(hidden_states=x, position_embeddings=cos_sin, attention_mask=mask)[0]
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, 10)), want) <= TOL
        ours.softcap = None
        assert max_err(run(ours, x, causal(2, 10)), want) > 1e-4


@pytest.mark.parametrize("name", ['gemma3_scaled_global', 'gemma2', 'llama4'])
def test_patterned_models_save_and_reload(tmp_path, name):
    "The new arguments (norm offset, scales, caps, layer types, per-type rope, q/k norms, temperatures) go through config.json."
    lm = DecoderLM.from_transformers(case(name))
    lm.save_pretrained(tmp_path)
    back = DecoderLM.from_pretrained(tmp_path)
    x = tokens(2, 12)
    with torch.no_grad(): assert torch.equal(back(x)[0], lm(x)[0])
    assert back.to_config() == lm.to_config()


def test_softcap_on_every_position_that_takes_it():
    "attn_softcap changes the scores on each position's paths; cached decoding equals the full forward with it."
    from relpos.models import SOFTCAP_POSITIONS
    for p in SOFTCAP_POSITIONS:
        torch.manual_seed(0)
        lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position=p, norm='rms', attn_softcap=0.5, score_scale=0.7,
                       layer_types=['sliding_attention', 'full_attention'], sliding_window=3).double().eval()
        with torch.no_grad():
            for q in lm.parameters(): q.add_(0.3 * torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1)))
        x = torch.randint(0, 13, (2, 15), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = lm(x)[0]
            for l in lm.layers: l.self_attn.module.softcap = None
            assert max_err(lm(x)[0], want) > 1e-3, p
            for l in lm.layers: l.self_attn.module.softcap = 0.5
            cache = lm.new_cache(2, 32)
            got = [lm(x[:, :6], cache=cache)[0], lm(x[:, 6:9], cache=cache)[0]] + [lm(x[:, t:t + 1], cache=cache)[0] for t in range(9, 15)]
            assert max_err(torch.cat(got, 1), want) <= TOL, p
    with pytest.raises(ValueError, match="attn_softcap=2.0: position='xl'"): DecoderLM(11, attn_softcap=2.0)
    with pytest.raises(ValueError, match="score_scale=0.5: position='shaw'"): DecoderLM(11, position='shaw', score_scale=0.5)


def test_layer_pattern_arguments_are_checked():
    with pytest.raises(ValueError, match="layer_types must be a list of n_layers=2"): DecoderLM(11, n_layers=2, layer_types=['full_attention'])
    with pytest.raises(ValueError, match="'local' is not one of"): DecoderLM(11, n_layers=1, layer_types=['local'])
    with pytest.raises(ValueError, match="pass sliding_window="): DecoderLM(11, n_layers=1, layer_types=['sliding_attention'])
    with pytest.raises(ValueError, match="pass attention_chunk_size="): DecoderLM(11, n_layers=1, layer_types=['chunked_attention'])
    with pytest.raises(ValueError, match="say which layers"): DecoderLM(11, sliding_window=2, attention_chunk_size=4)
    with pytest.raises(ValueError, match="use mem_len=0"): DecoderLM(11, position='rotary', attention_chunk_size=4, mem_len=2)
    with pytest.raises(ValueError, match="layer_positions must map layer types"): DecoderLM(11, layer_positions={'local': {}})
    with pytest.raises(ValueError, match="norm_offset must be a finite number"): DecoderLM(11, norm_offset='1')
    for arg in ('embed_scale', 'score_scale', 'attn_softcap', 'logit_softcap'):
        with pytest.raises(ValueError, match=f"{arg} must be None or a finite number > 0"): DecoderLM(11, position='rotary', **{arg: 0.0})
    with pytest.raises(ValueError, match="ffn must be one of"): DecoderLM(11, ffn='reglu')


def test_offset_norms_and_geglu_against_their_formulas():
    "OffsetRMSNorm is x / rms(x) * (1 + w); GeGLU is down(gelu_tanh(gate x) * up x); the weight starts at 1 - offset (scale 1)."
    from relpos.models import make_norm, make_ffn
    n = make_norm('rms', 6, 1e-6, offset=1.0).double()
    assert torch.equal(n.weight, torch.zeros(6, dtype=torch.float64))
    with torch.no_grad(): n.weight.normal_()
    x = torch.randn(3, 6, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + n.weight)
    assert max_err(n(x), want) <= 1e-14
    f = make_ffn('geglu', 6, 10, 0.0, bias=False).double()
    g = f.gate(x)
    gelu = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    assert max_err(f(x), f.layer2(gelu * f.layer1(x))) <= 1e-14


BIAS_FLAGS = {'llama_attention_bias': (True, False), 'llama_mlp_bias': (False, True)}   # (attention_bias, mlp_bias)


@pytest.mark.parametrize("name", list(BIAS_FLAGS))
def test_attention_bias_apart_from_mlp_bias(name):
    "attention_bias is the four attention projections' biases, mlp_bias the MLP's: each read on its own, and back."
    model = case(name)
    attention, mlp = BIAS_FLAGS[name]
    lm = DecoderLM.from_transformers(model)
    a, f = lm.layers[0].self_attn.module, lm.layers[0].feed_forward
    assert [p.bias is not None for p in (a.query.linear, a.key.linear, a.value.linear, a.output)] == [attention] * 4
    assert [p.bias is not None for p in (f.gate, f.layer1, f.layer2)] == [mlp] * 3
    assert sum(p.numel() for p in lm.parameters()) == sum(p.numel() for p in model.parameters())
    back = DecoderLM(**lm.to_config()).double()   # the flags are saved with the model
    back.load_state_dict(lm.state_dict())
    x = tokens(2, 12)
    with torch.no_grad(): assert torch.equal(back(x)[0], lm(x)[0])
    with float32_as_float64(): hf = lm.to_transformers()
    assert type(hf) is transformers.LlamaForCausalLM
    assert (hf.config.attention_bias, hf.config.mlp_bias) == (attention, mlp)
    sa, sb = model.state_dict(), hf.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(ref_logits(hf, x), ref_logits(model, x))


@pytest.mark.parametrize("family", ['Qwen3', 'Olmo2', 'Gemma', 'Gemma2', 'Gemma3', 'SmolLM3', 'Llama4'])
def test_attention_bias_in_every_family(family):
    "The relatives take attention_bias=True (their MLPs without biases) as LLaMA does; SmolLM3 takes mlp_bias=True too."
    name = next(n for n, (f, _) in CASES.items() if f == family)
    extra = [dict(mlp_bias=True)] if family == 'SmolLM3' else []
    for over in [dict(attention_bias=True)] + extra:
        model = case(name, **over)
        lm = DecoderLM.from_transformers(model)
        assert (lm.layers[0].self_attn.module.output.bias is not None) == bool(over.get('attention_bias'))
        x = tokens(2, 20)
        with torch.no_grad(): assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL


def test_to_transformers_gives_qkv_biases_without_the_outputs_to_qwen2():
    "LLaMA's attention_bias sets all four projections' biases: q/k/v biases without the output's are Qwen2's layer."
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='rotary', norm='rms', ffn='swiglu', bias=False,
                   qkv_bias=True, head_bias=False)
    assert type(lm.to_transformers()).__name__ == 'Qwen2ForCausalLM'
    assert type(DecoderLM.from_transformers(case('qwen2')).to_transformers()).__name__ == 'Qwen2ForCausalLM'
    with pytest.raises(ValueError, match=r"LlamaForCausalLM needs output_bias=False \(needs True\)"):   # and MLP biases: none
        DecoderLM(11, d_model=16, heads=2, n_layers=1, position='rotary', norm='rms', ffn='swiglu', bias=True,
                  qkv_bias=True, output_bias=False, head_bias=False).to_transformers()


def test_to_transformers_gives_the_relatives_switches_to_their_classes():
    "A converted Gemma is not handed to LLaMA with its switches dropped, nor a window or q/k norms of a model built by hand."
    assert type(DecoderLM.from_transformers(case('gemma')).to_transformers()).__name__ == 'GemmaForCausalLM'
    kw = dict(d_model=16, heads=2, n_layers=2, position='rotary', norm='rms', ffn='swiglu', bias=False, head_bias=False)
    for over, cls in ((dict(layer_types=['sliding_attention', 'full_attention'], sliding_window=3), 'SmolLM3ForCausalLM'),
                      (dict(sliding_window=3), 'MistralForCausalLM'), (dict(qk_norm='head'), 'Qwen3ForCausalLM')):
        assert type(DecoderLM(11, **kw, **over).to_transformers()).__name__ == cls


@pytest.mark.parametrize("name", ['smollm3', 'smollm3_windows'])
def test_smollm3_nope_layers_are_the_sources(name):
    "SmolLM3's layers without rotation are DecoderLM's nope_layers; rotating them too changes the logits."
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    want = [i for i, r in enumerate(model.config.no_rope_layers) if not r]
    assert list(lm.nope_layers) == want == ([3] if name == 'smollm3' else [1, 3])
    assert [type(l.self_attn.module).__name__ for l in lm.layers][want[0]] == 'MultiHeadAttention'
    assert type(from_transformers(model.model.layers[want[0]].self_attn)).__name__ == 'MultiHeadAttention'
    if name == 'smollm3_windows':
        assert lm.layer_types == ('full_attention', 'sliding_attention') * 2 and lm.sliding_window == 4
    x = tokens(2, 16)
    rotated = DecoderLM.from_transformers(model)
    rotated_sd = rotated.state_dict()
    rotated = DecoderLM(V, **{**{k: v for k, v in rotated.to_config().items() if k != 'n_vocab'}, 'nope_layers': ()}).double()
    rotated.load_state_dict(rotated_sd)
    with torch.no_grad():
        assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL and max_err(rotated(x)[0], ref_logits(model, x)) > 1e-4


def test_llama4_layer_pattern_read_from_the_modules():
    "Llama 4: chunked rotary layers (interleaved pairs, weightless q/k norms) and a NoPE layer with the query temperature."
    model = case('llama4')
    lm = DecoderLM.from_transformers(model)
    assert lm.layer_types == ('chunked_attention',) * 3 + ('full_attention',) and lm.attention_chunk_size == 4
    assert lm.nope_layers == (3,) and lm.query_temperature == (3.0, 0.5) and lm.qk_norm is None
    assert lm.layer_positions == {'chunked_attention': {'qk_norm': 'head_unscaled', 'query_temperature': None}}
    a, nope = lm.layers[0].self_attn.module, lm.layers[3].self_attn.module
    assert a.interleaved and a.query.norm.weight is None and a.query_temperature is None
    assert type(nope).__name__ == 'MultiHeadAttention' and nope.query_temperature == (3.0, 0.5)
    assert lm.new_cache(2, 64).max_cache_len == 64   # the NoPE layer attends everything
    x = tokens(2, 14)
    want = ref_logits(model, x)
    for change in ('chunk', 'temperature'):   # without either, other logits: both are the source's
        other = DecoderLM.from_transformers(model)
        if change == 'chunk': other.attention_chunk_size = 14
        else: other.layers[3].self_attn.module.query_temperature = None
        with torch.no_grad(): assert max_err(other(x)[0], want) > 1e-4, change
    uniform = DecoderLM.from_transformers(case('llama4_plain'))   # NoPE layers 1 and 3, no norms, no temperature
    assert uniform.nope_layers == (1, 3) and uniform.layer_positions is None and uniform.attention_chunk_size == 6


def test_chunked_layers_decode_from_a_ring_of_one_chunk():
    "Every layer chunked: the cache keeps one chunk of slots, and decoding across chunk boundaries equals the full forward."
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='rotary', attention_chunk_size=4, norm='rms',
                   query_temperature=(2.0, 0.3)).double().eval()
    x = torch.randint(0, 13, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lm(x)[0]
        cache = lm.new_cache(2, 100)
        assert cache.max_cache_len == 4
        got = [lm(x[:, :6], cache=cache)[0], lm(x[:, 6:9], cache=cache)[0]] + [lm(x[:, t:t + 1], cache=cache)[0] for t in range(9, 15)]
        assert max_err(torch.cat(got, 1), want) <= TOL and max_err(full_logits(lm, x), want) <= TOL
        lm.attention_chunk_size = None   # the chunks matter
        assert max_err(lm(x)[0][:, 4:], want[:, 4:]) > 1e-4


def test_query_temperature_and_unscaled_norms_checked():
    with pytest.raises(ValueError, match=r"query_temperature must be None or \(floor_scale > 0, attn_scale\)"):
        DecoderLM(11, position='rotary', query_temperature=(0, 0.1))
    with pytest.raises(ValueError, match=r"query_temperature=\(8, 0.1\): position=.xl."):
        DecoderLM(11, layer_positions={'full_attention': dict(query_temperature=(8, 0.1))})
    with pytest.raises(ValueError, match=r"layer_positions\['full_attention'\]\['qk_norm'\] must be one of"):
        DecoderLM(11, position='rotary', layer_positions={'full_attention': dict(qk_norm='l2')})
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='rotary', qk_norm='head_unscaled')
    assert lm.layers[0].self_attn.module.query.norm.weight is None and not any('norm.weight' in k and 'query' in k for k in lm.state_dict())


@pytest.mark.parametrize("name", ['llama4', 'gemma3'])
def test_left_padded_generation_equals_transformers(name):
    "Rows of different lengths, left-padded: each row's chunks start at its first token (transformers' chunked mask), windows count slots."
    model = case(name, scale=4.0)
    if name in GEMMAS:
        with torch.no_grad(): model.model.embed_tokens.weight.mul_(0.1)
    lm = DecoderLM.from_transformers(model)
    prompt = tokens(3, 7, seed=9)
    keep = torch.ones(3, 7, dtype=torch.long); keep[0, :3] = 0; keep[2, :1] = 0
    with float32_as_float64(), torch.no_grad():
        want = model.generate(prompt, attention_mask=keep, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = lm.generate(prompt, 12, attention_mask=keep, do_sample=False)
    assert torch.equal(got, want)


def test_chunked_cache_with_left_padding_equals_the_full_model():
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='rotary', norm='rms', attention_chunk_size=3,
                   layer_types=['chunked_attention', 'full_attention']).double().eval()
    x = torch.randint(0, 13, (3, 13), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(3, 13, dtype=torch.long); keep[0, :4] = 0; keep[1, :1] = 0
    with torch.no_grad():
        want = full_logits(lm, x, keep)
        ids = (keep.cumsum(-1) - 1).clamp(min=0)
        rows = keep.bool()
        assert max_err(lm(x, position_ids=ids, attention_mask=keep)[0], want, rows) <= TOL   # the forward's own masks
        cache = lm.new_cache(3, 32)
        got = [lm(x[:, :6], cache=cache, attention_mask=keep[:, :6])[0], lm(x[:, 6:8], cache=cache)[0]]
        got += [lm(x[:, t:t + 1], cache=cache)[0] for t in range(8, 13)]
        assert max_err(torch.cat(got, 1), want, rows) <= TOL
        shifted = full_logits(lm, x[1:2, 1:])   # row 1 without its padding: the same chunks from its first token
        assert max_err(want[1:2, 1:], shifted) <= TOL


def test_a_layer_type_with_its_own_position_method():
    "layer_positions[type]['position']: those layers take another method (ALiBi, or none at all), the cache and position ids follow."
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=3, position='rotary', norm='rms', sliding_window=3,
                   layer_types=['sliding_attention', 'full_attention', 'sliding_attention'],
                   layer_positions={'full_attention': dict(position='none')}).double().eval()
    assert [type(l.self_attn.module).__name__ for l in lm.layers] == ['RotaryMultiHeadAttention', 'MultiHeadAttention',
                                                                     'RotaryMultiHeadAttention']
    x = torch.randint(0, 13, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = lm(x)[0]
        assert max_err(lm(x, position_ids=torch.arange(12))[0], want) <= TOL   # the NoPE layer takes no ids
        cache = lm.new_cache(2, 32)
        got = torch.cat([lm(x[:, :5], cache=cache)[0]] + [lm(x[:, t:t + 1], cache=cache)[0] for t in range(5, 12)], 1)
        assert max_err(got, want) <= TOL
    alibi = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='rotary', layer_types=['full_attention', 'sliding_attention'],
                      sliding_window=4, layer_positions={'sliding_attention': dict(position='alibi')})
    assert type(alibi.layers[1].self_attn.module).__name__ == 'ALiBiMultiHeadAttention'
    with pytest.raises(ValueError, match=r"layer_positions\['full_attention'\]\['position'\] must be one of"):
        DecoderLM(13, position='rotary', layer_positions={'full_attention': dict(position='cope2')})


@pytest.mark.parametrize("kw", [dict(layer_types=['sliding_attention', 'full_attention'], sliding_window=3),
                                dict(layer_types=['chunked_attention', 'full_attention'], attention_chunk_size=4)])
def test_uncached_generate_picks_the_cached_tokens(kw):
    "generate(use_cache=False) runs the layers over all earlier inputs with the same per-layer masks."
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='rotary', norm='rms', **kw).double().eval()
    with torch.no_grad():
        for p in lm.parameters(): p.mul_(3)
    prompt = torch.randint(0, 13, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(lm.generate(prompt, 12, temperature=0, use_cache=False), lm.generate(prompt, 12, temperature=0))


def test_gemma3_ignores_attn_logit_softcapping_as_transformers_does():
    "Gemma 3's config still has attn_logit_softcapping, but its attention passes no cap (eager or SDPA): nor does the conversion."
    model = case('gemma3', attn_logit_softcapping=0.5)
    model.config._attn_implementation = 'eager'
    lm = DecoderLM.from_transformers(model)
    assert lm.attn_softcap is None
    x = tokens(2, 12)
    with torch.no_grad(): assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL


@pytest.mark.parametrize("position", [p for p in __import__('relpos.models', fromlist=['POSITIONS']).POSITIONS])
def test_every_position_decodes_a_sliding_layer_beside_a_global_one(position):
    "A window narrower than the ring: decode reads its slots alone, for every method's position term; padding included."
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position=position, max_len=64, sliding_window=3,
                   layer_types=['sliding_attention', 'full_attention']).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    x = torch.randint(0, 13, (2, 14), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 14, dtype=torch.long); keep[1, :2] = 0
    rows = keep.bool()
    for mask in (None, keep):
        with torch.no_grad():
            want = full_logits(lm, x, mask)
            cache = lm.new_cache(2, 32)
            got = [lm(x[:, :5], cache=cache, attention_mask=None if mask is None else mask[:, :5])[0], lm(x[:, 5:7], cache=cache)[0]]
            got += [lm(x[:, t:t + 1], cache=cache)[0] for t in range(7, 14)]
            assert max_err(torch.cat(got, 1), want, rows) <= TOL, (position, mask is None)

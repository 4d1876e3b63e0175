"""DecoderLM.from_transformers for LLaMA's relatives -- Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 and OLMo 2
(q/k norms; OLMo 2's post-norm block), Phi-3 (fused projections, partial rotary, longrope) -- against transformers in
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
}


def make(family, scale=1.0, **over):
    "A tiny random `<family>ForCausalLM` in float64; norms and biases moved off their initial ones and zeros (so they matter)."
    cfg_cls, model_cls = getattr(transformers, family + 'Config'), getattr(transformers, family + 'ForCausalLM')
    kw = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=1,
              initializer_range=0.2)
    kw.update(over)
    with float32_as_float64():
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = 'sdpa'
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


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2', 'qwen3', 'olmo2', 'phi3_longrope_window'])
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
@pytest.mark.parametrize("name", ['mistral_window', 'qwen2_window', 'qwen3', 'olmo2', 'phi3', 'phi3_longrope_window'])
def test_greedy_tokens_equal_transformers_generate(name):
    model = case(name, scale=4.0)   # larger weights: peaked distributions, many different tokens
    lm = DecoderLM.from_transformers(model)
    n = 6 if name.startswith('phi3_longrope') else 20   # longrope: within its original length (see 09a: cache_exact_len)
    prompt = tokens(3, 6, seed=4)
    with float32_as_float64(), torch.no_grad():
        want = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = lm.generate(prompt, n, temperature=0)
    assert torch.equal(got, want)
    assert len(set(want[:, 6:].flatten().tolist())) > 5   # not one token repeated


@pytest.mark.parametrize("name", ['mistral_window', 'qwen2_window', 'qwen3', 'qwen3_mqa_tied', 'olmo2', 'phi3',
                                  'phi3_longrope_window'])
def test_cached_decoding_equals_the_full_forward(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    total = 16 if name.startswith('phi3_longrope') else 22
    x = tokens(2, total, seed=5)
    with torch.no_grad():
        want = lm(x)[0]
        assert max_err(want, ref_logits(model, x)) <= TOL
        cache = lm.new_cache(2, 64)
        window = model.config.sliding_window if lm.sliding_window is not None else None
        assert cache.max_cache_len == (window or 64)   # a windowed model keeps its window, no more
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
    ('Llama', 'attention_bias'): dict(attention_bias=True),
    ('Llama', 'mlp_bias'): dict(mlp_bias=True),
    ('Llama', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('GPTNeoX', 'hidden_act'): dict(hidden_act='relu'),
    ('GPTNeoX', 'attention_bias'): dict(attention_bias=False),
    ('Mistral', 'hidden_act'): dict(hidden_act='gelu'),
    ('Mistral', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Qwen2', 'hidden_act'): dict(hidden_act='gelu'),
    ('Qwen2', 'layer_types'): dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ('Qwen2', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Qwen3', 'hidden_act'): dict(hidden_act='gelu'),
    ('Qwen3', 'attention_bias'): dict(attention_bias=True),
    ('Qwen3', 'layer_types'): dict(layer_types=['full_attention', 'sliding_attention'], sliding_window=4, use_sliding_window=True),
    ('Qwen3', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Olmo2', 'hidden_act'): dict(hidden_act='gelu'),
    ('Olmo2', 'attention_bias'): dict(attention_bias=True),
    ('Olmo2', 'partial_rotary_factor'): dict(rope_parameters=dict(YARN_PARTIAL)),
    ('Phi3', 'hidden_act'): dict(hidden_act='gelu'),
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

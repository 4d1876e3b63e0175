"""DecoderLM.from_transformers for the older layouts -- GPT-2 (learned absolute positions), BLOOM (ALiBi, a norm on the
embeddings), GPT-J (interleaved partial rotary, one norm read by attention and MLP in parallel) and Falcon (multi-query
or grouped heads, one norm or two, parallel or sequential blocks) -- against transformers in float64 (its float32 steps
in float64, see test_modern.float32_as_float64): logits, greedy tokens of `generate`, cached decoding against the full
forward, position swaps, every refusal the registry lists, and the way back (`to_transformers`). Tiny random models
built from configs (no hub). Bound 1e-10."""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from relpos.hf import from_transformers, MODEL_CONVERTERS, CONFIG_REFUSALS, SWAP_POSITIONS
from relpos.models import DecoderLM, NormedEmbedding
from relpos.cache import full_logits
from test_modern import float32_as_float64, max_err, run, causal

TOL = 1e-10
V = 64
FAMILIES = {'GPT2': 'GPT2LMHeadModel', 'Bloom': 'BloomForCausalLM', 'GPTJ': 'GPTJForCausalLM', 'Falcon': 'FalconForCausalLM'}
SIZES = {   # the same shapes under each config's own names
    'GPT2': dict(n_embd=48, n_layer=2, n_head=6, n_positions=64),
    'Bloom': dict(hidden_size=48, n_layer=2, n_head=6),
    'GPTJ': dict(n_embd=48, n_layer=2, n_head=6, n_positions=64, rotary_dim=4),
    'Falcon': dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=6, max_position_embeddings=64),
}
CASES = {   # id: (family, config overrides)
    'gpt2': ('GPT2', {}),
    'gpt2_untied_inner': ('GPT2', dict(n_inner=40, tie_word_embeddings=False, activation_function='gelu')),
    'bloom': ('Bloom', {}),
    'bloom_untied': ('Bloom', dict(tie_word_embeddings=False)),
    'gptj': ('GPTJ', {}),
    'gptj_whole_heads': ('GPTJ', dict(rotary_dim=8, tie_word_embeddings=True)),
    'falcon_mqa': ('Falcon', {}),                                                   # multi-query, one norm, parallel
    'falcon_gqa_two_norms': ('Falcon', dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)),
    'falcon_gqa_one_norm': ('Falcon', dict(new_decoder_architecture=True, num_kv_heads=3, num_ln_in_parallel_attn=1)),
    'falcon_sequential': ('Falcon', dict(multi_query=False, parallel_attn=False, bias=True,
                                         rope_parameters={'rope_type': 'linear', 'factor': 2.0, 'rope_theta': 500.0})),
}


def make(family, scale=1.0, **over):
    "A tiny random transformers model of `family` in float64; norms and biases moved off their initial ones and zeros."
    cfg_cls, model_cls = getattr(transformers, family + 'Config'), getattr(transformers, FAMILIES[family])
    kw = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=1, initializer_range=0.2, **SIZES[family])
    kw.update(over)
    with float32_as_float64():
        cfg = cfg_cls(**kw)
        cfg._attn_implementation = 'sdpa' if model_cls._supports_sdpa else 'eager'
        torch.manual_seed(0)
        model = model_cls(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if 'norm' in name or 'ln' in name or name.endswith('bias'): p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            p.mul_(scale)
    return model


def case(name, **kw):
    family, over = CASES[name]
    return make(family, **{**over, **kw})


def ref_logits(model, tokens, **kw):
    with float32_as_float64(), torch.no_grad():
        return model(tokens, **kw).logits


def tokens(b, n, seed=2): return torch.randint(2, V, (b, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- logits, tokens, the cache
@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    x = tokens(2, 20)
    with torch.no_grad():
        assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL


@pytest.mark.parametrize("name", ['gpt2', 'bloom', 'gptj', 'falcon_gqa_two_norms'])
def test_logits_with_left_padding(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    x = tokens(2, 18, seed=3)
    keep = torch.ones(2, 18, dtype=torch.long); keep[0, :5] = 0
    ids = (keep.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = lm(x, position_ids=ids, attention_mask=keep)[0]
    theirs = {} if name == 'bloom' else dict(position_ids=ids)   # BLOOM reads its ALiBi positions off the mask
    assert max_err(got, ref_logits(model, x, attention_mask=keep, **theirs), keep.bool()) <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers_generate(name):
    model = case(name, scale=4.0)   # larger weights: peaked distributions, many different tokens
    lm = DecoderLM.from_transformers(model)
    prompt = tokens(3, 6, seed=4)
    with float32_as_float64(), torch.no_grad():
        want = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 20, temperature=0), want)
    assert len(set(want[:, 6:].flatten().tolist())) > 5   # not one token repeated


@pytest.mark.parametrize("name", ['gpt2', 'bloom', 'gptj', 'falcon_mqa'])
def test_greedy_tokens_with_left_padding(name):
    "Rows of different lengths, left-padded: each row's positions start at its first token, as transformers' `generate` counts them."
    model = case(name, scale=4.0)
    lm = DecoderLM.from_transformers(model)
    prompt = tokens(2, 8, seed=6)
    keep = torch.ones(2, 8, dtype=torch.long); keep[0, :3] = 0
    with float32_as_float64(), torch.no_grad():
        want = model.generate(prompt, attention_mask=keep, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(lm.generate(prompt, 12, temperature=0, attention_mask=keep), want)


def test_absolute_positions_beyond_the_table_are_refused():
    lm = DecoderLM.from_transformers(case('gpt2'))
    with pytest.raises(ValueError, match="position_ids reach position 64, but position='absolute' covers positions < max_len=64"):
        lm(tokens(1, 4), position_ids=torch.tensor([[0, 1, 2, 64]]))


@pytest.mark.parametrize("name", list(CASES))
def test_cached_decoding_equals_the_full_forward(name):
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    x = tokens(2, 22, seed=5)
    with torch.no_grad():
        want = lm(x)[0]
        cache = lm.new_cache(2, 32)
        got = [lm(x[:, :7], cache=cache)[0], lm(x[:, 7:10], cache=cache)[0]]            # prefill, then a chunk
        got += [lm(x[:, t:t + 1], cache=cache)[0] for t in range(10, 22)]              # then one token at a time
        assert max_err(torch.cat(got, 1), want) <= TOL
        assert max_err(full_logits(lm, x), want) <= TOL


def test_architecture_read_from_the_modules():
    "What each family converts to: DecoderLM's arguments, and the relpos modules they build."
    arch = lambda lm: (lm.position, lm.ffn_kind, lm.parallel_residual, lm.shared_norm, lm.embedding_norm, lm.bias,
                       lm.qkv_bias, lm.output_bias, lm.generator.bias is not None, lm.tie_embeddings, lm.kv_heads)
    assert arch(DecoderLM.from_transformers(case('gpt2'))) == ('absolute', 'gelu_tanh', False, False, False, True, None, None, False, True, None)
    assert arch(DecoderLM.from_transformers(case('gpt2_untied_inner'))) == ('absolute', 'gelu', False, False, False, True, None, None, False, False, None)
    bloom = DecoderLM.from_transformers(case('bloom'))
    assert arch(bloom) == ('alibi', 'bloom_gelu', False, False, True, True, None, None, False, True, None)
    assert isinstance(bloom.src_embed, NormedEmbedding) and bloom.generator.weight is bloom.src_embed.weight
    gptj = DecoderLM.from_transformers(case('gptj'))
    assert arch(gptj) == ('rotary', 'gelu_tanh', True, True, False, True, False, False, True, False, None)
    a = gptj.layers[0].self_attn.module
    assert a.interleaved and a.rotary_dim == 4 and a.query.linear.bias is None and a.output.bias is None
    assert gptj.layers[0].norm_ff is None and gptj.layers[0].feed_forward.layer1.bias is not None
    assert arch(DecoderLM.from_transformers(case('falcon_mqa'))) == ('rotary', 'gelu', True, True, False, False, None, None, False, True, 1)
    assert arch(DecoderLM.from_transformers(case('falcon_gqa_two_norms'))) == ('rotary', 'gelu', True, False, False, True, None, None, False, True, 2)
    assert arch(DecoderLM.from_transformers(case('falcon_gqa_one_norm')))[2:4] == (True, True)
    seq = DecoderLM.from_transformers(case('falcon_sequential'))
    assert arch(seq)[2:4] == (False, False) and seq.kv_heads == 6 and seq.layers[0].self_attn.module.rope_scaling['rope_type'] == 'linear'


def test_the_switches_are_the_sources():
    "Each switch off gives other logits: converted, not ignored."
    x = tokens(2, 12)
    for name, attr, value, sub in (('bloom', 'src_embed', nn.Embedding, None), ('gptj', 'interleaved', False, 'attn'),
                                   ('gptj', 'norm_ff', 'copy', 'layer'), ('bloom', 'activation', nn.GELU(approximate='tanh'), 'ffn')):
        model = case(name)
        lm = DecoderLM.from_transformers(model)
        want = ref_logits(model, x)
        if sub is None:
            e = nn.Embedding(V, 48).double(); e.weight = lm.src_embed.weight; lm.src_embed = e
        for layer in lm.layers:
            if sub == 'attn': layer.self_attn.module.interleaved = value
            if sub == 'layer': layer.norm_ff = nn.LayerNorm(48).double()
            if sub == 'ffn': layer.feed_forward.activation = value
        with torch.no_grad(): err = max_err(lm(x)[0], want)
        assert err > (1e-12 if sub == 'ffn' else 1e-4), (name, attr, err)   # BLOOM's GELU: its own constant


# ---------------------------------------------------------------- swaps, attention modules, saving
@pytest.mark.parametrize("name", ['gpt2', 'bloom', 'gptj', 'falcon_gqa_two_norms'])
def test_every_swap_builds_and_runs(name):
    model = case(name)
    own = DecoderLM.from_transformers(model).state_dict()
    for position in SWAP_POSITIONS:
        lm = DecoderLM.from_transformers(model, position=position)
        assert lm.pos_embed is None
        with torch.no_grad(): assert lm(tokens(1, 9))[0].isfinite().all(), position
        for k, v in lm.state_dict().items():
            if '.positions.' in k or k not in own: continue
            if v.shape == own[k].shape: assert torch.equal(v, own[k]), (position, k)


def test_gpt2_without_its_positions_is_position_none():
    "Swapping GPT-2's table out leaves plain attention: `position='none'` is GPT-2 with its position table zeroed."
    model = case('gpt2')
    none = DecoderLM.from_transformers(model, position='none')
    with torch.no_grad(): model.transformer.wpe.weight.zero_()
    x = tokens(2, 10)
    with torch.no_grad(): assert max_err(none(x)[0], ref_logits(model, x)) <= TOL


@pytest.mark.parametrize("name", ['gpt2', 'falcon_mqa', 'falcon_gqa_two_norms', 'falcon_sequential'])
def test_attention_modules_convert(name):
    model = case(name)
    layer0 = model.transformer.h[0]
    ref = layer0.attn if name == 'gpt2' else layer0.self_attention
    ours = from_transformers(ref)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randn(2, 12, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    ids = torch.arange(12)[None].expand(2, 12)
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.float64).masked_fill(~causal(2, 12)[:, None], float('-inf'))
    with float32_as_float64(), torch.no_grad():
        if name == 'gpt2': want = ref(x, attention_mask=mask)[0]
        else: want = ref(x, alibi=None, attention_mask=mask, position_embeddings=model.transformer.rotary_emb(x, ids))[0]
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, 12)), want) <= TOL


@pytest.mark.parametrize("name", ['bloom', 'gptj', 'falcon_mqa'])
def test_save_and_reload(name, tmp_path):
    lm = DecoderLM.from_transformers(case(name))
    lm.save_pretrained(tmp_path)
    again = DecoderLM.from_pretrained(tmp_path)
    x = tokens(2, 9)
    with torch.no_grad(): assert torch.equal(again(x)[0], lm(x)[0])


# ---------------------------------------------------------------- refusals and DecoderLM's arguments
REFUSED = {   # (model class, config key): overrides that set it to a value DecoderLM cannot express
    ('GPT2LMHeadModel', 'activation_function'): ('GPT2', dict(activation_function='relu')),
    ('GPT2LMHeadModel', 'scale_attn_by_inverse_layer_idx'): ('GPT2', dict(scale_attn_by_inverse_layer_idx=True)),
    ('GPT2LMHeadModel', 'scale_attn_weights'): ('GPT2', dict(scale_attn_weights=False)),
    ('GPT2LMHeadModel', 'add_cross_attention'): ('GPT2', dict(add_cross_attention=True)),
    ('BloomForCausalLM', 'apply_residual_connection_post_layernorm'): ('Bloom', dict(apply_residual_connection_post_layernorm=True)),
    ('GPTJForCausalLM', 'activation_function'): ('GPTJ', dict(activation_function='relu')),
    ('FalconForCausalLM', 'activation'): ('Falcon', dict(activation='relu')),
    ('FalconForCausalLM', 'alibi'): ('Falcon', dict(alibi=True)),
    ('FalconForCausalLM', 'attention_dropout'): ('Falcon', dict(parallel_attn=False, multi_query=False, attention_dropout=0.1)),
    ('FalconForCausalLM', 'hidden_dropout'): ('Falcon', dict(hidden_dropout=0.1)),
}


def test_every_listed_refusal_is_tested():
    listed = {(cls, key) for cls in FAMILIES.values() for key in CONFIG_REFUSALS[cls]}
    assert listed == set(REFUSED) and set(FAMILIES.values()) <= set(MODEL_CONVERTERS)


@pytest.mark.parametrize("cls,key", list(REFUSED))
def test_refused_by_config_key(cls, key):
    family, over = REFUSED[(cls, key)]
    with pytest.raises(ValueError, match=key):
        DecoderLM.from_transformers(make(family, **over))


def test_decoder_lm_arguments_are_checked():
    with pytest.raises(ValueError, match="shared_norm=True: .* needs parallel_residual=True"): DecoderLM(11, shared_norm=True)
    with pytest.raises(TypeError, match="embedding_norm must be a bool"): DecoderLM(11, embedding_norm=1)
    with pytest.raises(TypeError, match="output_bias must be None"): DecoderLM(11, output_bias='no')
    with pytest.raises(ValueError, match="ffn must be one of"): DecoderLM(11, ffn='gelu_new')
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='rotary', output_bias=False, parallel_residual=True,
                   shared_norm=True, embedding_norm=True, norm='rms')
    a = lm.layers[0].self_attn.module
    assert a.output.bias is None and a.query.linear.bias is not None and lm.layers[0].feed_forward.layer1.bias is not None
    assert isinstance(lm.src_embed.norm, nn.RMSNorm) and not any('norm_ff' in k for k in lm.state_dict())
    assert type(lm)(**lm.to_config()).state_dict().keys() == lm.state_dict().keys()


# ---------------------------------------------------------------- the way back
@pytest.mark.parametrize("name", list(CASES))
def test_to_transformers_round_trip(name):
    "Converted and handed back: the same class, every weight where it came from, the same logits."
    model = case(name)
    lm = DecoderLM.from_transformers(model)
    with float32_as_float64(): back = lm.to_transformers()   # its rotary tables built as the source's were
    # a sequential Falcon with one key/value head per query head and biases is GPT-NeoX's layer: the first class tried
    assert type(back).__name__ == ('GPTNeoXForCausalLM' if name == 'falcon_sequential' else type(model).__name__)
    theirs = model.state_dict()
    for k, v in back.state_dict().items():
        if k in theirs: assert torch.equal(v, theirs[k]), k
    x = tokens(2, 15)
    with torch.no_grad(): assert max_err(ref_logits(back, x), ref_logits(model, x)) <= TOL


BUILT = [   # the class to_transformers picks <- DecoderLM arguments
    ('GPT2LMHeadModel', dict(position='absolute', max_len=32, ffn='gelu_tanh', head_bias=False, tie_embeddings=True)),
    ('BloomForCausalLM', dict(position='alibi', ffn='bloom_gelu', head_bias=False, embedding_norm=True)),
    ('GPTJForCausalLM', dict(position='rotary', rotary_dim=2, interleaved=True, ffn='gelu_tanh', qkv_bias=False,
                             output_bias=False, parallel_residual=True, shared_norm=True)),
    ('FalconForCausalLM', dict(position='rotary', ffn='gelu', bias=False, head_bias=False, kv_heads=2,
                               parallel_residual=True, shared_norm=True, base=500.0)),
    ('FalconForCausalLM', dict(position='rotary', ffn='gelu_tanh', bias=False, head_bias=False, kv_heads=1)),   # sequential
    ('FalconForCausalLM', dict(position='rotary', ffn='gelu', bias=True, head_bias=False, kv_heads=2, parallel_residual=True)),
]


@pytest.mark.parametrize("cls,kw", BUILT)
def test_a_built_decoder_lm_goes_to_its_class(cls, kw):
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=24, heads=4, n_layers=2, **kw).double().eval()
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn_like(p))
    with float32_as_float64(): back = lm.to_transformers()
    assert type(back).__name__ == cls
    x = tokens(2, 15)
    with torch.no_grad(): assert max_err(ref_logits(back, x), lm(x)[0]) <= TOL


def test_what_no_class_expresses_is_refused_by_name():
    with pytest.raises(ValueError, match=r"BloomForCausalLM needs ffn='gelu_tanh' \(needs 'bloom_gelu'\)"):
        DecoderLM(V, d_model=24, heads=4, position='alibi', ffn='gelu_tanh', head_bias=False, embedding_norm=True).to_transformers()
    with pytest.raises(ValueError, match=r"GPTNeoXForCausalLM needs .*shared_norm=True \(needs False\)"):
        DecoderLM(V, d_model=24, heads=4, position='rotary', rotary_dim=2, ffn='gelu', head_bias=False,
                  parallel_residual=True, shared_norm=True).to_transformers()
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel needs embedding_norm=True \(needs False\)"):
        DecoderLM(V, d_model=24, heads=4, position='absolute', max_len=8, ffn='gelu_tanh', head_bias=False,
                  embedding_norm=True).to_transformers()
    with pytest.raises(ValueError, match="position='fire' has no transformers counterpart"):
        DecoderLM(V, d_model=24, heads=4, position='fire').to_transformers()


# ---------------------------------------------------------------- transformers' `proportional` rope type (Gemma 4)
from relpos.rotary import rope_parameters, RotaryMultiHeadAttention
from test_modern import llama_pair, llama_ref


@pytest.mark.parametrize("prf", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("factor", [None, 2.0])
@pytest.mark.parametrize("dim", [16, 12])
def test_proportional_frequencies_are_transformers(prf, factor, dim):
    "Bit for bit transformers' `ROPE_INIT_FUNCTIONS['proportional']` on a LlamaConfig with the same dict, float32; factor 1."
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {'rope_type': 'proportional', 'partial_rotary_factor': prf, **({} if factor is None else {'factor': factor})}
    cfg = transformers.LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim,
                                   rope_parameters={**rope, 'rope_theta': 500.0})
    want, want_a = ROPE_INIT_FUNCTIONS['proportional'](cfg, None)
    got, a = rope_parameters(rope, dim, base=500.0)
    assert torch.equal(got, want) and a == want_a == 1.0
    turning = int(prf * dim // 2)
    assert (got[turning:] == 0).all() and (got[:turning] > 0).all()


def test_proportional_is_not_partial_rotary():
    "The turning pairs keep the whole head's frequencies, where a partial rotation of p D features has its own."
    prop, _ = rope_parameters({'rope_type': 'proportional', 'partial_rotary_factor': 0.5}, 16)
    part, _ = rope_parameters(None, 8)
    whole, _ = rope_parameters(None, 16)
    assert torch.equal(prop[:4], whole[:4]) and not torch.equal(prop[:4], part)


@pytest.mark.parametrize("prf", [0.25, 0.5])
def test_proportional_attention_equals_llamas(prf):
    "A LLaMA attention whose config has the proportional rope: relpos's layer gives its outputs, also with position ids."
    rope = {'rope_type': 'proportional', 'factor': 2.0, 'partial_rotary_factor': prf}
    ref, emb, ours = llama_pair(rope=rope)
    x = torch.randn(2, 10, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ids = torch.arange(10)[None].expand(2, 10) + torch.tensor([[0], [7]])
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, 10), ids), llama_ref(ref, emb, x, causal(2, 10), ids)) <= TOL


def test_proportional_llama_converts_whole():
    "`DecoderLM.from_transformers` reads the proportional rope off a Llama config: whole-head rotation, the same logits."
    with float32_as_float64():
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                       rope_parameters={'rope_type': 'proportional', 'partial_rotary_factor': 0.5,
                                                        'factor': 2.0, 'rope_theta': 1000.0})
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).double().eval()
    lm = DecoderLM.from_transformers(model)
    a = lm.layers[0].self_attn.module
    assert a.rotary_dim == 8 and a.rope_scaling['rope_type'] == 'proportional'
    x = tokens(2, 16)
    with torch.no_grad():
        assert max_err(lm(x)[0], ref_logits(model, x)) <= TOL
        cache = lm.new_cache(2, 16)
        got = torch.cat([lm(x[:, :6], cache=cache)[0]] + [lm(x[:, t:t + 1], cache=cache)[0] for t in range(6, 16)], 1)
        assert max_err(got, lm(x)[0]) <= TOL


def test_proportional_refuses_a_partial_rotation():
    with pytest.raises(ValueError, match="rope_type 'proportional' rotates whole heads"):
        RotaryMultiHeadAttention(4, 32, rotary_dim=4, rope_scaling={'rope_type': 'proportional', 'partial_rotary_factor': 0.5})

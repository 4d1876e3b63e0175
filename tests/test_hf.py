"""relpos.hf against transformers in float64 (its float32 steps in float64, see test_modern.float32_as_float64):
converted attention modules and whole models (LLaMA with GQA and each rope type, GPT-NeoX with rotary_pct 0.25 and a
parallel residual): causal, left and right padding, a prefix in Transformer-XL memory then new tokens. Bound 1e-10."""
import math
from pathlib import Path
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, GPTJConfig, BloomConfig, T5Config
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.gptj.modeling_gptj import GPTJAttention
from transformers.models.bloom.modeling_bloom import BloomAttention
from transformers.models.t5.modeling_t5 import T5Attention

from relpos.hf import from_transformers, decoder_from_transformers, ATTENTION_CONVERTERS, MODEL_CONVERTERS
from relpos.models import DecoderLM
from relpos.rotary import RotaryMultiHeadAttention
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.t5 import T5MultiHeadAttention
from test_modern import float32_as_float64, ROPES, additive, causal, run, max_err

TOL = 1e-10


def llama_model(rope=None, kv_heads=2, tie=False, seed=0, impl='sdpa'):
    with float32_as_float64():
        cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-6,
                          tie_word_embeddings=tie, rope_parameters={**(rope or {'rope_type': 'default'}), 'rope_theta': 500.0})
        cfg._attn_implementation = impl
        torch.manual_seed(seed)
        return LlamaForCausalLM(cfg).double().eval()


def neox_model(seed=0, parallel=True):
    with float32_as_float64():
        cfg = GPTNeoXConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            rotary_pct=0.25, max_position_embeddings=64, use_parallel_residual=parallel)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(cfg).double().eval()


def ref_logits(model, tokens, **kw):
    with float32_as_float64(), torch.no_grad():
        return model(tokens, **kw).logits


def padded(b, n, left=None, right=None):
    keep = torch.ones(b, n, dtype=torch.long)
    if left: keep[0, :left] = 0
    if right: keep[-1, n - right:] = 0
    return keep, (keep.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("kv_heads", [2, 4, 8])   # 4:1, 2:1, plain
def test_llama_logits(rope, kv_heads):
    model = llama_model(ROPES[rope], kv_heads)
    lm = DecoderLM.from_transformers(model)
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))   # 30 > 16 = original length
    with torch.no_grad():
        assert max_err(lm(tokens)[0], ref_logits(model, tokens)) <= TOL


@pytest.mark.parametrize("rope", ['default', 'llama3', 'yarn'])
def test_llama_logits_padding(rope):
    model = llama_model(ROPES[rope])
    lm = DecoderLM.from_transformers(model)
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(2))
    keep, ids = padded(2, 20, left=6, right=4)
    with torch.no_grad():
        got = lm(tokens, position_ids=ids, attention_mask=keep)[0]
    want = ref_logits(model, tokens, attention_mask=keep, position_ids=ids)
    assert max_err(got, want, keep.bool()) <= TOL


def test_llama_tied_embeddings_and_prefix_in_memory():
    "A prefix run first (its layer inputs kept as Transformer-XL memory), then new tokens: the logits of one full run."
    model = llama_model(ROPES['llama3'], tie=True)
    lm = DecoderLM.from_transformers(model)
    assert lm.generator.weight is lm.src_embed.weight
    tokens = torch.randint(0, 64, (2, 26), generator=torch.Generator().manual_seed(3))
    want = ref_logits(model, tokens)
    lm.mem_len = 20
    with torch.no_grad():
        first, memory = lm(tokens[:, :20])
        second, _ = lm(tokens[:, 20:], memory)
    assert max_err(first, want[:, :20]) <= TOL and max_err(second, want[:, 20:]) <= TOL


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox_logits(parallel):
    model = neox_model(parallel=parallel)
    lm = DecoderLM.from_transformers(model)
    assert lm.layers[0].self_attn.module.rotary_dim == 4 and lm.parallel_residual == parallel
    tokens = torch.randint(0, 64, (2, 18), generator=torch.Generator().manual_seed(4))
    keep, ids = padded(2, 18, left=3)
    with torch.no_grad():
        assert max_err(lm(tokens)[0], ref_logits(model, tokens)) <= TOL
        got = lm(tokens, position_ids=ids, attention_mask=keep)[0]
    assert max_err(got, ref_logits(model, tokens, attention_mask=keep, position_ids=ids), keep.bool()) <= TOL


def test_attention_modules_convert():
    "from_transformers on each supported attention module: the relpos class, the module's dtype, its parameter count."
    with float32_as_float64():
        llama = LlamaConfig(hidden_size=48, num_attention_heads=8, num_key_value_heads=2, head_dim=8)
        gptj = GPTJConfig(n_embd=32, n_head=4, rotary_dim=4)
        bloom = BloomConfig(hidden_size=32, n_head=4)
        t5 = T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=True)
    mods = [(LlamaAttention(llama, 0), RotaryMultiHeadAttention), (GPTJAttention(gptj, 0), RotaryMultiHeadAttention),
            (BloomAttention(bloom, 0), ALiBiMultiHeadAttention), (T5Attention(t5, True, 0), T5MultiHeadAttention)]
    for ref, cls in mods:
        ours = from_transformers(ref.double())
        assert type(ours) is cls and ours.output.weight.dtype == torch.float64
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())


def test_t5_later_layer_takes_the_first_layers_table():
    with float32_as_float64():
        cfg = T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=True, dropout_rate=0.0)
        cfg._attn_implementation = 'eager'
    torch.manual_seed(0)
    first, later = T5Attention(cfg, True, 0).double().eval(), T5Attention(cfg, False, 1).double().eval()
    with pytest.raises(ValueError, match="t5_bias_from"): from_transformers(later)
    ours = from_transformers(later, t5_bias_from=first)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        bias = first.compute_bias(12, 12)
        want = later(x, mask=additive(causal(2, 12)), position_bias=bias)[0]
        assert max_err(run(ours, x, causal(2, 12)), want) <= TOL


def test_unsupported_is_refused_with_the_supported_list():
    with pytest.raises(TypeError, match="supported transformers modules: LlamaAttention, GPTNeoXAttention, GPTJAttention, BloomAttention, T5Attention"):
        from_transformers(nn.MultiheadAttention(8, 2))
    with pytest.raises(TypeError, match="supported transformers models: LlamaForCausalLM, GPTNeoXForCausalLM"):
        DecoderLM.from_transformers(nn.Linear(2, 2))


def test_position_swap_keeps_the_weights():
    model = llama_model()
    lm, alibi = DecoderLM.from_transformers(model), DecoderLM.from_transformers(model, position='alibi')
    t5 = DecoderLM.from_transformers(model, position='t5', num_buckets=8, max_distance=16)
    sd = lm.state_dict()
    for k, v in alibi.state_dict().items(): assert torch.equal(v, sd[k])
    for k, v in t5.state_dict().items():
        if '.positions.' not in k: assert torch.equal(v, sd[k])
    assert isinstance(alibi.layers[0].self_attn.module, ALiBiMultiHeadAttention)


# ---------------------------------------------------------------- dropout where the source drops, in training mode
def llama_dropout(attention_dropout):
    with float32_as_float64():
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=32, attention_dropout=attention_dropout)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).double().train()


def neox_dropout(attention_dropout, hidden_dropout, parallel=True):
    with float32_as_float64():
        cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            rotary_pct=0.25, max_position_embeddings=32, use_parallel_residual=parallel,
                            attention_dropout=attention_dropout, hidden_dropout=hidden_dropout)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(0)
        return GPTNeoXForCausalLM(cfg).double().train()


DROPOUT_SOURCES = {'llama attn 0.3': lambda: llama_dropout(0.3),
                   'neox attn 0.1 hidden 0.3': lambda: neox_dropout(0.1, 0.3),
                   'neox hidden 0.3, sequential': lambda: neox_dropout(0.0, 0.3, parallel=False)}


def dropout_places(lm):
    "{module name: p} of every nn.Dropout with p > 0 in a DecoderLM (an attention module's own is its `.dropout`)."
    return {name: m.p for name, m in lm.named_modules() if isinstance(m, nn.Dropout) and m.p > 0}


def test_llama_drops_attention_weights_only():
    lm = DecoderLM.from_transformers(llama_dropout(0.3))
    assert lm.training
    assert dropout_places(lm) == {f'layers.{i}.self_attn.module.dropout': 0.3 for i in range(2)}


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox_drops_attention_weights_embeddings_and_residual_branches(parallel):
    lm = DecoderLM.from_transformers(neox_dropout(0.2, 0.3, parallel))
    want = {'drop': 0.3}   # GPT-NeoX's emb_dropout
    for i in range(2):     # attention_dropout on the weights; post_attention_dropout, post_mlp_dropout: the branches
        want.update({f'layers.{i}.self_attn.module.dropout': 0.2, f'layers.{i}.dropout': 0.3})
    assert dropout_places(lm) == want   # nothing inside the MLP: GPTNeoXMLP has no dropout


@pytest.mark.parametrize("source", list(DROPOUT_SOURCES))
def test_training_mode_logits_vary_as_the_sources(source):
    "Training mode: the spread of the logits over 100 dropout draws is the source's (within 10%; dropout in other places gives 0 or 2.5x)."
    model = DROPOUT_SOURCES[source]()
    lm = DecoderLM.from_transformers(model)
    assert lm.training and model.training
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with torch.no_grad(), float32_as_float64():
        theirs = torch.stack([model(tokens).logits for _ in range(100)]).std(0).mean()
        ours = torch.stack([lm(tokens)[0] for _ in range(100)]).std(0).mean()
    assert theirs > 0.01 and 0.9 < ours / theirs < 1.1, (float(ours), float(theirs))


@pytest.mark.parametrize("source", list(DROPOUT_SOURCES))
def test_dropout_config_converts_to_the_same_eval_logits(source):
    model = DROPOUT_SOURCES[source]().eval()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_err(DecoderLM.from_transformers(model)(tokens)[0], ref_logits(model, tokens)) <= TOL


# ---------------------------------------------------------------- LLaMA rotates whole heads
@pytest.mark.parametrize("where", ['rope_parameters', 'config'])
def test_llama_default_rope_ignores_partial_rotary_factor_as_transformers(where):
    "transformers' LLaMA rotates every dimension with the default rope whatever partial_rotary_factor says: so does the conversion."
    with float32_as_float64():
        rope = {'rope_type': 'default', 'rope_theta': 500.0}
        extra = {'rope_parameters': {**rope, 'partial_rotary_factor': 0.5}} if where == 'rope_parameters' else \
                {'rope_parameters': rope, 'partial_rotary_factor': 0.5}
        cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=16, **extra)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).double().eval()
    lm = DecoderLM.from_transformers(model)
    assert lm.layers[0].self_attn.module.rotary_dim == 8
    assert from_transformers(model.model.layers[0].self_attn).rotary_dim == 8
    tokens = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert max_err(lm(tokens)[0], ref_logits(model, tokens)) <= TOL


@pytest.mark.parametrize("rope", ['linear', 'yarn', 'llama3'])
def test_llama_partial_rotary_factor_with_scaled_rope_is_refused(rope):
    "With another rope type transformers' own LLaMA fails on a partial_rotary_factor: the conversion refuses it by name."
    model = llama_model({**ROPES[rope], 'partial_rotary_factor': 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 in rope_parameters with rope_type"):
        DecoderLM.from_transformers(model)
    with pytest.raises(ValueError, match="from_transformers: partial_rotary_factor=0.5"):
        from_transformers(model.model.layers[0].self_attn)


# ---------------------------------------------------------------- DecoderLM's API without importing relpos.hf first
def test_decoder_lm_methods_exist_once_decoder_lm_is_imported():
    "A fresh interpreter: `from relpos.models import DecoderLM` and nothing else of relpos, then from_transformers and new_cache."
    import subprocess, sys, os
    code = """
import sys, torch
from relpos.models import DecoderLM
assert 'relpos.hf' not in sys.modules
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=16)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
lm = DecoderLM.from_transformers(model).eval()
cache = lm.new_cache(1, 8)
tokens = torch.randint(0, 32, (1, 5))
with torch.no_grad():
    logits, _ = lm(tokens, cache=cache)
    assert (logits - model(tokens).logits).abs().max() < 1e-4
print('ok')
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(Path(__file__).parents[1]), os.environ.get('PYTHONPATH')] if p),
               OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-2000:]

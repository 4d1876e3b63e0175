"""Regressions found by tests/test_fuzz_invariants.py, each reduced to its smallest model."""
import pytest
import torch

from relpos.models import DecoderLM, NormedHeads

V = 20


def tiny(**kw):
    torch.manual_seed(0)
    return DecoderLM(**{**dict(n_vocab=V, d_model=16, heads=2, n_layers=2, max_len=16, d_ff=8), **kw}).double().eval()


@pytest.mark.parametrize('other', ['xl', 'xl_paper', 'shaw'])
@pytest.mark.parametrize('arg', [dict(bias=False), dict(qkv_bias=False)])
def test_no_bias_with_a_layer_type_whose_position_keeps_its_biases_is_refused(other, arg):
    "bias=False reached a layer type's own position (`layer_positions`) whose attention takes no `bias`: a TypeError from inside."
    with pytest.raises(ValueError, match=rf"{list(arg)[0]}=False: position='{other}'"):
        tiny(position='rotary', **arg, layer_types=['full_attention', 'sliding_attention'], sliding_window=2,
             layer_positions={'sliding_attention': {'position': other}})


def test_output_bias_false_on_an_attention_without_the_switch_is_refused():
    "position='shaw' kept its output bias with output_bias=False, silently (and to_config said False)."
    with pytest.raises(ValueError, match="output_bias=False"):
        tiny(position='shaw', output_bias=False)
    assert tiny(position='shaw', output_bias=True).layers[0].self_attn.module.fc.bias is not None


def test_absolute_as_a_layer_types_position_is_refused():
    "layer_positions={kind: {'position': 'absolute'}} gave those layers plain attention and no table, silently."
    with pytest.raises(ValueError, match=r"layer_positions\['sliding_attention'\]\['position'\]='absolute'"):
        tiny(position='rotary', layer_types=['full_attention', 'sliding_attention'], sliding_window=2,
             layer_positions={'sliding_attention': {'position': 'absolute'}})


def test_nope_layers_take_their_layer_types_qk_norm_and_query_temperature():
    "A NoPE layer ignored its type's `qk_norm` / `query_temperature` from `layer_positions` (Llama 4 puts the temperature there)."
    lm = tiny(position='rotary', norm='rms', ffn='swiglu', bias=False, nope_layers=(1,), qk_norm='head_unscaled',
              layer_types=['chunked_attention', 'full_attention'], attention_chunk_size=3,
              layer_positions={'full_attention': dict(qk_norm=None, query_temperature=(2, 0.3))})
    rope, nope = (l.self_attn.module for l in lm.layers)
    assert isinstance(rope.query, NormedHeads) and rope.query_temperature is None
    assert not isinstance(nope.query, NormedHeads) and nope.query_temperature == (2.0, 0.3)


def test_nope_layer_temperature_equals_transformers_llama4():
    "The same model against transformers' Llama 4 (its temperature only in NoPE layers), float64."
    pytest.importorskip('transformers')
    from test_modern import float32_as_float64
    lm = tiny(position='rotary', norm='rms', ffn='swiglu', bias=False, interleaved=True, nope_layers=(1,),
              layer_types=['chunked_attention', 'full_attention'], attention_chunk_size=3,
              layer_positions={'full_attention': dict(query_temperature=(2, 0.3))})
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.2 * torch.randn_like(p))
    t = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with float32_as_float64():
        hf = lm.to_transformers().double().eval()
        assert type(hf).__name__ == 'Llama4ForCausalLM' and hf.config.attn_temperature_tuning
        with torch.no_grad(): want = hf(input_ids=t).logits
    assert (lm(t)[0] - want).abs().max().item() <= 1e-10


def test_to_transformers_reads_a_layer_of_the_models_own_position():
    "to_transformers read the first layer's attention even where `layer_positions` gave it another method: AttributeError."
    lm = tiny(position='absolute', layer_types=['full_attention', 'chunked_attention'], attention_chunk_size=2,
              layer_positions={'full_attention': {'position': 'shaw'}})
    with pytest.raises(ValueError, match="to_transformers"):
        lm.to_transformers()
    lm = tiny(position='absolute', layer_positions={'full_attention': {'position': 'shaw'}})
    with pytest.raises(ValueError, match="to_transformers: layer_positions"):
        lm.to_transformers()


@pytest.mark.parametrize('kw', [dict(kv_heads=1), dict(head_dim=4)])
def test_knn_layer_with_grouped_heads_is_refused_when_built(kw):
    "kv_heads / head_dim in a kNN layer built, then its first forward failed inside KNNMemory on the keys' shape."
    with pytest.raises(ValueError, match="memorizing_layers: layer 0 has kv_heads"):
        tiny(position='rotary', memorizing_layers=(0,), **kw)


def test_knn_layer_with_query_temperature_is_refused():
    "A kNN layer calls its local side's paths, not its forward: query_temperature was dropped silently."
    with pytest.raises(ValueError, match="memorizing_layers: layer 1 has query_temperature"):
        tiny(position='rotary', memorizing_layers=(1,), query_temperature=(1, 0.5))
    tiny(position='rotary', memorizing_layers=(1,), layer_types=['full_attention', 'sliding_attention'], sliding_window=2,
         layer_positions={'full_attention': dict(query_temperature=(1, 0.5))})   # only layer 0 has one: built


def test_knn_layers_refuse_padding():
    "A kNN layer stored the padding's keys: the next call retrieved them (0.2 on the logits); an all-ones mask still runs."
    lm = tiny(position='xl', memorizing_layers=(0,), knn_capacity=64, top_k=2)
    t = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="attention_mask: the kNN layers"):
        lm(t, attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1, 1]]))
    lm.release_knn_memory()
    want = lm(t)[0]
    lm.release_knn_memory()
    assert torch.equal(lm(t, attention_mask=torch.ones(1, 7, dtype=torch.long))[0], want)


def test_absolute_model_passes_position_ids_to_a_layer_types_own_position():
    "position='absolute' consumed position_ids in its table: a layer type's FIRE then counted the padding (0.002 on the logits)."
    lm = tiny(position='absolute', layer_types=['full_attention', 'sliding_attention'], sliding_window=2,
              layer_positions={'sliding_attention': {'position': 'fire'}})
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.2 * torch.randn_like(p))
    t = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(0))
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), t), 1)
    keep = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    got = lm(padded, attention_mask=keep, position_ids=(keep.cumsum(-1) - 1).clamp(min=0))[0][:, 3:]
    assert (got - lm(t)[0]).abs().max().item() <= 1e-10

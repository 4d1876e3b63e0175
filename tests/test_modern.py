"""Modern decoder attention against transformers (float64): every rope_type below and beyond its original length,
grouped-query heads (4:1, 2:1), head_dim != d_model / heads, GPT-NeoX partial rotation, GPT-J interleaved pairs,
BLOOM's ALiBi with padding (left and a gap), T5's bias, packed documents with restarting position ids.

The reference is transformers with its float32 steps done in float64 (`float32_as_float64`: rope angles, the
float32 softmax of BLOOM / GPT-NeoX / LLaMA's eager attention, GPT-J's float32 scores); the bound is 1e-10 on the
attention outputs (max abs error; outputs are O(1))."""
import contextlib, math
import pytest
import torch

from relpos.mha import packed_causal_mask, packed_position_ids, MultiHeadAttention
from relpos.rotary import RotaryMultiHeadAttention
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.t5 import T5MultiHeadAttention

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, GPTNeoXConfig, GPTJConfig, BloomConfig, T5Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding
from transformers.models.gptj.modeling_gptj import GPTJAttention, GPTJRotaryEmbedding
from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

TOL = 1e-10


@contextlib.contextmanager
def float32_as_float64():
    "transformers' float32 steps in float64: `torch.float32`/`torch.float`, `Tensor.float()` and the default dtype."
    saved = torch.float32, torch.float, torch.get_default_dtype()
    had = 'float' in torch.Tensor.__dict__
    old = torch.Tensor.__dict__.get('float')
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = lambda self, *a, **k: self.double(*a, **k)
    torch.set_default_dtype(torch.float64)
    try: yield
    finally:
        torch.float32, torch.float = saved[:2]
        torch.set_default_dtype(saved[2])
        if had: torch.Tensor.float = old
        else: del torch.Tensor.float


def additive(allowed):
    "bool [b, sq, sk] (True = may attend) -> transformers' additive mask [b, 1, sq, sk]."
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)[:, None]


def run(layer, x, allowed=None, ids=None):
    "relpos layer on batch-first x [b, n, d]; allowed bool [b, sq, sk]; ids [b, n] -> [b, n, d]."
    mask = None if allowed is None else allowed.permute(1, 2, 0)
    return layer(query=x.transpose(0, 1), key=x.transpose(0, 1), value=x.transpose(0, 1), mask=mask,
                 position_ids=ids).transpose(0, 1)


def causal(b, n): return torch.ones(n, n, dtype=torch.bool).tril().expand(b, n, n)


def max_err(a, b, rows=None):
    "max abs difference over the query rows that see something (`rows` bool [b, n])."
    d = (a - b).abs()
    if rows is not None: d = d[rows]
    return d.max().item()


def zero_bias(layer):
    with torch.no_grad():
        for lin in (layer.value.linear, layer.output):
            if lin.bias is not None: lin.bias.zero_()


# ---------------------------------------------------------------- LLaMA: rope types, GQA, head_dim, ids
ROPES = {
    'default': None,
    'linear': {'rope_type': 'linear', 'factor': 4.0},
    'dynamic': {'rope_type': 'dynamic', 'factor': 4.0},
    'yarn': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16},
    'yarn_mscale': {'rope_type': 'yarn', 'factor': 8.0, 'original_max_position_embeddings': 16, 'mscale': 1.0,
                    'mscale_all_dim': 0.8, 'beta_fast': 16, 'beta_slow': 2},
    'longrope': {'rope_type': 'longrope', 'factor': 4.0, 'original_max_position_embeddings': 16,
                 'short_factor': [1.0 + 0.1 * i for i in range(4)], 'long_factor': [1.0 + 1.5 * i for i in range(4)]},
    'llama3': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': 16},
}


def llama_pair(heads=4, kv_heads=2, head_dim=8, hidden=24, rope=None, theta=500.0, seed=0):
    "A random transformers LlamaAttention (+ its rotary embedding) in float64 and the relpos layer with its weights."
    with float32_as_float64():
        cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                          max_position_embeddings=16, attention_bias=True,
                          rope_parameters={**(rope or {'rope_type': 'default'}), 'rope_theta': theta})
        cfg._attn_implementation = 'eager'
        torch.manual_seed(seed)
        ref = LlamaAttention(cfg, layer_idx=0).double().eval()
        emb = LlamaRotaryEmbedding(cfg).double()
    ours = RotaryMultiHeadAttention(heads, hidden, dropout_prob=0.0, bias=True, base=theta, rope_scaling=rope,
                                    max_position_embeddings=16, kv_heads=kv_heads, head_dim=head_dim).double().eval()
    with torch.no_grad():
        for a, b in ((ours.query.linear, ref.q_proj), (ours.key.linear, ref.k_proj), (ours.value.linear, ref.v_proj),
                     (ours.output, ref.o_proj)):
            a.weight.copy_(b.weight); a.bias.copy_(b.bias)
    return ref, emb, ours


def llama_ref(ref, emb, x, allowed, ids):
    with float32_as_float64(), torch.no_grad():
        cos, sin = emb(x, ids)
        return ref(x, position_embeddings=(cos, sin), attention_mask=additive(allowed))[0]


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("n", [12, 40])          # below and beyond original_max_position_embeddings = 16
@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (4, 4)])   # 4:1, 2:1, plain
def test_llama_attention(rope, n, heads, kv_heads):
    ref, emb, ours = llama_pair(heads, kv_heads, rope=ROPES[rope])
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, n, 24, dtype=torch.float64, generator=g)
    ids = torch.arange(n).expand(2, n)
    with torch.no_grad():
        want = llama_ref(ref, emb, x, causal(2, n), ids)
        for need_weights in (False, True):
            ours.need_weights = need_weights
            assert max_err(run(ours, x, causal(2, n)), want) <= TOL                  # index positions
            assert max_err(run(ours, x, causal(2, n), ids), want) <= TOL             # the same as ids


@pytest.mark.parametrize("rope", ['default', 'llama3', 'yarn', 'dynamic'])
def test_llama_left_padding_and_packed_documents(rope):
    ref, emb, ours = llama_pair(8, 2, rope=ROPES[rope])
    n = 20
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, n, 24, dtype=torch.float64, generator=g)
    # row 0: left padding (5 pads), positions over the real tokens; rows 1, 2: packed documents, ids restarting
    pad = torch.ones(3, n, dtype=torch.bool); pad[0, :5] = False
    docs = torch.tensor([[0] * n, [0] * 7 + [1] * 9 + [2] * 4, [0] * 15 + [1] * 5])
    ids = packed_position_ids(docs)
    ids[0] = (pad[0].long().cumsum(0) - 1).clamp(min=0)
    allowed = packed_causal_mask(docs).permute(2, 0, 1) & pad[:, None, :]
    rows = allowed.any(-1)
    with torch.no_grad():
        want = llama_ref(ref, emb, x, allowed, ids)
        for need_weights in (False, True):
            ours.need_weights = need_weights
            assert max_err(run(ours, x, allowed, ids), want, rows) <= TOL
    # the packed row equals its documents run one by one
    with torch.no_grad():
        whole = run(ours, x[1:2], allowed[1:2], ids[1:2])
        alone = run(ours, x[1:2, 7:16], causal(1, 9))
    assert max_err(whole[:, 7:16], alone) <= TOL


def test_dynamic_depends_on_the_call_length():
    "dynamic NTK: a 12-token call uses the plain frequencies, a 40-token call a larger base (transformers recomputes at 40)."
    _, _, ours = llama_pair(4, 4, rope=ROPES['dynamic'])
    _, _, plain = llama_pair(4, 4, rope=None)
    x = torch.randn(1, 40, 24, dtype=torch.float64)
    with torch.no_grad():
        assert max_err(run(ours, x[:, :12], causal(1, 12)), run(plain, x[:, :12], causal(1, 12))) == 0
        assert max_err(run(ours, x, causal(1, 40)), run(plain, x, causal(1, 40))) > 1e-6


def test_gqa_fast_path_uses_no_repeat():
    "The fast path hands kv_heads heads to SDPA (enable_gqa): no repeat_interleave / expand copy per query head."
    _, _, ours = llama_pair(8, 2)
    x = torch.randn(1, 16, 24, dtype=torch.float64)
    with torch.profiler.profile() as prof, torch.no_grad():
        run(ours, x, causal(1, 16), torch.arange(16)[None])
    names = {e.key for e in prof.key_averages()}
    assert 'aten::repeat_interleave' not in names and 'aten::_scaled_dot_product_flash_attention_for_cpu' in names


# ---------------------------------------------------------------- GPT-NeoX: partial rotation (rotary_pct 0.25)
def test_gpt_neox_partial_rotation():
    heads, hidden, n = 4, 64, 14
    with float32_as_float64():
        cfg = GPTNeoXConfig(hidden_size=hidden, num_attention_heads=heads, rotary_pct=0.25, attention_bias=True,
                            max_position_embeddings=64)
        cfg._attn_implementation = 'eager'
        torch.manual_seed(0)
        ref = GPTNeoXAttention(cfg, layer_idx=0).double().eval()
        emb = GPTNeoXRotaryEmbedding(cfg).double()
    dk = hidden // heads
    ours = RotaryMultiHeadAttention(heads, hidden, dropout_prob=0.0, rotary_dim=dk // 4).double().eval()
    w, b = ref.query_key_value.weight.view(heads, 3, dk, hidden), ref.query_key_value.bias.view(heads, 3, dk)
    with torch.no_grad():
        for t, lin in enumerate((ours.query.linear, ours.key.linear, ours.value.linear)):
            lin.weight.copy_(w[:, t].reshape(hidden, hidden)); lin.bias.copy_(b[:, t].reshape(hidden))
        ours.output.weight.copy_(ref.dense.weight); ours.output.bias.copy_(ref.dense.bias)
    x = torch.randn(2, n, hidden, dtype=torch.float64)
    ids = torch.arange(3, 3 + n).expand(2, n)
    with float32_as_float64(), torch.no_grad():
        want = ref(x, attention_mask=additive(causal(2, n)), position_embeddings=emb(x, ids))[0]
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, n), ids), want) <= TOL


# ---------------------------------------------------------------- GPT-J: interleaved pairs, partial
def test_gpt_j_interleaved():
    heads, hidden, n = 4, 64, 13
    with float32_as_float64():
        cfg = GPTJConfig(n_embd=hidden, n_head=heads, rotary_dim=8, n_positions=64)
        cfg._attn_implementation = 'eager'
        torch.manual_seed(0)
        ref = GPTJAttention(cfg, layer_idx=0).double().eval()
        emb = GPTJRotaryEmbedding(cfg).double()
    ours = RotaryMultiHeadAttention(heads, hidden, dropout_prob=0.0, bias=False, rotary_dim=8, interleaved=True).double().eval()
    with torch.no_grad():
        for a, b in ((ours.query.linear, ref.q_proj), (ours.key.linear, ref.k_proj), (ours.value.linear, ref.v_proj),
                     (ours.output, ref.out_proj)):
            a.weight.copy_(b.weight)
    zero_bias(ours)
    x = torch.randn(2, n, hidden, dtype=torch.float64)
    ids = torch.arange(5, 5 + n).expand(2, n)
    with float32_as_float64(), torch.no_grad():
        want = ref(x, position_embeddings=emb(x, ids), attention_mask=additive(causal(2, n)))[0]
    with torch.no_grad():
        assert max_err(run(ours, x, causal(2, n), ids), want) <= TOL


# ---------------------------------------------------------------- BLOOM: ALiBi over non-padding positions
@pytest.mark.parametrize("heads", [4, 6])
def test_bloom_alibi_with_padding(heads):
    hidden, n = 8 * heads, 12
    with float32_as_float64():
        cfg = BloomConfig(hidden_size=hidden, n_head=heads)
        torch.manual_seed(0)
        ref = BloomAttention(cfg, layer_idx=0).double().eval()
    dk = hidden // heads
    ours = ALiBiMultiHeadAttention(heads, hidden, dropout_prob=0.0).double().eval()
    w, b = ref.query_key_value.weight.view(heads, 3, dk, hidden), ref.query_key_value.bias.view(heads, 3, dk)
    with torch.no_grad():
        for t, lin in enumerate((ours.query.linear, ours.key.linear, ours.value.linear)):
            lin.weight.copy_(w[:, t].reshape(hidden, hidden)); lin.bias.copy_(b[:, t].reshape(hidden))
        ours.output.weight.copy_(ref.dense.weight); ours.output.bias.copy_(ref.dense.bias)
    # row 0: left padding; row 1: a padding gap mid-row; row 2: none
    keep = torch.ones(3, n, dtype=torch.bool); keep[0, :4] = False; keep[1, 5:8] = False
    ids = keep.long().cumsum(-1) - 1              # BLOOM's positions: counted over the real tokens
    allowed = causal(3, n) & keep[:, None, :]
    rows = keep & allowed.any(-1)                 # real tokens (padded queries' outputs are not compared)
    x = torch.randn(3, n, hidden, dtype=torch.float64)
    with float32_as_float64(), torch.no_grad():
        alibi = build_alibi_tensor(keep.long(), heads, torch.float64)
        want = ref(x, torch.zeros_like(x), alibi, additive(allowed))[0]
    with torch.no_grad():
        for need_weights in (False, True):
            ours.need_weights = need_weights
            assert max_err(run(ours, x, allowed, ids), want, rows) <= TOL
        # without the ids the gap counts as distance: a different answer on the rows after the gap
        assert max_err(run(ours, x, allowed), want, rows) > 1e-4


def test_alibi_gqa_matches_repeated_heads():
    torch.manual_seed(0)
    gqa = ALiBiMultiHeadAttention(8, 32, dropout_prob=0.0, kv_heads=2).double().eval()
    full = ALiBiMultiHeadAttention(8, 32, dropout_prob=0.0).double().eval()
    sd = gqa.state_dict()
    for k in ('key.linear.weight', 'key.linear.bias', 'value.linear.weight', 'value.linear.bias'):
        sd[k] = sd[k].unflatten(0, (2, 4)).repeat_interleave(4, 0).flatten(0, 1)
    full.load_state_dict(sd)
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    ids, allowed = packed_position_ids(docs), packed_causal_mask(docs).permute(2, 0, 1)
    with torch.no_grad():
        want = run(full, x, allowed, ids)
        for need_weights in (False, True):
            gqa.need_weights = need_weights
            assert max_err(run(gqa, x, allowed, ids), want) <= TOL
            assert max_err(run(gqa, x), run(full, x)) <= TOL


# ---------------------------------------------------------------- T5: bucket bias, ids, decoder and encoder
def t5_pair(decoder, heads=4, d_model=32, d_kv=6, seed=0):
    with float32_as_float64():
        cfg = T5Config(d_model=d_model, d_kv=d_kv, num_heads=heads, is_decoder=decoder, relative_attention_num_buckets=16,
                       relative_attention_max_distance=20, dropout_rate=0.0)
        cfg._attn_implementation = 'eager'
    torch.manual_seed(seed)
    ref = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).double().eval()
    ours = T5MultiHeadAttention(heads, d_model, dropout_prob=0.0, bias=False, num_buckets=16, max_distance=20,
                                bidirectional=not decoder, head_dim=d_kv).double().eval()
    with torch.no_grad():
        # T5 does not scale its scores: relpos divides by sqrt(d_kv), so the query weights carry sqrt(d_kv)
        ours.query.linear.weight.copy_(ref.q.weight * math.sqrt(d_kv))
        ours.key.linear.weight.copy_(ref.k.weight); ours.value.linear.weight.copy_(ref.v.weight)
        ours.output.weight.copy_(ref.o.weight)
        ours.positions.relative_attention_bias.weight.copy_(ref.relative_attention_bias.weight)
    zero_bias(ours)
    return ref, ours


def t5_bias_from_ids(ref, ids):
    rel = ids[:, None, :] - ids[:, :, None]
    buckets = T5Attention._relative_position_bucket(rel, bidirectional=not ref.is_decoder,
                                                    num_buckets=ref.relative_attention_num_buckets,
                                                    max_distance=ref.relative_attention_max_distance)
    return ref.relative_attention_bias(buckets).permute(0, 3, 1, 2)


@pytest.mark.parametrize("decoder", [True, False])
def test_t5_attention(decoder):
    ref, ours = t5_pair(decoder)
    n = 30
    x = torch.randn(2, n, 32, dtype=torch.float64)
    allowed = causal(2, n) if decoder else torch.ones(2, n, n, dtype=torch.bool)
    docs = torch.tensor([[0] * 11 + [1] * 19, [0] * 25 + [1] * 5])
    ids, packed = packed_position_ids(docs), packed_causal_mask(docs, causal=decoder).permute(2, 0, 1)
    with torch.no_grad():
        want = ref(x, mask=additive(allowed))[0]
        want_packed = ref(x, mask=additive(packed), position_bias=t5_bias_from_ids(ref, ids))[0]
        for need_weights in (False, True):
            ours.need_weights = need_weights
            assert max_err(run(ours, x, allowed), want) <= TOL
            assert max_err(run(ours, x, allowed, torch.arange(n)), want) <= TOL
            assert max_err(run(ours, x, packed, ids), want_packed) <= TOL


def test_t5_decoder_refuses_decreasing_ids_it_would_see():
    _, ours = t5_pair(True)
    docs = torch.tensor([[0] * 5 + [1] * 5])
    ids = packed_position_ids(docs)
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="position_ids decrease inside what a query sees.*packed_causal_mask"):
        run(ours, x, causal(1, 10), ids)
    run(ours, x, packed_causal_mask(docs).permute(2, 0, 1), ids)   # with the documents' mask: fine


def test_t5_gqa_matches_repeated_heads():
    torch.manual_seed(0)
    gqa = T5MultiHeadAttention(4, 32, dropout_prob=0.0, kv_heads=2).double().eval()
    full = T5MultiHeadAttention(4, 32, dropout_prob=0.0).double().eval()
    sd = gqa.state_dict()
    for k in ('key.linear.weight', 'key.linear.bias', 'value.linear.weight', 'value.linear.bias'):
        sd[k] = sd[k].unflatten(0, (2, 8)).repeat_interleave(2, 0).flatten(0, 1)
    full.load_state_dict(sd)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        for mask in (None, causal(2, 9)):
            want = run(full, x, mask)
            for need_weights in (False, True):
                gqa.need_weights = need_weights
                assert max_err(run(gqa, x, mask), want) <= TOL

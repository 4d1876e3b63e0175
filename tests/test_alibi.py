"Tests of `relpos.alibi` that would clutter the chapter: paper/BLOOM parity, fast == readable (hypothesis), gradcheck, compile, bf16, state, errors."
import copy, io, math, pickle
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from relpos.mha import MultiHeadAttention
from mha_module_checks import (rel_err, run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_state_dict_is_plain_mha_and_round_trips, check_dropout_training_path_runs)
from relpos.alibi import alibi_slopes, alibi_bias, ALiBiMultiHeadAttention

try:
    import transformers
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor
    NO_HF = None
except ImportError as e:
    NO_HF = f"transformers (the dev-only reference for ALiBi: BLOOM's build_alibi_tensor) cannot be imported: {e}"
needs_hf = pytest.mark.skipif(NO_HF is not None, reason=NO_HF or "")


def get_slopes(n):
    "The ALiBi paper's reference (ofirpress/attention_with_linear_biases, fairseq/models/transformer.py), verbatim."
    def get_slopes_power_of_2(n):
        start = (2**(-2**-(math.log2(n)-3)))
        ratio = start
        return [start*ratio**i for i in range(n)]
    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    else:
        closest_power_of_2 = 2**math.floor(math.log2(n))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes(2*closest_power_of_2)[0::2][:n-closest_power_of_2]



def make(heads=4, d_model=32, seed=0, **kw):
    torch.manual_seed(seed)
    return ALiBiMultiHeadAttention(heads, d_model, dropout_prob=kw.pop('dropout_prob', 0.0), **kw).eval()



def reference_layer(m, x, kv, bias, mask=None):
    "The layer with a given additive bias `[heads or b*heads, 1 or sq, sk]`, BLOOM's way: baddbmm, -inf fill, softmax."
    h, dk = m.heads, m.d_k
    sq, sk, b = x.shape[0], kv.shape[0], x.shape[1]
    q = m.query.linear(x).view(sq, b, h, dk).permute(1, 2, 0, 3).reshape(b * h, sq, dk)
    k = m.key.linear(kv).view(sk, b, h, dk).permute(1, 2, 0, 3).reshape(b * h, sk, dk)
    v = m.value.linear(kv).view(sk, b, h, dk).permute(1, 2, 0, 3).reshape(b * h, sk, dk)
    scores = torch.baddbmm(bias.expand(b * h, sq, sk), q, k.transpose(1, 2), beta=1.0, alpha=1 / math.sqrt(dk))
    if mask is not None: scores = scores.masked_fill(~mask, float('-inf'))
    w = torch.softmax(scores, -1)
    return m.output((w @ v).view(b, h, sq, dk).permute(2, 0, 1, 3).reshape(sq, b, h * dk))


# ---------------------------------------------------------------- slopes and bias
@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 20, 24, 31, 32, 40, 64, 96, 112, 128])
def test_slopes_match_the_paper(heads):
    assert torch.equal(alibi_slopes(heads, torch.float64), torch.tensor(get_slopes(heads), dtype=torch.float64))
    assert torch.equal(alibi_slopes(heads), torch.tensor(get_slopes(heads), dtype=torch.float32))


@needs_hf
@pytest.mark.parametrize("heads", [1, 3, 5, 6, 8, 12, 16, 20, 24, 40, 64, 112])
def test_slopes_match_bloom(heads):
    assert rel_err(alibi_slopes(heads), _get_alibi_slopes(heads, 'cpu')) <= 1e-6


@needs_hf
@pytest.mark.parametrize("heads, sq, sk", [(8, 7, 7), (12, 5, 9), (6, 1, 33), (5, 16, 40), (16, 0, 3)])
def test_bias_matches_bloom_up_to_the_row_constant(heads, sq, sk):
    bloom = build_alibi_tensor(torch.ones(1, sk), heads, torch.float32)                       # [heads, 1, sk]: m*j
    row = alibi_slopes(heads)[:, None, None] * torch.arange(sk - sq, sk, dtype=torch.float32)[:, None]   # m*i
    ours = alibi_bias(heads, sq, sk)[0]
    if sq: assert rel_err(ours + row, bloom.expand(heads, sq, sk)) <= 1e-6
    else: assert ours.shape == (heads, 0, sk)


@needs_hf
@pytest.mark.parametrize("heads, d_model", [(4, 32), (3, 24), (6, 48), (5, 40), (12, 48)])
@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 11), (1, 9)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_causal_layer_matches_bloom_attention(heads, d_model, sq, sk, need_weights):
    "Causal ALiBi layer == BLOOM's recipe (its alibi tensor, baddbmm, causal -inf fill, softmax) on the same weights."
    m = make(heads, d_model)
    g = torch.Generator().manual_seed(1)
    x, kv = torch.randn(sq, 2, d_model, generator=g), torch.randn(sk, 2, d_model, generator=g)
    bloom = build_alibi_tensor(torch.ones(2, sk), heads, torch.float32)                      # [2*heads, 1, sk]
    future = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    with torch.no_grad():
        assert rel_err(run(m, x, kv, need_weights=need_weights), reference_layer(m, x, kv, bloom, future)) <= 1e-6


@pytest.mark.parametrize("heads, d_model", [(4, 32), (3, 24), (6, 48)])
@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 11)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bidirectional_layer_matches_formula(heads, d_model, sq, sk, need_weights):
    "Bidirectional: -m|j - i| from the paper's slopes, computed independently."
    m = make(heads, d_model, bidirectional=True)
    g = torch.Generator().manual_seed(1)
    x, kv = torch.randn(sq, 2, d_model, generator=g), torch.randn(sk, 2, d_model, generator=g)
    slopes = torch.tensor(get_slopes(heads), dtype=torch.float32)
    dist = (torch.arange(sk)[None, :] - torch.arange(sk - sq, sk)[:, None]).abs().float()
    bias = (-slopes[:, None, None] * dist).repeat(2, 1, 1)
    with torch.no_grad():
        assert rel_err(run(m, x, kv, need_weights=need_weights), reference_layer(m, x, kv, bias)) <= 1e-6


def test_memory_equals_suffix_of_full_sequence():
    m = make()
    x = torch.randn(10, 2, 32)
    torch.testing.assert_close(run(m, x[6:], x), run(m, x, x)[6:], rtol=1e-5, atol=1e-6)


def test_causal_variant_masks_the_future_itself():
    m = make()
    x = torch.randn(6, 2, 32)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[..., None]
    torch.testing.assert_close(run(m, x, x), run(m, x, x, causal))
    run(m, x, x, need_weights=True)
    assert m.attn.triu(1).sum() == 0 if m.attn.dim() == 2 else m.attn.permute(2, 3, 0, 1).triu(1).abs().sum() == 0
    y = x.clone(); y[4:] += 1                                        # changing later tokens changes nothing before them
    torch.testing.assert_close(run(m, y, y)[:4], run(m, x, x)[:4])


# ---------------------------------------------------------------- fast path == readable path
@settings(max_examples=30, deadline=None)
@given(sq=st.integers(0, 6), extra=st.integers(0, 4), b=st.integers(1, 3), heads=st.sampled_from([1, 2, 3, 5]),
       bidirectional=st.booleans(), mask_kind=st.sampled_from([None, "full", "q1", "b1"]), p_mask=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_fast_equals_readable_values_and_gradients(sq, extra, b, heads, bidirectional, mask_kind, p_mask, seed):
    d_model = 4 * heads
    m = make(heads, d_model, seed=seed, bidirectional=bidirectional)
    sk = sq + extra
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(sq, b, d_model, generator=g), torch.randn(sk, b, d_model, generator=g)
    mask = torch.rand(sq, sk, b, generator=g) >= p_mask
    mask = {None: None, "full": mask, "q1": mask[:1], "b1": mask[..., :1]}[mask_kind]
    go = torch.randn(sq, b, d_model, generator=g)
    res = []
    for need_weights in (False, True):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = run(m, qq, kk, mask, need_weights=need_weights)
        grads = torch.autograd.grad((out * go).sum(), [qq, kk, *m.parameters()], allow_unused=True)
        res.append([out, *[torch.zeros(()) if gr is None else gr for gr in grads]])
    assert res[0][0].isfinite().all()
    for a, r in zip(*res): torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_fast_path_bias_is_fixed_and_fused(monkeypatch):
    """Bidirectional (or with a padding mask): SDPA gets one float mask [1, heads, sq, sk] that does not require grad.
    Causal self-attention: the CPU flash kernel gets is_causal=True and the finite bias (no -inf copy)."""
    import relpos.alibi as alibi
    seen = []
    real_sdpa, real_flash = F.scaled_dot_product_attention, alibi._flash_cpu
    def spy_sdpa(*a, **kw):
        mk = kw.get('attn_mask'); seen.append(('sdpa', tuple(mk.shape), mk.requires_grad, bool(mk.isinf().any())))
        return real_sdpa(*a, **kw)
    def spy_flash(q, k, v, p, is_causal, attn_mask, scale):
        seen.append(('flash', is_causal, tuple(attn_mask.shape), attn_mask.requires_grad, bool(attn_mask.isinf().any())))
        return real_flash(q, k, v, p, is_causal, attn_mask=attn_mask, scale=scale)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy_sdpa)
    monkeypatch.setattr(alibi, '_flash_cpu', spy_flash)
    x = torch.randn(6, 3, 32, requires_grad=True)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[..., None]
    run(make(), x, x).sum().backward()
    run(make(), x, x, causal).sum().backward()
    run(make(bidirectional=True), x, x).sum().backward()
    pad = torch.ones(1, 6, 1, dtype=torch.bool); pad[0, 0] = False
    run(make(), x, x, pad).sum().backward()
    run(make(), x[2:], x).sum().backward()                             # keys longer than queries
    assert seen == [('flash', True, (1, 4, 6, 6), False, False)] * 2 + [('sdpa', (1, 4, 6, 6), False, False)] + \
                   [('sdpa', (1, 4, 6, 6), False, True), ('sdpa', (1, 4, 4, 6), False, True)]


def test_torch_func_transforms_take_the_sdpa_route():
    m = make()
    x = torch.randn(5, 2, 32)
    g = torch.func.grad(lambda x: run(m, x, x).square().sum())(x)
    xr = x.clone().requires_grad_()
    run(m, xr, xr, need_weights=True).square().sum().backward()
    torch.testing.assert_close(g, xr.grad, rtol=1e-5, atol=1e-6)
    out = torch.func.vmap(lambda x: run(m, x, x))(x[None].expand(2, 5, 2, 32))
    torch.testing.assert_close(out[1], run(m, x, x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_gradcheck_float64(need_weights, bidirectional, with_mask):
    m = make(3, 6, bidirectional=bidirectional).double()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(5, 2, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5, 2, generator=g) > 0.3
    mask[1, :, 0] = False
    assert torch.autograd.gradcheck(lambda q, kv: run(m, q, kv, mask if with_mask else None,
                                                      need_weights=need_weights), (q, kv))


def test_higher_order_gradients_on_readable_path():
    m = make(2, 8).double()
    q = torch.randn(3, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda q: run(m, q, q, need_weights=True), (q,))


# ---------------------------------------------------------------- compile, dtypes, modes
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_compile_aot_eager_fullgraph(need_weights, bidirectional):
    m = make(bidirectional=bidirectional)
    x, mem = torch.randn(6, 2, 32), torch.randn(9, 2, 32)
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(cm, x, mem, need_weights=need_weights), run(m, x, mem), rtol=1e-5, atol=1e-6)


def test_compile_inductor_forward_backward():
    m = make(3, 24)
    x, mem = torch.randn(5, 2, 24), torch.randn(8, 2, 24)
    out_c = run(torch.compile(m, fullgraph=True), x, mem)
    out_c.sum().backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = run(m, x, mem)
    out.sum().backward()
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, (p.grad for p in m.parameters())): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_bf16_module(need_weights, bidirectional): check_bf16_module(make(bidirectional=bidirectional), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make())
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(make(2, 16), 5000)


# ---------------------------------------------------------------- state
def test_state_dict_is_plain_mha_and_round_trips(): check_state_dict_is_plain_mha_and_round_trips(make(), make(seed=3))
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make(dropout_prob=0.5))


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call, exc, match", [
    (lambda: alibi_slopes(0), ValueError, "heads must be >= 1, got 0"),
    (lambda: alibi_slopes(-3), ValueError, "heads must be >= 1, got -3"),
    (lambda: alibi_slopes(4.0), TypeError, "heads must be an int"),
    (lambda: alibi_slopes(True), TypeError, "heads must be an int"),
    (lambda: alibi_bias(4, 5, 3), ValueError, "seq_len_k must be >= seq_len_q"),
    (lambda: alibi_bias(4, -1, 3), ValueError, "seq_len_q must be >= 0"),
    (lambda: alibi_bias(4, 2, 3.0), TypeError, "seq_len_k must be an int"),
    (lambda: ALiBiMultiHeadAttention(0, 32), ValueError, "heads"),
    (lambda: ALiBiMultiHeadAttention(4, 30), ValueError, "d_model"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match): call()


def test_queries_longer_than_keys_refused():
    with pytest.raises(ValueError, match="key must be at least as long as query"):
        run(make(bidirectional=True), torch.randn(5, 1, 32), torch.randn(3, 1, 32))
    with pytest.raises(ValueError, match="key must be at least as long as query"):
        run(make(), torch.randn(5, 1, 32), torch.randn(3, 1, 32))

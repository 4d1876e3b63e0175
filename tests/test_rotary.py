"Tests of `relpos.rotary` that would clutter the chapter: transformers parity, fast == readable (hypothesis), gradcheck, compile, bf16, state, errors."
import copy, io, math, pickle
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from relpos.mha import MultiHeadAttention
from mha_module_checks import (rel_err, run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_state_dict_is_plain_mha_and_round_trips, check_dropout_training_path_runs)
from relpos.rotary import (rotary_inv_freq, rotary_angles, rotary_cos_sin, rotate_half, rotate_every_two,
                           apply_rotary, apply_rotary_fast, is_causal_mask, RotaryMultiHeadAttention)

try:
    import transformers
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb as llama_apply
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions, apply_rotary_pos_emb as gptj_apply
    NO_HF = None
except ImportError as e:
    NO_HF = f"transformers (the dev-only reference for rotary) cannot be imported: {e}"
needs_hf = pytest.mark.skipif(NO_HF is not None, reason=NO_HF or "")



def make(heads=4, d_model=32, seed=0, **kw):
    torch.manual_seed(seed)
    m = RotaryMultiHeadAttention(heads, d_model, dropout_prob=kw.pop('dropout_prob', 0.0), **kw)
    return m.eval()



def hf_layer(m, x, kv):
    """The layer computed the transformers way: [b, h, n, d] tensors, LLaMA's rotary embedding (or GPT-NeoX's
    partial one) with position ids = absolute positions, explicit softmax."""
    h, dk, rd = m.heads, m.d_k, m.rotary_dim
    sq, sk, b = x.shape[0], kv.shape[0], x.shape[1]
    q = m.query.linear(x).view(sq, b, h, dk).permute(1, 2, 0, 3)
    k = m.key.linear(kv).view(sk, b, h, dk).permute(1, 2, 0, 3)
    v = m.value.linear(kv).view(sk, b, h, dk).permute(1, 2, 0, 3)
    cfg = LlamaConfig(hidden_size=h * rd, num_attention_heads=h, head_dim=rd, rope_theta=m.base)
    emb = LlamaRotaryEmbedding(cfg)
    cos_k, sin_k = emb(k, torch.arange(sk)[None].expand(b, sk))
    cos_q, sin_q = emb(q, torch.arange(sk - sq, sk)[None].expand(b, sq))
    if rd == dk:
        q, _ = llama_apply(q, q, cos_q, sin_q); k, _ = llama_apply(k, k, cos_k, sin_k)
    else:
        q, _ = neox_apply(q, q, cos_q, sin_q); k, _ = neox_apply(k, k, cos_k, sin_k)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dk), -1)
    out = (w @ v).permute(2, 0, 1, 3).reshape(sq, b, h * dk)
    return m.output(out)


# ---------------------------------------------------------------- parity with transformers
@needs_hf
@pytest.mark.parametrize("heads, d_model, rotary_dim", [(4, 32, None), (3, 48, None), (6, 48, 4), (5, 40, 8)])
@pytest.mark.parametrize("sq, sk", [(7, 7), (4, 11), (1, 9)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_layer_matches_transformers(heads, d_model, rotary_dim, sq, sk, need_weights):
    m = make(heads, d_model, rotary_dim=rotary_dim)
    g = torch.Generator().manual_seed(1)
    x, kv = torch.randn(sq, 2, d_model, generator=g), torch.randn(sk, 2, d_model, generator=g)
    with torch.no_grad():
        assert rel_err(run(m, x, kv, need_weights=need_weights), hf_layer(m, x, kv)) <= 1e-6


@needs_hf
@pytest.mark.parametrize("dim, base, start", [(64, 10000.0, 0), (16, 500000.0, 1000), (128, 10000.0, 4000)])
def test_cos_sin_bit_identical_to_llama(dim, base, start):
    cfg = LlamaConfig(hidden_size=dim * 2, num_attention_heads=2, head_dim=dim, rope_theta=base)
    x = torch.zeros(1, 2, 5, dim)
    hc, hs = LlamaRotaryEmbedding(cfg)(x, torch.arange(start, start + 5)[None])
    c, s = rotary_cos_sin(rotary_angles(torch.arange(start, start + 5), dim, base))
    assert torch.equal(c, hc[0]) and torch.equal(s, hs[0])


@needs_hf
@pytest.mark.parametrize("rd", [8, 16, 32])
def test_interleaved_matches_gptj(rd):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 3, 32, generator=g)                          # GPT-J: [b, n, h, d]
    pos = torch.arange(3, 12)
    table = create_sinusoidal_positions(12, rd)[pos]
    ref = torch.cat([gptj_apply(q[..., :rd], table[None, :, :rd // 2], table[None, :, rd // 2:]), q[..., rd:]], -1)
    c, s = rotary_cos_sin(rotary_angles(pos, rd), interleaved=True)
    assert rel_err(apply_rotary(q, c[:, None], s[:, None], interleaved=True), ref) <= 1e-6


@needs_hf
def test_bf16_rotation_matches_llama_in_bf16():
    "transformers casts cos/sin to the query's dtype and rotates in it; so does relpos."
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 16, generator=g).bfloat16()
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, head_dim=16)
    hc, hs = LlamaRotaryEmbedding(cfg)(q, torch.arange(6)[None])
    ref, _ = llama_apply(q, q, hc, hs)
    c, s = rotary_cos_sin(rotary_angles(torch.arange(6), 16), dtype=torch.bfloat16)
    assert torch.equal(apply_rotary(q, c, s), ref)


# ---------------------------------------------------------------- the relative property
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 10), shift=st.integers(0, 3000), interleaved=st.booleans(),
       rd=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16))
def test_scores_depend_on_relative_distance_only(n, shift, interleaved, rd, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    def scores(start):
        c, s = rotary_cos_sin(rotary_angles(torch.arange(start, start + n), rd, dtype=torch.float64), interleaved)
        return apply_rotary(q, c, s, interleaved) @ apply_rotary(k, c, s, interleaved).T
    torch.testing.assert_close(scores(shift), scores(0), rtol=1e-9, atol=1e-9)


def test_layer_memory_equals_suffix_of_full_sequence():
    "Queries = the last 4 of 10 tokens, keys = all 10: the same outputs as rows 6.. of the full self-attention (causal)."
    m = make()
    x = torch.randn(10, 2, 32)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[..., None]
    full = run(m, x, x, causal)
    part = run(m, x[6:], x, causal[6:])
    torch.testing.assert_close(part, full[6:], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- fast path == readable path
@settings(max_examples=30, deadline=None)
@given(sq=st.integers(0, 6), extra=st.integers(0, 4), b=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       rd_frac=st.sampled_from([1, 2]), interleaved=st.booleans(),
       mask_kind=st.sampled_from([None, "full", "q1", "b1", "causal"]), p_mask=st.floats(0, 1),
       seed=st.integers(0, 2**16))
def test_fast_equals_readable_values_and_gradients(sq, extra, b, heads, rd_frac, interleaved, mask_kind, p_mask, seed):
    d_model = 8 * heads
    m = make(heads, d_model, seed=seed, rotary_dim=8 // rd_frac, interleaved=interleaved)
    sk = sq + (0 if mask_kind == "causal" else extra)
    g = torch.Generator().manual_seed(seed)
    q, kv = torch.randn(sq, b, d_model, generator=g), torch.randn(sk, b, d_model, generator=g)
    mask = torch.rand(sq, sk, b, generator=g) >= p_mask
    mask = {None: None, "full": mask, "q1": mask[:1], "b1": mask[..., :1],
            "causal": torch.ones(sq, sk, dtype=torch.bool).tril()[..., None]}[mask_kind]
    go = torch.randn(sq, b, d_model, generator=g)
    res = []
    for need_weights in (False, True):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = run(m, qq, kk, mask, need_weights=need_weights)
        grads = torch.autograd.grad((out * go).sum(), [qq, kk, *m.parameters()], allow_unused=True)
        res.append([out, *[torch.zeros(()) if gr is None else gr for gr in grads]])
    assert res[0][0].isfinite().all()
    for a, r in zip(*res): torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_causal_mask_takes_is_causal_route(monkeypatch):
    "An exactly causal bool mask reaches SDPA as is_causal=True (no mask tensor); any other mask as a mask."
    calls = []
    real = F.scaled_dot_product_attention
    def spy(*a, **kw):
        calls.append((kw.get('is_causal', False), kw.get('attn_mask') is not None)); return real(*a, **kw)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
    m = make()
    x = torch.randn(6, 2, 32)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[..., None]
    run(m, x, x, causal); run(m, x, x, causal.expand(6, 6, 2).clone())
    not_causal = causal.clone(); not_causal[3, 0] = False
    run(m, x, x, not_causal); run(m, x[2:], x, causal[2:])
    assert calls == [(True, False), (True, False), (False, True), (False, True)]


def test_torch_func_grad_and_vmap():
    m = make()
    x = torch.randn(5, 2, 32)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[..., None]
    g = torch.func.grad(lambda x: run(m, x, x, causal).square().sum())(x)
    xr = x.clone().requires_grad_()
    run(m, xr, xr, causal, need_weights=True).square().sum().backward()
    torch.testing.assert_close(g, xr.grad, rtol=1e-5, atol=1e-6)
    out = torch.func.vmap(lambda x: run(m, x, x))(x[None].expand(2, 5, 2, 32))
    torch.testing.assert_close(out[1], run(m, x, x), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the fast rotation == apply_rotary, bit for bit
def _cos_sin(n, rd, interleaved, dtype=torch.float32, batch=None):
    c, s = rotary_cos_sin(rotary_angles(torch.arange(n), rd, dtype=torch.float64), interleaved)
    c, s = c.to(dtype), s.to(dtype)
    if batch is None: return c[:, None, None], s[:, None, None]        # [n, 1, 1, rd]
    shift = torch.arange(batch)[:, None] * 0.37                          # [n, b, 1, rd]: per-batch angles
    a = (torch.arange(n)[None] + shift)[..., None].double() * rotary_inv_freq(rd, dtype=torch.float64)
    c, s = rotary_cos_sin(a, interleaved)
    return c.transpose(0, 1)[:, :, None].to(dtype), s.transpose(0, 1)[:, :, None].to(dtype)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 9), b=st.integers(1, 3), h=st.integers(1, 3), d=st.sampled_from([2, 4, 8, 12]),
       rd_frac=st.sampled_from([1, 2]), interleaved=st.booleans(), per_batch=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_apply_rotary_fast_is_apply_rotary_bit_for_bit(n, b, h, d, rd_frac, interleaved, per_batch, dtype, seed):
    "Same values and the same gradient as `apply_rotary`, exactly (torch.equal), for both layouts and partial rotation."
    rd = max(2, d // rd_frac // 2 * 2)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, b, h, d, generator=g) * 3).to(dtype).requires_grad_()
    go = torch.randn(n, b, h, d, generator=g).to(dtype)
    c, s = _cos_sin(n, rd, interleaved, dtype, b if per_batch else None)
    ref, fast = apply_rotary(x, c, s, interleaved), apply_rotary_fast(x, c, s, interleaved)
    assert fast.dtype == ref.dtype and fast.shape == ref.shape
    assert torch.equal(fast, ref)
    g_ref, = torch.autograd.grad(ref, x, go)
    g_fast, = torch.autograd.grad(fast, x, go)
    assert torch.equal(g_fast, g_ref)


@pytest.mark.parametrize("interleaved, rd", [(False, 6), (True, 6), (False, 10), (True, 4)])
def test_gradcheck_gradgradcheck_apply_rotary_fast(interleaved, rd):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 10, generator=g, dtype=torch.float64, requires_grad=True)
    c, s = rotary_cos_sin(rotary_angles(torch.arange(5), rd, dtype=torch.float64)[:, None], interleaved)
    f = lambda x: apply_rotary_fast(x, c, s, interleaved)
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))               # its backward is itself differentiable
    # the second derivative is the readable one's, bit for bit (the rotation is linear: it is zero, and the
    # mixed one, d/d(grad_output), is the rotation back)
    go = torch.randn(5, 2, 10, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 2, 10, generator=g, dtype=torch.float64)
    res = []
    for fn in (apply_rotary, apply_rotary_fast):
        gx, = torch.autograd.grad(fn(x, c, s, interleaved), x, go, create_graph=True)
        res.append(torch.autograd.grad((gx * w).sum(), go))
    assert torch.equal(res[0][0], res[1][0])


def test_apply_rotary_fast_forward_mode_and_torch_func():
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(4, 3, 8, generator=g, dtype=torch.float64), torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    c, s = rotary_cos_sin(rotary_angles(torch.arange(4), 8, dtype=torch.float64)[:, None])
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        out = apply_rotary_fast(fwAD.make_dual(x, t), c, s)
        tangent = fwAD.unpack_dual(out).tangent
    assert torch.equal(tangent, apply_rotary(t, c, s))        # linear: the tangent is rotated the same way
    f = lambda x: apply_rotary_fast(x, c, s).square().sum()
    torch.testing.assert_close(torch.func.grad(f)(x), 2 * apply_rotary(apply_rotary(x, c, s), c, -s), rtol=0, atol=1e-12)
    _, jt = torch.func.jvp(lambda x: apply_rotary_fast(x, c, s), (x,), (t,))
    assert torch.equal(jt, apply_rotary(t, c, s))
    xs = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
    assert torch.equal(torch.func.vmap(lambda x: apply_rotary_fast(x, c, s))(xs), apply_rotary(xs, c, s))


def test_apply_rotary_fast_falls_back_where_it_would_differ():
    "cos/sin that need gradients, another dtype, a cos that broadcasts x larger: the readable result (and its errors)."
    x = torch.randn(5, 2, 8, requires_grad=True)
    c, s = rotary_cos_sin(rotary_angles(torch.arange(5), 8)[:, None])
    cg = c.clone().requires_grad_()
    apply_rotary_fast(x, cg, s).sum().backward()
    assert cg.grad is not None and torch.equal(cg.grad, x.detach().sum(1, keepdim=True))
    c64, s64 = c.double(), s.double()
    assert torch.equal(apply_rotary_fast(x, c64, s64), apply_rotary(x, c64, s64))   # promotes like apply_rotary
    wide_c, wide_s = c.expand(5, 3, 8), s.expand(5, 3, 8)                         # [5, 3, 8] against x [5, 1, 8]
    assert torch.equal(apply_rotary_fast(x[:, :1], wide_c, wide_s), apply_rotary(x[:, :1], wide_c, wide_s))
    with pytest.raises(ValueError, match="rotary_dim=8"):
        apply_rotary_fast(x[..., :4], c, s)


@pytest.mark.parametrize("kw", [dict(), dict(interleaved=True), dict(rotary_dim=4), dict(kv_heads=2),
                                dict(rope_scaling={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 4}),
                                dict(rope_scaling={'rope_type': 'dynamic', 'factor': 2.0}, max_position_embeddings=4)])
@pytest.mark.parametrize("ids", [False, True])
def test_layer_fast_rotation_is_the_readable_one(kw, ids):
    "The layer's fast rotation (cached tables or position ids, SDPA's memory order) gives the readable rotation's numbers exactly."
    m = make(4, 32, **kw)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(7, 2, m.kv_heads, 8, generator=g, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [3, 4, 5, 6, 7, 8, 9]]) if ids else None
    gq, gk = torch.randn(5, 2, 4, 8, generator=g), torch.randn(7, 2, m.kv_heads, 8, generator=g)
    res = []
    for fast in (False, True, True):      # the second fast call reads the cached tables
        rq, rk = m.rotate(q, k, pos, fast=fast)
        res.append((rq, rk, *torch.autograd.grad([rq, rk], [q, k], [gq, gk])))
    for other in res[1:]:
        for a, b in zip(res[0], other): assert torch.equal(a, b)
    assert res[1][0].permute(1, 2, 0, 3).is_contiguous()            # written in SDPA's [batch, heads, seq, d] order


def test_rotary_tables_do_not_depend_on_the_mode_that_built_them():
    "A first call under inference_mode / no_grad / autocast leaves ordinary float tensors: a training step after it works and equals a fresh layer's."
    x = torch.randn(6, 2, 32)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[..., None]
    ref_m = make()
    ref = run(ref_m, x, x, causal)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in ref_m.parameters()]
    for mode in (torch.inference_mode, torch.no_grad, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        m = make()
        with mode(): run(m, x, x, causal)
        tables = m.rotary_tables(6, torch.float32, 'cpu')
        assert all(not t.is_inference() and not t.requires_grad and t.dtype == torch.float32 for t in tables)
        out = run(m, x, x, causal)
        out.sum().backward()
        assert torch.equal(out, ref)
        for p, gr in zip(m.parameters(), ref_grads): assert torch.equal(p.grad, gr)


def test_rotary_tables_follow_the_settings_and_stay_small():
    m = make(4, 32)
    x = torch.randn(6, 2, 32)
    run(m, x, x)
    m.base = 500.0                                                      # a setting changed on a built layer
    torch.testing.assert_close(run(m, x, x), run(make(4, 32, base=500.0), x, x), rtol=0, atol=0)
    for n in range(1, 12): run(m, x[:n], x[:n])
    assert len(m._rotary_tables) <= 4
    assert 'rotary' not in ''.join(m.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_double_backward_through_the_fast_path_names_the_way_out(dtype):
    "The fast rotation is twice differentiable, SDPA's fused kernel is not: create_graph through the layer's fast path stops with the way out."
    m = make().to(dtype)
    q = torch.randn(4, 2, 32, dtype=dtype, requires_grad=True)
    with pytest.raises(RuntimeError, match="need_weights=True"):
        gq, = torch.autograd.grad(run(m, q, q).sum(), q, create_graph=True)
        torch.autograd.grad(gq.sum(), q)
    gq, = torch.autograd.grad(run(m, q, q, need_weights=True).sum(), q, create_graph=True)   # the way out works
    torch.autograd.grad(gq.sum(), q)


# ---------------------------------------------------------------- gradients
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("mask_kind", [None, "causal", "padding"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(need_weights, mask_kind, interleaved):
    m = make(2, 8, rotary_dim=2, interleaved=interleaved).double()
    g = torch.Generator().manual_seed(0)
    sk = 4 if mask_kind == "causal" else 5
    q = torch.randn(4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(sk, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = {None: None, "causal": torch.ones(4, 4, dtype=torch.bool).tril()[..., None],
            "padding": torch.rand(4, sk, 2, generator=g) > 0.3}[mask_kind]
    if mask_kind == "padding": mask[1, :, 0] = False
    assert torch.autograd.gradcheck(lambda q, kv: run(m, q, kv, mask, need_weights=need_weights), (q, kv))


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_apply_rotary(interleaved):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 10, generator=g, dtype=torch.float64, requires_grad=True)
    c, s = rotary_cos_sin(rotary_angles(torch.arange(5), 6, dtype=torch.float64)[:, None], interleaved)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, c, s, interleaved), (x,))
    assert torch.autograd.gradgradcheck(lambda x: apply_rotary(x, c, s, interleaved), (x,))


def test_higher_order_gradients_on_readable_path():
    m = make(2, 8).double()
    q = torch.randn(3, 1, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda q: run(m, q, q, need_weights=True), (q,))


# ---------------------------------------------------------------- compile, dtypes, modes
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_compile_aot_eager_fullgraph(need_weights, causal):
    m = make()
    x = torch.randn(6, 2, 32)
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[..., None] if causal else None
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(run(cm, x, x, mask, need_weights=need_weights), run(m, x, x, mask), rtol=1e-5, atol=1e-6)


def test_compile_inductor_forward_backward():
    m = make()
    x, mem = torch.randn(5, 2, 32), torch.randn(8, 2, 32)
    out_c = run(torch.compile(m, fullgraph=True), x, mem)
    out_c.sum().backward()
    g_c = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = run(m, x, mem)
    out.sum().backward()
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, (p.grad for p in m.parameters())): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_bf16_module(need_weights): check_bf16_module(make(), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make())
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(make(2, 16), 3000)


# ---------------------------------------------------------------- state
def test_state_dict_is_plain_mha_and_round_trips(): check_state_dict_is_plain_mha_and_round_trips(make(), make(seed=3))
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make(dropout_prob=0.5))


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call, exc, match", [
    (lambda: RotaryMultiHeadAttention(4, 32, rotary_dim=3), ValueError, "rotary_dim must be a positive even int"),
    (lambda: RotaryMultiHeadAttention(4, 32, rotary_dim=0), ValueError, "rotary_dim must be a positive even int"),
    (lambda: RotaryMultiHeadAttention(4, 32, rotary_dim=10), ValueError, r"rotary_dim must be <= d_k \(head_dim, d_model // heads by default\) = 8, got 10"),
    (lambda: RotaryMultiHeadAttention(4, 32, rotary_dim=4.0), TypeError, "rotary_dim must be an int"),
    (lambda: RotaryMultiHeadAttention(4, 32, base=1), ValueError, "base must be"),
    (lambda: RotaryMultiHeadAttention(4, 32, base=float('inf')), ValueError, "base must be"),
    (lambda: RotaryMultiHeadAttention(0, 32), ValueError, "heads"),
    (lambda: RotaryMultiHeadAttention(-1, 32), ValueError, "heads"),
    (lambda: RotaryMultiHeadAttention(4, 30), ValueError, "d_model"),
    (lambda: rotary_inv_freq(5), ValueError, "rotary_dim"),
    (lambda: rotary_angles([0, 1, 2], 8), TypeError, "positions"),
    (lambda: apply_rotary(torch.randn(3, 4), *rotary_cos_sin(rotary_angles(torch.arange(3), 8))), ValueError, "rotary_dim=8"),
])
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match): call()


def test_queries_longer_than_keys_refused():
    with pytest.raises(ValueError, match="key must be at least as long as query"):
        run(make(), torch.randn(5, 1, 32), torch.randn(3, 1, 32))

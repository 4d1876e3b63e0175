"Tests of `relpos.fox` that would clutter the chapter: the paper's equations in NumPy (values, and gradients by finite differences, float64), x-transformers' `data_dependent_alibi` (bias and whole attention, float64), fast == readable (hypothesis), the fused kernel, gradcheck, dtypes, modes, errors."
import functools
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.fox import ForgettingMultiHeadAttention, forget_sums, fox_bias, fox_operands
from mha_module_checks import (rel_err, run, check_bf16_module, check_autocast_bf16, check_float64_matches_float32,
                               check_no_state_from_the_mode_it_ran_in, check_long_sequence_no_limit,
                               check_dropout_training_path_runs)
from mha_module_checks import decode_through_cache as _decode, check_left_padded_decoding

try: import x_transformers.x_transformers as xtr
except ImportError: xtr = None


# ---------------------------------------------------------------- the paper's equations, in NumPy
def numpy_fox(P, heads, xq, xk, mask=None):
    """FoX by the paper's equations, NumPy float64, from the state dict `P` (NumPy arrays): gates f = sigma(W x + b) of
    the keys' inputs, key j's weight exp(q_i . k_j / sqrt(d_k)) times the product f_{j+1} ... f_i, normalised over the keys
    j <= i (query i is key i + nk - nq) that `mask` [nq, nk, batch] lets through; a row with none gives 0."""
    proj = lambda x, n: (x @ P[f'{n}.linear.weight'].T + P.get(f'{n}.linear.bias', 0)).reshape(*x.shape[:-1], heads, -1)
    q, k, v = proj(xq, 'query'), proj(xk, 'key'), proj(xk, 'value')
    d_k = q.shape[-1]
    f = 1 / (1 + np.exp(-(xk @ P['forget.weight'].T + P['forget.bias'])))      # [nk, batch, heads]
    nq, nk, B = len(xq), len(xk), xq.shape[1]
    if mask is not None:   # a key that no query may see is padding: no gate (f = 1)
        causal = np.tril(np.ones((nq, nk), dtype=bool), nk - nq)[..., None]
        seen = (np.broadcast_to(mask, (nq, nk, mask.shape[2])) & causal).any(0)  # [nk, batch or 1]
        f = np.where(np.broadcast_to(seen, (nk, B))[..., None], f, 1.0)
    out = np.zeros_like(q)
    for i in range(nq):
        ii = i + nk - nq
        for b in range(B):
            js = [j for j in range(ii + 1) if mask is None or mask[i if mask.shape[0] > 1 else 0, j, b if mask.shape[2] > 1 else 0]]
            if not js: continue
            for h in range(heads):
                w = np.array([np.prod(f[j + 1:ii + 1, b, h]) * np.exp(q[i, b, h] @ k[j, b, h] / np.sqrt(d_k)) for j in js])
                out[i, b, h] = w @ v[js, b, h] / w.sum()
    return out.reshape(nq, B, -1) @ P['output.weight'].T + P['output.bias']


def _layer(heads=2, d=4, seed=0, kv_heads=None, gate_bias=1.0, bias=True):
    torch.manual_seed(seed)
    layer = ForgettingMultiHeadAttention(heads, heads * d, dropout_prob=0.0, gate_bias=gate_bias, kv_heads=kv_heads,
                                         bias=bias).double()
    with torch.no_grad(): layer.forget.weight.mul_(3)   # gates spread over (0, 1), some nearly closed
    return layer


def test_sums_and_bias_are_products_of_gates():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 9)) * 3
    f = 1 / (1 + np.exp(-logits))
    Fs = forget_sums(torch.tensor(logits))
    D = fox_bias(Fs, Fs).numpy()
    for i in range(9):
        for j in range(i + 1):
            np.testing.assert_allclose(np.exp(D[:, i, j]), np.prod(f[:, j + 1:i + 1], axis=1), rtol=1e-12)
    assert forget_sums(torch.zeros(4, dtype=torch.bfloat16)).dtype == torch.float32   # never a half-precision sum


@pytest.mark.parametrize('need_weights', [True, False])
@pytest.mark.parametrize('case', ['self', 'memory', 'padding', 'gqa'])
def test_layer_equals_paper_numpy(case, need_weights):
    "Both paths == the paper's equations in NumPy, float64: self-attention, keys longer than queries, a padding mask with a fully masked row, grouped-query heads."
    layer = _layer(3, 4, seed=1, kv_heads=1 if case == 'gqa' else None)
    g = torch.Generator().manual_seed(1)
    xk = torch.randn(8, 2, 12, dtype=torch.float64, generator=g)
    xq = xk[3:] if case in ('memory', 'padding') else xk
    mask = None
    if case == 'padding':
        mask = torch.rand(5, 8, 2, generator=g) > 0.3; mask[1, :, 1] = False
        mask[:, 4, 0] = False; mask[:, 2, 1] = False                          # keys no query sees: padding
    P = {k: v.detach().numpy() for k, v in layer.state_dict().items()}
    if case == 'gqa':   # the reference repeats the key/value head for every query head
        for n in ('key', 'value'):
            for s in ('weight', 'bias'): P[f'{n}.linear.{s}'] = np.tile(P[f'{n}.linear.{s}'], (3,) + (1,) * (P[f'{n}.linear.{s}'].ndim - 1))
    ours = layer(query=xq, key=xk, value=xk, mask=mask, need_weights=need_weights)
    want = numpy_fox(P, 3, xq.numpy(), xk.numpy(), None if mask is None else mask.numpy())
    if case == 'padding': want[1, 1] = P['output.bias']   # fully masked row: 0 before the output projection
    np.testing.assert_allclose(ours.detach().numpy(), want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize('need_weights', [True, False])
def test_gate_gradients_equal_numpy_finite_differences(need_weights):
    "d(loss)/d(forget.weight, forget.bias) by autograd (both paths) == central differences of the NumPy reference."
    layer = _layer(2, 3, seed=2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2, 6, dtype=torch.float64, generator=g)
    w = torch.randn(6, 2, 6, dtype=torch.float64, generator=g)
    layer.zero_grad()
    (layer(query=x, key=x, value=x, need_weights=need_weights) * w).sum().backward()
    P = {k: v.detach().numpy().copy() for k, v in layer.state_dict().items()}
    loss = lambda P: (numpy_fox(P, 2, x.numpy(), x.numpy()) * w.numpy()).sum()
    for name in ('forget.weight', 'forget.bias'):
        num = np.zeros_like(P[name])
        for idx in np.ndindex(*P[name].shape):
            h, old = 1e-6, P[name][idx]
            P[name][idx] = old + h; up = loss(P)
            P[name][idx] = old - h; down = loss(P)
            P[name][idx] = old; num[idx] = (up - down) / (2 * h)
        got = dict(layer.named_parameters())[name].grad.numpy()
        np.testing.assert_allclose(got, num, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------- x-transformers' data_dependent_alibi
@pytest.mark.skipif(xtr is None, reason='x-transformers not installed')
def test_bias_and_its_gradient_equal_x_transformers():
    "`DataDependentAlibi` in float64 given the layer's gate weights: the same F_i - F_j on and below the diagonal, and the same gradients of the gate weights."
    layer = _layer(3, 4, seed=3)
    ref = xtr.DataDependentAlibi(12, 3, causal=True).double()
    ref.to_forget_gates[0].load_state_dict(layer.forget.state_dict())
    x = torch.randn(9, 2, 12, dtype=torch.float64)
    ours = fox_bias(layer.sums(x), layer.sums(x))
    theirs = ref(x.transpose(0, 1))
    below = torch.ones(9, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(ours[..., below], theirs[..., below], rtol=1e-13, atol=1e-13)
    wt = torch.randn_like(ours)
    (ours[..., below] * wt[..., below]).sum().backward(); (theirs[..., below] * wt[..., below]).sum().backward()
    torch.testing.assert_close(layer.forget.weight.grad, ref.to_forget_gates[0].weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.forget.bias.grad, ref.to_forget_gates[0].bias.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(xtr is None, reason='x-transformers not installed')
@pytest.mark.parametrize('need_weights', [True, False])
def test_attention_equals_x_transformers(need_weights):
    "x-transformers' `Attention(causal=True, data_dependent_alibi=True)` with the same weights (no projection biases), float64: the same outputs and input gradients on both paths."
    layer = _layer(3, 4, seed=4, bias=False)
    with torch.no_grad(): layer.value.linear.bias.zero_(); layer.output.bias.zero_()
    ref = xtr.Attention(dim=12, dim_head=4, heads=3, causal=True, data_dependent_alibi=True).double().eval()
    ref.to_q.weight.data.copy_(layer.query.linear.weight); ref.to_k.weight.data.copy_(layer.key.linear.weight)
    ref.to_v.weight.data.copy_(layer.value.linear.weight); ref.to_out.weight.data.copy_(layer.output.weight)
    ref.data_dependent_alibi.to_forget_gates[0].load_state_dict(layer.forget.state_dict())
    ref.attend.attn_fn = functools.partial(torch.softmax, dim=-1)   # its softmax computes in float32: float64 here
    x = torch.randn(2, 10, 12, dtype=torch.float64, requires_grad=True)
    theirs = ref(x)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    xs = x.detach().transpose(0, 1).clone().requires_grad_()
    ours = layer(query=xs, key=xs, value=xs, need_weights=need_weights)
    torch.testing.assert_close(ours.transpose(0, 1), theirs, rtol=1e-12, atol=1e-12)
    w = torch.randn_like(theirs)
    (theirs * w).sum().backward(); (ours.transpose(0, 1) * w).sum().backward()
    torch.testing.assert_close(xs.grad.transpose(0, 1), x.grad, rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- fast path
@settings(max_examples=30, deadline=None)
@given(mask_kind=st.sampled_from(['none', 'causal', 'padding', 'padding+causal']),
       nq=st.integers(1, 16), mem=st.integers(0, 8), batch=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       gqa=st.booleans(), seed=st.integers(0, 10_000))
def test_property_fast_equals_readable(mask_kind, nq, mem, batch, heads, gqa, seed):
    "The fast path (default) == the readable path (need_weights=True), float64: output and the gradients of the inputs and every parameter (the gates' included)."
    layer = _layer(heads, 4, seed, kv_heads=1 if gqa else None)
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    x, kv = (torch.randn(n, batch, heads * 4, generator=g, dtype=torch.float64) for n in (nq, nk))
    causal = torch.ones(nq, nk, dtype=torch.bool).tril(mem)[..., None]
    pad = torch.rand(1 if seed % 2 else nq, nk, batch, generator=g) > 0.4
    mask = {'none': None, 'causal': causal, 'padding': pad, 'padding+causal': pad & causal}[mask_kind]
    w = torch.randn(nq, batch, heads * 4, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (False, True):
        layer.zero_grad()
        xx, kk = x.clone().requires_grad_(), kv.clone().requires_grad_()
        out = layer(query=xx, key=kk, value=kk, mask=mask, need_weights=need_weights)
        (out * w).sum().backward()
        res.append([out.detach(), xx.grad, kk.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_operands_carry_the_bias():
    q, k = torch.randn(2, 3, 5, 4, dtype=torch.float64), torch.randn(2, 3, 7, 4, dtype=torch.float64)
    Fq, Fk = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 7, dtype=torch.float64)
    q2, k2 = fox_operands(q, k, Fq, Fk)
    assert q2.shape[-1] == k2.shape[-1] == 6
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), q @ k.transpose(-1, -2) + fox_bias(Fq, Fk), rtol=1e-13, atol=1e-13)


def test_causal_fast_path_is_the_fused_kernel():
    "Causal self-attention (no mask, or the causal one) runs the fused CPU kernel forward and backward: no math kernel, nothing of n x n saved."
    torch.manual_seed(0)
    n = 128
    layer = ForgettingMultiHeadAttention(2, 32, dropout_prob=0.0)
    x = torch.randn(n, 1, 32, requires_grad=True)
    for mask in (None, torch.ones(n, n, dtype=torch.bool).tril()[..., None]):
        sizes = []
        def pack(t): sizes.append(t.numel()); return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.profiler.profile() as prof:
            layer(query=x, key=x, value=x, mask=mask).sum().backward()
        ops = {e.key for e in prof.key_averages()}
        assert 'aten::_scaled_dot_product_flash_attention_for_cpu' in ops and 'aten::_scaled_dot_product_attention_math' not in ops
        assert max(sizes) < n * n, max(sizes)


@pytest.mark.parametrize('mask_kind', ['none', 'memory', 'padding'])
def test_gradcheck_fast_path(mask_kind):
    "float64 gradcheck of the fast path on the inputs and the gate parameters."
    layer = _layer(2, 3, seed=5)
    x = torch.randn(4, 2, 6, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(6 if mask_kind != 'none' else 4, 2, 6, dtype=torch.float64, requires_grad=True)
    mask = (torch.tensor([[True, False, True, True, False, True], [True, True, False, True, True, True]]).T[None]
            if mask_kind == 'padding' else None)
    names = ['forget.weight', 'forget.bias']
    ps = [dict(layer.named_parameters())[n].detach().clone().requires_grad_() for n in names]
    def f(x, kv, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (), dict(query=x, key=kv, value=kv, mask=mask))
    assert torch.autograd.gradcheck(f, (x, kv, *ps))


def test_gradgradcheck_readable_path():
    layer = _layer(2, 3, seed=6)
    x = torch.randn(5, 1, 6, dtype=torch.float64, requires_grad=True)
    w = layer.forget.weight.detach().clone().requires_grad_()
    f = lambda x, w: torch.func.functional_call(layer, {'forget.weight': w}, (), dict(query=x, key=x, value=x, need_weights=True))
    assert torch.autograd.gradgradcheck(f, (x, w))


# ---------------------------------------------------------------- dtypes, modes, state
def make(): return ForgettingMultiHeadAttention(4, 32).eval()

@pytest.mark.parametrize('need_weights', [False, True])
def test_bf16_module(need_weights): check_bf16_module(make(), need_weights)
def test_autocast_bf16(): check_autocast_bf16(make())
def test_float64_matches_float32(): check_float64_matches_float32(make())
def test_no_state_from_the_mode_it_ran_in(): check_no_state_from_the_mode_it_ran_in(make())
def test_long_sequence_no_limit(): check_long_sequence_no_limit(ForgettingMultiHeadAttention(2, 16), 5000)
def test_dropout_training_path_runs(): check_dropout_training_path_runs(make())

def test_padding_token_forgets_nothing():
    "A key the mask hides from every query is padding: the other tokens get what the row without it gives (fast and readable path)."
    layer = _layer(2, 4, seed=7)
    x = torch.randn(9, 1, 8, dtype=torch.float64)
    keep = torch.ones(9, dtype=torch.bool); keep[4] = False
    mask = keep[None, :, None].expand(9, 9, 1)
    for need_weights in (False, True):
        got = layer(query=x, key=x, value=x, mask=mask, need_weights=need_weights)[keep]
        want = layer(query=x[keep], key=x[keep], value=x[keep], need_weights=need_weights)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_no_sums_left_after_a_call_or_an_error():
    layer = make()
    x = torch.randn(4, 1, 32)
    layer(query=x, key=x, value=x)
    assert layer._sums is None
    with pytest.raises(TypeError): layer(query=x, key=x, value=x, mask=torch.ones(4, 4, 1))
    assert layer._sums is None


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize('kw,error,match', [
    (dict(gate_bias='5'), ValueError, 'gate_bias must be a finite number'),
    (dict(gate_bias=float('inf')), ValueError, 'gate_bias must be a finite number'),
    (dict(gate_bias=True), ValueError, 'gate_bias must be a finite number'),
    (dict(kv_heads=3), ValueError, 'kv_heads must be a positive int'),
])
def test_bad_arguments(kw, error, match):
    with pytest.raises(error, match=match): ForgettingMultiHeadAttention(2, 8, **kw)


def test_bad_calls():
    layer = ForgettingMultiHeadAttention(2, 8)
    x = torch.randn(4, 1, 8)
    with pytest.raises(ValueError, match='key must be at least as long as query'): layer(query=x, key=x[:2], value=x[:2])
    with pytest.raises(TypeError, match='position_ids'): layer(query=x, key=x, value=x, position_ids=torch.arange(4))
    with pytest.raises(TypeError, match='key has dtype torch.float64'): layer(query=x, key=x.double(), value=x)
    with pytest.raises(ValueError, match='key must have d_model=8'): layer(query=x, key=x[..., :4], value=x)
    with pytest.raises(TypeError, match='key must be a torch.Tensor'): layer(query=x, key=[1], value=x)
    with pytest.raises(RuntimeError, match='exists only while the layer is called'): layer.position_bias(4, 4)


# ---------------------------------------------------------------- DecoderLM(position='fox') and the K/V cache
def _lm(**kw):
    "A float64 DecoderLM with FoX layers, every parameter perturbed, the gates spread over (0, 1)."
    from relpos.models import DecoderLM
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position='fox', **kw).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for layer in lm.layers:
            f = layer.self_attn.module.forget
            f.weight.normal_(0, 1, generator=g); f.bias.uniform_(-1, 3, generator=g)
    return lm


@pytest.mark.parametrize('window', [None, 4])
@pytest.mark.parametrize('kw', [dict(), dict(kv_heads=1)])
def test_cached_decoding_equals_full_model(kw, window):
    "DecoderLM(position='fox'): a prompt, then one token at a time, then chunks: the full model's logits (same window), float64 <= 1e-10."
    from relpos.cache import full_logits
    lm = _lm(**kw)
    seq = torch.randint(0, 13, (3, 16), generator=torch.Generator().manual_seed(1))
    want = full_logits(lm, seq, max_cache_len=window)
    assert (_decode(lm, seq, 5, window) - want).abs().max() <= 1e-10
    assert (_decode(lm, seq, 3, window, chunks=[4, 1, 6, 2]) - want).abs().max() <= 1e-10


def test_cached_decoding_left_padded():
    "A left-padded prompt: each row's cached logits equal the full model on that row alone."
    check_left_padded_decoding(_lm())


def test_decoder_lm_trains_the_gates():
    from relpos.models import DecoderLM, POSITIONS, GQA_POSITIONS
    assert 'fox' in POSITIONS and 'fox' in GQA_POSITIONS
    lm = DecoderLM(11, d_model=16, heads=2, n_layers=1, position='fox', kv_heads=1)
    logits, _ = lm(torch.randint(0, 11, (2, 40)))
    logits.sum().backward()
    assert lm.layers[0].self_attn.module.forget.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- compile
@pytest.mark.parametrize('need_weights', [False, True])
def test_compile_aot_eager_fullgraph(need_weights):
    m = ForgettingMultiHeadAttention(4, 32).eval()
    x, mem = torch.randn(6, 2, 32), torch.randn(9, 2, 32)
    mask = torch.rand(6, 9, 2) > 0.2
    cm = torch.compile(m, fullgraph=True, backend='aot_eager')
    for msk in (None, mask):
        torch.testing.assert_close(run(cm, x, mem, msk, need_weights=need_weights), run(m, x, mem, msk), rtol=1e-5, atol=1e-6)
    assert m._sums is None

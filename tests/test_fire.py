"relpos.fire: the formula against an independent NumPy evaluation, the blockwise kernel and the layer's fast path against the readable path (values and every gradient), gradcheck, no [n, n] tensor kept for backward, and the FlexAttention score_mod on explicit score tensors."
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import relpos.fire as fire_mod
from relpos.fire import FireBias, FireMultiHeadAttention, fire_attention, fire_segments
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.fourier import FourierMultiHeadAttention
from relpos.t5 import T5MultiHeadAttention


def fire_numpy(i, r, c, L, w1, b1, w2, b2, eps=1e-6):
    "FIRE's bias for a query at position i and keys at distances r, written out in NumPy float64: [heads, len(r)]."
    psi = lambda x: np.log(np.abs(c * x) + 1.0)
    x = psi(r) / (psi(max(L, i)) + eps)
    return (np.maximum(0.0, np.outer(x, w1) + b1) @ w2.T + b2).T


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(fire_mod, '_FIRE_BLOCK_SCORES', 2**7)   # several blocks even for small inputs


def _fire(heads=3, seed=0, init_L=6.5):
    torch.manual_seed(seed)
    f = FireBias(heads, init_L=init_L).double()
    with torch.no_grad():
        for p in f.parameters(): p.add_(0.3 * torch.randn_like(p))
    return f


@pytest.mark.parametrize('L_multiplier', [0.5, 1.0, 3.0])
@pytest.mark.parametrize('offset', [0, 7])
def test_bias_equals_formula(L_multiplier, offset):
    "The bias at distances 0..i of known weights equals the formula evaluated in NumPy, below, at and above the threshold, with a memory offset."
    rng = np.random.default_rng(1)
    w1, b1, w2, b2 = rng.normal(size=32), rng.normal(size=32), rng.normal(size=(4, 32)), rng.normal(size=4)
    f = FireBias(4, init_L=10.0).double()
    with torch.no_grad():
        f.mlp[0].weight.copy_(torch.from_numpy(w1)[:, None]); f.mlp[0].bias.copy_(torch.from_numpy(b1))
        f.mlp[2].weight.copy_(torch.from_numpy(w2)); f.mlp[2].bias.copy_(torch.from_numpy(b2))
        f.c.fill_(0.2); f.L_multiplier.fill_(L_multiplier)
    n = 40
    bias = f(n, n + offset).detach()[0].numpy()        # query row t at position t + offset
    for t in range(n):
        i = t + offset
        r = np.arange(i + 1)
        np.testing.assert_allclose(bias[:, t, i - r], fire_numpy(i, r.astype(float), 0.2, 10.0 * L_multiplier, w1, b1, w2, b2),
                                   rtol=1e-12, atol=1e-12)


def test_segments_equal_mlp():
    "The piecewise-linear form of the MLP gives the MLP's values at any x (also outside [0, 1]), including units with w1 = 0."
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64), torch.randn(5, 32, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    w1[3] = 0.0; w1[7] = 0.0; b1[7] = -1.0
    breaks, slope, intercept = fire_segments(w1, b1, w2, b2)
    x = torch.linspace(-5, 5, 3001, dtype=torch.float64)
    piece = torch.bucketize(x, breaks)
    want = torch.nn.functional.linear(torch.relu(x[:, None] * w1 + b1), w2, b2).T
    torch.testing.assert_close(slope[:, piece] * x + intercept[:, piece], want, rtol=1e-12, atol=1e-12)


def _grads(out, wrt, g):
    return torch.autograd.grad(out, wrt, g)


@pytest.mark.usefixtures('small_blocks')
@settings(max_examples=25, deadline=None)
@given(causal=st.booleans(), nq=st.integers(1, 30), mem=st.integers(0, 10), batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_property_kernel_equals_reference(causal, nq, mem, batch, seed):
    "fire_attention (piecewise MLP, blocks) == the MLP-built bias through softmax, float64: values and the gradients of q, k, v, c, L_multiplier and the MLP's weights."
    f = _fire(seed=seed)
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    fast = fire_attention(q, k, v, f, 0.5, causal)
    ref = fire_mod._fire_attention_reference(q, k, v, 0.5, causal, mem, f.eps, *f.mlp_params())
    torch.testing.assert_close(fast, ref, rtol=1e-11, atol=1e-12)
    w = torch.randn(fast.shape, generator=g, dtype=torch.float64)
    wrt = [q, k, v] + list(f.parameters())
    for a, b in zip(_grads(fast, wrt, w), _grads(ref, wrt, w)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)   # b2's gradient is 0 in exact arithmetic: absolute


@pytest.mark.usefixtures('small_blocks')
@settings(max_examples=15, deadline=None)
@given(mask_kind=st.sampled_from(['none', 'causal', 'padding']), nq=st.integers(1, 24), mem=st.integers(0, 8),
       batch=st.integers(1, 2), seed=st.integers(0, 1000))
def test_property_layer_fast_equals_readable(mask_kind, nq, mem, batch, seed):
    "The layer's fast path (default) equals its readable path (need_weights=True) in float64, values and every parameter's gradient."
    torch.manual_seed(seed)
    layer = FireMultiHeadAttention(2, 16, dropout_prob=0.0, init_L=5.5).double()
    with torch.no_grad():
        for p in layer.positions.parameters(): p.add_(0.3 * torch.randn_like(p))
    nk = nq + mem
    g = torch.Generator().manual_seed(seed)
    x, kv = (torch.randn(n, batch, 16, generator=g, dtype=torch.float64) for n in (nq, nk))
    mask = {'none': None, 'causal': torch.ones(nq, nk, dtype=torch.bool).tril(mem)[..., None],
            'padding': torch.rand(1, nk, batch, generator=g) > 0.3}[mask_kind]
    w = torch.randn(nq, batch, 16, generator=g, dtype=torch.float64)
    res = []
    for need_weights in (False, True):
        layer.zero_grad()
        xx, kk = x.clone().requires_grad_(), kv.clone().requires_grad_()
        out = layer(query=xx, key=kk, value=kk, mask=mask, need_weights=need_weights)
        (out * w).sum().backward()
        res.append([out.detach(), xx.grad, kk.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('causal', [False, True])
def test_gradcheck_layer(causal, small_blocks):
    "float64 gradcheck of the layer's fast path: inputs, c, L_multiplier and the MLP's weights."
    torch.manual_seed(0)
    layer = FireMultiHeadAttention(2, 8, dropout_prob=0.0, mlp_width=4, init_L=3.5).double()
    x = torch.randn(5, 1, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(7, 1, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(5, 7, dtype=torch.bool).tril(2)[:, :, None] if causal else None
    names = ['positions.c', 'positions.L_multiplier', 'positions.mlp.0.weight', 'positions.mlp.0.bias', 'positions.mlp.2.weight']
    params = dict(layer.named_parameters())
    def f(x, kv, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (), dict(query=x, key=kv, value=kv, mask=mask))
    assert torch.autograd.gradcheck(f, (x, kv, *[params[n].detach().clone().requires_grad_() for n in names]))


def test_gradgrad_kernel():
    "backward(create_graph=True) through the kernel: exact second-order gradients (from the reference)."
    f = _fire()
    q, k, v = (torch.randn(1, 3, n, 4, dtype=torch.float64, requires_grad=True) for n in (4, 6, 6))
    ps = [p.detach().clone().requires_grad_(p.requires_grad) for p in f.mlp_params()]
    fn = lambda q, k, v, *ps: fire_mod._FireAttention.apply(q, k, v, 0.5, True, 2, f.eps, *ps)
    assert torch.autograd.gradgradcheck(fn, (q, k, v, *ps))


def test_no_score_sized_tensor_saved():
    "The causal fast path keeps nothing of n_q x n_k elements (or more) for backward: no [n, n] bias, no attention matrix."
    torch.manual_seed(0)
    n, heads = 256, 2
    layer = FireMultiHeadAttention(heads, 32, dropout_prob=0.0)
    x = torch.randn(n, 1, 32, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[..., None]
    sizes = []
    def pack(t): sizes.append(t.numel()); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(query=x, key=x, value=x, mask=mask)
    assert max(sizes) < n * n, max(sizes)
    out.sum().backward()
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):   # the readable path does keep them
        layer(query=x, key=x, value=x, mask=mask, need_weights=True)
    assert max(sizes) >= heads * n * n


# ---------------------------------------------------------------- FlexAttention score_mods on explicit score tensors
def _idx(B, H, nq, nk):
    return (torch.arange(B)[:, None, None, None], torch.arange(H)[None, :, None, None],
            torch.arange(nq)[None, None, :, None], torch.arange(nk)[None, None, None, :])

SCORE_MOD_LAYERS = {
    'alibi': lambda: ALiBiMultiHeadAttention(4, 32),
    'alibi_bidirectional': lambda: ALiBiMultiHeadAttention(4, 32, bidirectional=True),
    't5': lambda: T5MultiHeadAttention(4, 32, num_buckets=8, max_distance=6),
    't5_bidirectional': lambda: T5MultiHeadAttention(4, 32, num_buckets=8, max_distance=6, bidirectional=True),
    'fourier': lambda: FourierMultiHeadAttention(4, 32, max_number_of_keys=16, position_vector_size=8),
    'fire': lambda: FireMultiHeadAttention(4, 32, init_L=6.5),
}

@pytest.mark.parametrize('nq,nk', [(5, 5), (5, 13), (1, 9)])
@pytest.mark.parametrize('name', list(SCORE_MOD_LAYERS))
def test_score_mod_equals_readable_bias(name, nq, nk):
    "Each bias method's score_mod, called on a [B, H, n_q, n_k] score tensor with broadcasting index tensors, adds the readable path's bias: float64 values and the gradients of every position parameter."
    torch.manual_seed(0)
    layer = SCORE_MOD_LAYERS[name]().double()
    with torch.no_grad():
        for p in layer.parameters(): p.add_(0.3 * torch.randn_like(p))
    score = torch.randn(2, 4, nq, nk, dtype=torch.float64)
    got = layer.score_mod(nq, nk)(score, *_idx(2, 4, nq, nk))
    want = score + layer.position_bias(nq, nk).to(torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    wrt = [p for n, p in layer.named_parameters() if n.startswith('positions.')]
    if wrt:
        g = torch.randn_like(got)
        for a, b in zip(_grads(got, wrt, g), _grads(want, wrt, g)): torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.usefixtures('small_blocks')
@pytest.mark.parametrize('causal', [False, True])
def test_workers_equal_one_thread(causal, monkeypatch):
    "Two workers over disjoint heads (and a block's rows split between them) give what one worker gives: values and every gradient, float64."
    f = _fire(heads=3)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for n in (37, 41, 41))
    w = torch.randn(2, 3, 37, 4, generator=g, dtype=torch.float64)
    wrt = [q, k, v] + list(f.parameters())
    res = []
    for workers in (1, 2):
        monkeypatch.setattr(fire_mod, 'head_workers', lambda heads, work: workers)
        out = fire_attention(q, k, v, f, 0.5, causal)
        res.append([out] + list(_grads(out, wrt, w)))
    for a, b in zip(*res): torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    ref = fire_mod._fire_attention_reference(q, k, v, 0.5, causal, 4, f.eps, *f.mlp_params())
    torch.testing.assert_close(res[1][0], ref, rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- parameters FSDP2 can shard; checkpoints of earlier versions
def test_no_scalar_parameters_and_scalar_checkpoints_load():
    "c and L_multiplier are [1] (FSDP2's fully_shard refuses 0-d parameters); a state_dict holding them as scalars (earlier"
    " versions, the paper's code) loads into DecoderLM(position='fire') and gives the same logits and gradients."
    from relpos.models import DecoderLM
    torch.manual_seed(0)
    model = DecoderLM(50, 16, 2, 2, position='fire', max_len=8).double()
    with torch.no_grad():
        for p in model.parameters(): p.add_(0.1 * torch.randn_like(p))
    scalars = {n: tuple(p.shape) for n, p in model.named_parameters() if p.dim() == 0}
    assert not scalars, scalars
    old = {k: (v.reshape(()) if k.endswith(('positions.c', 'positions.L_multiplier')) else v.clone())
           for k, v in model.state_dict().items()}
    assert sum(v.dim() == 0 for v in old.values()) == 4 + 2          # c, L_multiplier per layer; init_L buffers stay 0-d
    loaded = DecoderLM(50, 16, 2, 2, position='fire', max_len=8).double()
    loaded.load_state_dict(old)
    assert {k: tuple(v.shape) for k, v in loaded.state_dict().items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (model, loaded):
        m.zero_grad()
        logits, _ = m(tokens)
        logits.square().mean().backward()
        outs.append([logits.detach()] + [p.grad for p in m.parameters()])
    for a, b in zip(*outs): assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match='size mismatch'):     # a wrong shape is still refused
        loaded.load_state_dict({**old, 'layers.0.self_attn.module.positions.c': torch.ones(2, dtype=torch.float64)})


class PaperFIRE(torch.nn.Module):
    "The paper's listing (Li et al. 2023, appendix), transcribed: the reference `FireBias` must equal bit for bit."
    def __init__(self, num_heads=12, mlp_width=32, init_c=0.1, init_L=512., eps=1e-6):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(1, mlp_width), torch.nn.ReLU(), torch.nn.Linear(mlp_width, num_heads))
        self.c = torch.nn.Parameter(torch.tensor(init_c))
        self.init_L = torch.nn.Parameter(torch.tensor(init_L), requires_grad=False)
        self.L_multiplier = torch.nn.Parameter(torch.tensor(1.0))
        self.eps = eps

    def forward(self, x):
        seq_length = x.size(1)
        positions = torch.arange(seq_length, dtype=torch.float, device=x.device)
        rel_distance = positions[:, None] - positions[None, :]
        threshold = torch.abs(self.L_multiplier * self.init_L)
        pos_normalizer = torch.max(positions, threshold)[:, None]
        rel_distance = torch.log(torch.abs(self.c * rel_distance) + 1)
        pos_normalizer = torch.log(torch.abs(self.c * pos_normalizer) + 1) + self.eps
        normalized_distance = rel_distance / pos_normalizer
        return self.mlp(normalized_distance.unsqueeze(-1)).unsqueeze(0).permute(0, 3, 1, 2)


@pytest.mark.parametrize('init_L, n', [(512.0, 64), (20.0, 90)])
def test_equals_paper_listing(init_L, n):
    "FireBias loaded into the paper's module (and back) gives the same bias bit for bit, below and beyond the threshold;"
    " the defaults are the paper's."
    torch.manual_seed(0)
    ours = FireBias(6, init_L=init_L)
    with torch.no_grad():
        for p in ours.parameters(): p.add_(0.1 * torch.randn_like(p))
    paper = PaperFIRE(num_heads=6, init_L=init_L)
    paper.load_state_dict({k: v.reshape(()) if k in ('c', 'L_multiplier') else v for k, v in ours.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(paper(torch.zeros(1, n, 4)), ours(n, n))
        back = FireBias(6, init_L=init_L); back.load_state_dict(paper.state_dict())
        assert torch.equal(back(n, n), ours(n, n))
    d, p = FireBias(12), PaperFIRE()
    assert (d.mlp[0].out_features, d.c.item(), d.threshold.item(), d.eps) == (p.mlp[0].out_features, p.c.item(), 512.0, p.eps)

"""Tests for relpos.context_choice (chapter nbs/05_context_choice.ipynb): parity with seed 003, per-head loop
equivalence, layouts, errors, dtypes, gradcheck, torch.compile, copies and training loops."""
import copy
import io
import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from relpos.context_choice import (LOCAL_LOSS_K, BaseContextChoice, ContextChoiceConstant, ContextChoiceLinear,
                                   local_score_loss)

CLASSES = [ContextChoiceLinear, ContextChoiceConstant]


# ------------------------------------------------------------------ seed 003, verbatim but for the names
def seed_local_score_loss(local_score):
    targets = torch.zeros(local_score.shape, dtype=local_score.dtype, device=local_score.device)
    return F.binary_cross_entropy_with_logits(local_score, targets)


class SeedBase(nn.Module):
    def __init__(self, attention_heads, embedding_dim, loss_k=1.0):
        assert attention_heads > 0
        assert embedding_dim > 0
        assert embedding_dim % attention_heads == 0
        super().__init__()
        self.attention_heads = attention_heads
        self.embedding_dim = embedding_dim
        self.head_dim = embedding_dim // attention_heads
        self._loss_component = 0
        self.loss_k = loss_k

    def get_loss_component(self):
        result = self._loss_component * self.loss_k
        self._loss_component = None
        return result


class SeedLinear(SeedBase):
    def __init__(self, attention_heads, embedding_dim, loss_k=1.0):
        super().__init__(attention_heads, embedding_dim, loss_k)
        self.weights = nn.Parameter(torch.randn((self.attention_heads, self.head_dim, 1)))
        self.biases = nn.Parameter(torch.randn((self.attention_heads,)))

    def forward(self, embeddings_local, embeddings_global):
        batch_size, sequence_length, _ = embeddings_local.shape
        embeddings_local = embeddings_local.view((batch_size, sequence_length, self.attention_heads, -1))
        embeddings_global = embeddings_global.view((batch_size, sequence_length, self.attention_heads, -1))
        local_logits = torch.einsum("bshd,hda->bsha", embeddings_local, self.weights) + self.biases.view((1, 1, self.attention_heads, 1))
        local_score = torch.sigmoid(local_logits)   # the seed's F.sigmoid: the same function
        global_score = 1 - local_score
        embeddings_result = embeddings_local * local_score + embeddings_global * global_score
        self._loss_component = seed_local_score_loss(local_logits)
        return embeddings_result.view((batch_size, sequence_length, self.attention_heads * self.head_dim))


class SeedConstant(SeedBase):
    def __init__(self, attention_heads, embedding_dim, loss_k=1.0):
        super().__init__(attention_heads, embedding_dim, loss_k)
        self.bias = nn.Parameter(torch.randn((self.attention_heads)))

    def forward(self, embeddings_local, embeddings_global):
        batch_size, sequence_length, _ = embeddings_local.shape
        embeddings_local = embeddings_local.view((batch_size, sequence_length, self.attention_heads, -1))
        embeddings_global = embeddings_global.view((batch_size, sequence_length, self.attention_heads, -1))
        logits_local = self.bias.view((1, 1, self.attention_heads, 1))
        scores_local = torch.sigmoid(logits_local)
        scores_global = 1 - scores_local
        embeddings_result = embeddings_local * scores_local + embeddings_global * scores_global
        self._loss_component = seed_local_score_loss(logits_local)
        return embeddings_result.view((batch_size, sequence_length, self.attention_heads * self.head_dim))


SEED_OF = {ContextChoiceLinear: SeedLinear, ContextChoiceConstant: SeedConstant}


def pair(batch, seq_len, dim, dtype=torch.float32, requires_grad=False):
    a = torch.randn(batch, seq_len, dim, dtype=dtype, requires_grad=requires_grad)
    b = torch.randn(batch, seq_len, dim, dtype=dtype, requires_grad=requires_grad)
    return a, b


# ------------------------------------------------------------------ parity with the seed
@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 6), head_dim=st.integers(1, 9), batch=st.integers(1, 3), seq_len=st.integers(1, 9),
       loss_k=st.floats(0.0, 3.0), seed=st.integers(0, 2**31 - 1), cls=st.sampled_from(CLASSES))
def test_parity_with_seed_random_parameters(heads, head_dim, batch, seq_len, loss_k, seed, cls):
    torch.manual_seed(seed)
    theirs = SEED_OF[cls](heads, heads * head_dim, loss_k)
    torch.manual_seed(seed)
    ours = cls(heads, heads * head_dim, loss_k)
    # same initial draw, same keys and shapes
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)
    for p in theirs.parameters():
        nn.init.normal_(p, std=3.0)
    ours.load_state_dict(theirs.state_dict())
    x_local, x_global = pair(batch, seq_len, heads * head_dim)
    out, ref = ours(x_local, x_global), theirs(x_local, x_global)
    assert torch.equal(out, ref)
    assert torch.equal(ours.get_loss_component(), theirs.get_loss_component())


@pytest.mark.parametrize("cls", CLASSES)
def test_gradients_match_seed(cls):
    torch.manual_seed(3)
    theirs = SEED_OF[cls](4, 32)
    ours = cls(4, 32)
    ours.load_state_dict(theirs.state_dict())
    x_ours = [t.clone().requires_grad_() for t in pair(2, 5, 32)]
    x_theirs = [t.detach().clone().requires_grad_() for t in x_ours]
    w = torch.randn(2, 5, 32)
    ((ours(*x_ours) * w).sum() + ours.get_loss_component()).backward()
    ((theirs(*x_theirs) * w).sum() + theirs.get_loss_component()).backward()
    for a, b in zip(x_ours + list(ours.parameters()), x_theirs + list(theirs.parameters())):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_local_score_loss_matches_seed_and_softplus():
    z = torch.randn(7, 3, 5, 2).permute(2, 0, 3, 1)       # non-contiguous logits
    assert torch.equal(local_score_loss(z), seed_local_score_loss(z))
    torch.testing.assert_close(local_score_loss(z), F.softplus(z).mean())
    assert LOCAL_LOSS_K == 1.0


# ------------------------------------------------------------------ the einsum is a loop of per-head nn.Linear
@settings(max_examples=20, deadline=None)
@given(heads=st.integers(1, 8), head_dim=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_einsum_equals_per_head_linear_loop(heads, head_dim, seed):
    torch.manual_seed(seed)
    gate = ContextChoiceLinear(heads, heads * head_dim).eval()
    x_local, x_global = pair(2, 6, heads * head_dim)
    lin = []
    for h in range(heads):
        layer = nn.Linear(head_dim, 1)
        layer.load_state_dict({"weight": gate.weights[h].T, "bias": gate.biases[[h]]})
        lin.append(layer)
    xl, xg = x_local.view(2, 6, heads, head_dim), x_global.view(2, 6, heads, head_dim)
    with torch.no_grad():
        parts = []
        for h, layer in enumerate(lin):
            g = torch.sigmoid(layer(xl[:, :, h]))
            parts.append(xl[:, :, h] * g + xg[:, :, h] * (1 - g))
        naive = torch.cat(parts, dim=-1)
        out = gate(x_local, x_global)
        score = gate.local_score(x_local)
    assert (out - naive).abs().max() < 1e-5
    torch.testing.assert_close(score, torch.sigmoid(torch.stack([layer(xl[:, :, h]) for h, layer in enumerate(lin)], 2)[..., 0]).detach())


# ------------------------------------------------------------------ layouts
def _layouts():
    return {
        "transposed": torch.randn(4, 3, 32).transpose(0, 1),
        "sliced": torch.randn(3, 4, 64)[..., 1::2],
        "permuted": torch.randn(32, 4, 3).permute(2, 1, 0),
        "expanded_batch": torch.randn(1, 4, 32).expand(3, 4, 32),
        "expanded_embedding": torch.randn(3, 4, 1).expand(3, 4, 32),
    }


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name", list(_layouts()))
def test_non_contiguous_inputs(cls, name):
    torch.manual_seed(0)
    gate = cls(4, 32)
    x = _layouts()[name]
    assert not x.is_contiguous()
    other = torch.randn(3, 4, 32)
    with torch.no_grad():
        for a, b in ((x, other), (other, x), (x, x)):
            out = gate(a, b)
            loss = gate.get_loss_component()
            assert torch.equal(out, gate(a.contiguous(), b.contiguous()))
            assert torch.equal(loss, gate.get_loss_component())
            assert out.shape == (3, 4, 32)


def test_seed_view_fails_on_expanded_input_ours_does_not():
    torch.manual_seed(0)
    theirs = SeedLinear(4, 32)
    ours = ContextChoiceLinear(4, 32)
    ours.load_state_dict(theirs.state_dict())
    x, g = torch.randn(3, 4, 1).expand(3, 4, 32), torch.randn(3, 4, 32)
    with pytest.raises(RuntimeError, match="view"):
        theirs(x, g)
    assert torch.equal(ours(x, g), theirs(x.contiguous(), g))


def test_non_contiguous_gradients():
    torch.manual_seed(0)
    gate = ContextChoiceLinear(4, 32)
    base = torch.randn(4, 3, 32, requires_grad=True)
    out = gate(base.transpose(0, 1), torch.randn(3, 4, 32))
    out.sum().backward()
    assert base.grad is not None and base.grad.shape == base.shape


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("args, exc, match", [
    ((3, 32), ValueError, r"embedding_dim \(32\) must be divisible by attention_heads \(3\)"),
    ((0, 32), ValueError, "attention_heads must be > 0, got 0"),
    ((-2, 32), ValueError, "attention_heads must be > 0, got -2"),
    ((4, 0), ValueError, "embedding_dim must be > 0, got 0"),
    ((4.0, 32), TypeError, "attention_heads must be an int"),
    ((4, "32"), TypeError, "embedding_dim must be an int"),
    ((True, 32), TypeError, "attention_heads must be an int"),
    ((4, 32, float("inf")), ValueError, "loss_k must be a finite number"),
    ((4, 32, "1"), ValueError, "loss_k must be a finite number"),
])
@pytest.mark.parametrize("cls", CLASSES)
def test_constructor_errors(cls, args, exc, match):
    with pytest.raises(exc, match=match):
        cls(*args)


@pytest.mark.parametrize("cls", CLASSES)
def test_forward_errors_name_the_argument(cls):
    gate = cls(4, 32)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"same shape, got \(2, 5, 32\) and \(2, 6, 32\)"):
        gate(x, torch.randn(2, 6, 32))
    with pytest.raises(ValueError, match=r"same shape, got \(2, 5, 32\) and \(1, 5, 32\)"):
        gate(x, torch.randn(1, 5, 32))          # no silent broadcasting
    with pytest.raises(ValueError, match=r"embeddings_local must be \[batch, seq_len, embedding_dim=32\], got shape \(2, 5, 16\)"):
        gate(torch.randn(2, 5, 16), torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"embeddings_global must be \[batch, seq_len, embedding_dim=32\], got shape \(5, 32\)"):
        gate(x, torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"embeddings_local must be \[batch.*got shape \(1, 2, 5, 32\)"):
        gate(x[None], x[None])
    with pytest.raises(ValueError, match="same dtype, got torch.float32 and torch.bfloat16"):
        gate(x, x.bfloat16())
    with pytest.raises(ValueError, match="embeddings_local must be a floating-point tensor, got dtype torch.int64"):
        gate(x.long(), x.long())
    with pytest.raises(TypeError, match="embeddings_global must be a torch.Tensor"):
        gate(x, x.numpy())
    with pytest.raises(ValueError, match="embeddings_local must be"):
        gate.local_score(torch.randn(2, 5, 31))


def test_device_mismatch_is_refused():
    gate = ContextChoiceLinear(4, 32).to("meta")
    with pytest.raises(ValueError, match=r"parameter weights is on meta but the embeddings are on cpu"):
        gate(torch.randn(1, 2, 32), torch.randn(1, 2, 32))
    gate = ContextChoiceLinear(4, 32)
    with pytest.raises(ValueError, match="same device, got cpu and meta"):
        gate(torch.randn(1, 2, 32), torch.empty(1, 2, 32, device="meta"))


def test_base_class_needs_local_logits():
    gate = BaseContextChoice(4, 32)
    with pytest.raises(NotImplementedError, match="local_logits"):
        gate(torch.randn(1, 2, 32), torch.randn(1, 2, 32))


def test_seed_style_subclass_with_own_forward_still_works():
    class Mean(BaseContextChoice):
        def forward(self, a, b):
            self._loss_component = torch.tensor(2.0)
            return (a + b) / 2
    gate = Mean(2, 8, loss_k=0.25)
    x = torch.ones(1, 1, 8)
    assert torch.equal(gate(x, 3 * x), 2 * x)
    assert gate.get_loss_component() == 0.5


# ------------------------------------------------------------------ get_loss_component
@pytest.mark.parametrize("cls", CLASSES)
def test_loss_component_semantics(cls):
    gate = cls(4, 32, loss_k=0.5)
    zero = gate.get_loss_component()
    assert isinstance(zero, torch.Tensor) and zero.shape == () and zero.item() == 0.0
    with pytest.raises(RuntimeError, match="no forward since the last call"):
        gate.get_loss_component(strict=True)
    x_local, x_global = pair(2, 3, 32)
    gate(x_local, x_global)
    logits = gate.local_logits(x_local.unflatten(-1, (4, 8)))
    expected = 0.5 * F.softplus(logits).mean()
    torch.testing.assert_close(gate.get_loss_component(strict=True), expected)
    assert gate.get_loss_component().item() == 0.0          # taken once
    with pytest.raises(RuntimeError):
        gate.get_loss_component(strict=True)
    gate(x_local, x_global); gate(x_global, x_local)          # the last forward wins, as in the seed
    logits = gate.local_logits(x_global.unflatten(-1, (4, 8)))
    torch.testing.assert_close(gate.get_loss_component(), 0.5 * F.softplus(logits).mean())


def test_loss_pushes_gate_towards_global():
    gate = ContextChoiceConstant(4, 32)
    gate(*pair(1, 2, 32))
    gate.get_loss_component().backward()
    # d/db of mean softplus(b) = sigmoid(b) / heads > 0: gradient descent lowers g
    torch.testing.assert_close(gate.bias.grad, torch.sigmoid(gate.bias.detach()) / 4)
    assert (gate.bias.grad > 0).all()


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_forward_backward(cls, dtype):
    torch.manual_seed(0)
    gate = cls(4, 32)
    x_local, x_global = pair(2, 7, 32)
    ref = gate(x_local, x_global)
    ref_loss = gate.get_loss_component()
    xl = x_local.to(dtype).requires_grad_()
    out = gate(xl, x_global.to(dtype))
    loss = gate.get_loss_component()
    assert out.dtype == dtype and loss.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    torch.testing.assert_close(loss, ref_loss, rtol=0.02, atol=0.02)
    (out.float().sum() + loss).backward()
    assert xl.grad.dtype == dtype
    for p in gate.parameters():
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32


@pytest.mark.parametrize("cls", CLASSES)
def test_module_in_bf16(cls):
    gate = cls(4, 32).bfloat16()
    out = gate(*pair(2, 3, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and gate.get_loss_component().dtype == torch.float32


@pytest.mark.parametrize("cls", CLASSES)
def test_gradcheck_float64(cls):
    torch.manual_seed(0)
    gate = cls(2, 6).double()
    x_local, x_global = pair(2, 3, 6, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in gate.parameters()]
    names = [n for n, _ in gate.named_parameters()]

    def f(xl, xg, *ps):
        out = torch.func.functional_call(gate, dict(zip(names, ps)), (xl, xg))
        return out, gate.get_loss_component(strict=True)

    assert torch.autograd.gradcheck(f, (x_local, x_global, *params))
    assert torch.autograd.gradgradcheck(f, (x_local, x_global, *params))


# ------------------------------------------------------------------ torch.compile
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("cls", CLASSES)
def test_compile_matches_eager(cls, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    gate = cls(4, 32)
    compiled = torch.compile(gate, backend=backend, fullgraph=True)
    for shape in [(2, 5), (3, 7)]:
        x_local, x_global = pair(*shape, 32)
        out = compiled(x_local, x_global)
        loss = gate.get_loss_component(strict=True)      # the side effect survives compilation
        ref = gate(x_local, x_global)
        ref_loss = gate.get_loss_component(strict=True)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(loss, ref_loss)
        (out.sum() + loss).backward()


def test_compile_inductor():
    torch._dynamo.reset()
    torch.manual_seed(0)
    gate = ContextChoiceLinear(4, 32)
    compiled = torch.compile(gate, backend="inductor")
    x_local, x_global = pair(2, 5, 32, requires_grad=True)
    out = compiled(x_local, x_global)
    loss = gate.get_loss_component(strict=True)
    (out.sum() + loss).backward()
    ref = gate(x_local, x_global)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, gate.get_loss_component())


# ------------------------------------------------------------------ state_dict, deepcopy, pickle
@pytest.mark.parametrize("cls", CLASSES)
def test_state_dict_deepcopy_pickle_with_pending_loss(cls):
    torch.manual_seed(0)
    gate = cls(4, 32, loss_k=0.3)
    x_local, x_global = pair(2, 3, 32)
    gate(x_local, x_global)                                   # a loss with a graph is pending
    for twin in (copy.deepcopy(gate), pickle.loads(pickle.dumps(gate))):
        assert twin.loss_k == 0.3 and twin.head_dim == 8
        assert twin.get_loss_component().item() == 0.0        # the copy has nothing pending
        with torch.no_grad():
            assert torch.equal(twin(x_local, x_global), gate(x_local, x_global))
    assert gate._loss_component is not None                    # the original keeps its own
    buf = io.BytesIO()
    torch.save(gate.state_dict(), buf)
    buf.seek(0)
    fresh = cls(4, 32)
    fresh.load_state_dict(torch.load(buf))
    with torch.no_grad():
        assert torch.equal(fresh(x_local, x_global), gate(x_local, x_global))


@pytest.mark.parametrize("cls", CLASSES)
def test_seed_checkpoint_loads(cls):
    theirs = SEED_OF[cls](8, 64)
    ours = cls(8, 64)
    ours.load_state_dict(theirs.state_dict())               # strict: same keys and shapes
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


# ------------------------------------------------------------------ training loops
@pytest.mark.parametrize("cls", CLASSES)
def test_repeated_training_steps(cls):
    torch.manual_seed(0)
    gate = cls(4, 32, loss_k=0.0)
    opt = torch.optim.Adam(gate.parameters(), lr=0.1)
    x_local, x_global = pair(8, 4, 32)
    losses = []
    for _ in range(30):
        loss = F.mse_loss(gate(x_local, x_global), x_local) + gate.get_loss_component(strict=True)
        opt.zero_grad()
        loss.backward()                                        # a fresh graph every step: no "backward twice"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert gate.local_score(x_local).mean() > 0.5              # it learned to pick the local context


def test_aux_loss_equilibrium_constant_gate():
    """Target = local, unit-normal inputs: the gate stops at g* = 1 - sqrt(k / (2 m)), m = E(xg - xl)^2 = 2."""
    torch.manual_seed(0)
    for k, g_star in ((1.0, 0.5), (0.5, 1 - math.sqrt(0.125))):
        gate = ContextChoiceConstant(2, 128, loss_k=k)
        x_local, x_global = pair(8, 16, 128)
        m = (x_global - x_local).pow(2).unflatten(-1, (2, 64)).mean((0, 1, 3))
        opt = torch.optim.Adam(gate.parameters(), lr=0.1)
        for _ in range(150):
            loss = F.mse_loss(gate(x_local, x_global), x_local) + gate.get_loss_component()
            opt.zero_grad(); loss.backward(); opt.step()
        expected = 1 - torch.sqrt(k / (2 * m))
        torch.testing.assert_close(torch.sigmoid(gate.bias.detach()), expected, rtol=0, atol=0.01)
        assert abs(expected.mean().item() - g_star) < 0.02


def test_meliad_direction():
    """meliad: out = attn * (1 - s) + ext * s, s = sigmoid(external_memory_bias); relpos: bias = -external_memory_bias."""
    torch.manual_seed(0)
    heads, d = 4, 8
    attn, ext = torch.randn(2, 5, heads, d), torch.randn(2, 5, heads, d)
    ebias = torch.randn(heads)
    s = torch.sigmoid(ebias).view(1, 1, heads, 1)
    meliad = attn * (1 - s) + ext * s
    gate = ContextChoiceConstant(heads, heads * d, loss_k=0.0)
    with torch.no_grad():
        gate.bias.copy_(-ebias)
        torch.testing.assert_close(gate(attn.flatten(-2), ext.flatten(-2)), meliad.flatten(-2))


# ------------------------------------------------------------------ more properties
@settings(max_examples=25, deadline=None)
@given(perm=st.permutations([0, 1, 2]), step=st.integers(1, 3), cls=st.sampled_from(CLASSES), seed=st.integers(0, 10_000))
def test_any_strided_layout_matches_contiguous(perm, step, cls, seed):
    """Inputs built as a permuted, strided view of a bigger tensor give exactly the contiguous result."""
    torch.manual_seed(seed)
    gate = cls(2, 8)
    shape = (3, 4, 8)
    # storage laid out in the order `perm`, last storage dim strided by `step`
    storage_shape = [shape[i] for i in perm]
    storage_shape[-1] *= step
    base = torch.randn(storage_shape)[..., ::step]
    inverse = [perm.index(i) for i in range(3)]
    x = base.permute(*inverse)
    assert x.shape == shape
    y = torch.randn(shape)
    with torch.no_grad():
        assert torch.equal(gate(x, y), gate(x.contiguous(), y))
        assert torch.equal(gate(y, x), gate(y, x.contiguous()))


@pytest.mark.parametrize("cls", CLASSES)
def test_local_score_leaves_pending_loss_alone(cls):
    gate = cls(4, 32)
    x_local, x_global = pair(2, 3, 32)
    gate(x_local, x_global)
    pending = gate._loss_component
    g = gate.local_score(x_global)
    assert g.shape == (2, 3, 4) and gate._loss_component is pending
    assert ((g > 0) & (g < 1)).all()


@pytest.mark.parametrize("cls", CLASSES)
def test_autocast_bf16(cls):
    torch.manual_seed(0)
    gate = cls(4, 32)
    x_local, x_global = pair(2, 3, 32)
    ref = gate(x_local, x_global)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gate(x_local, x_global)
        loss = gate.get_loss_component(strict=True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_mixing_is_a_convex_combination_per_head():
    """Each output feature lies between its local and global inputs (g in (0, 1)), and equals local where they agree."""
    torch.manual_seed(0)
    gate = ContextChoiceLinear(4, 32)
    x_local, x_global = pair(5, 6, 32)
    with torch.no_grad():
        out = gate(x_local, x_global)
        torch.testing.assert_close(gate(x_local, x_local), x_local)   # not bit-exact: x*g + x*(1-g) rounds
    lo, hi = torch.minimum(x_local, x_global), torch.maximum(x_local, x_global)
    assert ((out >= lo - 1e-6) & (out <= hi + 1e-6)).all()


@pytest.mark.parametrize("cls", CLASSES)
def test_zero_length_sequence(cls):
    gate = cls(4, 32)
    x_local, x_global = pair(3, 0, 32, requires_grad=True)
    out = gate(x_local, x_global)
    loss = gate.get_loss_component(strict=True)
    assert out.shape == (3, 0, 32) and torch.isfinite(loss)
    (out.sum() + loss).backward()


def test_local_score_loss_bad_inputs():
    assert local_score_loss(torch.empty(0)).item() == 0.0
    assert seed_local_score_loss(torch.empty(0)).isnan()          # the seed's value, the one change
    with pytest.raises(TypeError, match="local_score must be a torch.Tensor"):
        local_score_loss([0.0, 1.0])
    with pytest.raises(ValueError, match="local_score must be floating point"):
        local_score_loss(torch.zeros(3, dtype=torch.long))

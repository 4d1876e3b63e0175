"Tests of `relpos.shift.shift_right` that would clutter the chapter."
import pickle
import pytest
import torch
from hypothesis import given, settings, strategies as st

from relpos.shift import shift_right


def reference_shift(x):
    "Index-by-index definition on the exact region: out[i, j] = x[i, j - i] for j >= i, out[i, i-1] = 0."
    n_q, n_k = x.shape[:2]
    out = {}
    for i in range(n_q):
        for j in range(i, n_k): out[i, j] = x[i, j - i]
        if 1 <= i <= n_k: out[i, i - 1] = torch.zeros_like(x[0, 0])
    return out


def test_seed_example():
    a = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert torch.equal(shift_right(a), torch.tensor([[1, 2, 3], [0, 4, 5], [6, 0, 7]]))


@settings(max_examples=40, deadline=None)
@given(n_q=st.integers(0, 7), n_k=st.integers(0, 9), rest=st.lists(st.integers(1, 3), max_size=2),
       transpose=st.booleans())
def test_exact_region_matches_definition(n_q, n_k, rest, transpose):
    x = torch.randn(n_k, n_q, *rest).transpose(0, 1) if transpose else torch.randn(n_q, n_k, *rest)
    y = shift_right(x)
    assert y.shape == x.shape
    for (i, j), v in reference_shift(x).items():
        assert torch.equal(y[i, j], v), (i, j)


def test_relative_use_kept_columns_are_exact():
    # B'[i, k] holds distance k - n_k; after the shift the last n_k columns are key - query position
    for n_q, n_k in [(1, 1), (4, 4), (3, 8), (5, 6)]:
        b = (torch.arange(n_k + n_q) - n_k)[None, :].repeat(n_q, 1)
        kept = shift_right(b)[:, -n_k:]
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        assert torch.equal(kept, j - (i + n_k - n_q))


def test_gradcheck_float64():
    x = torch.randn(4, 6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(shift_right, (x,))
    assert torch.autograd.gradgradcheck(shift_right, (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int64])
def test_dtypes_are_exact(dtype):
    x = torch.randn(5, 7, 3).to(dtype)
    y = shift_right(x)
    assert y.dtype == dtype
    assert torch.equal(y, shift_right(x.double()).to(dtype))


def test_compile_matches_eager():
    x = torch.randn(6, 9, 2, 3)
    compiled = torch.compile(shift_right, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), shift_right(x))
    # dynamic shapes: a second size must not break it
    x2 = torch.randn(3, 11, 2, 3)
    assert torch.equal(compiled(x2), shift_right(x2))


def test_compile_inductor():
    x = torch.randn(6, 9, 4)
    assert torch.equal(torch.compile(shift_right, fullgraph=True)(x), shift_right(x))


@pytest.mark.parametrize("bad, exc, match", [
    (torch.arange(3), ValueError, "x must have at least 2 dims"),
    (torch.tensor(1.0), ValueError, "x must have at least 2 dims"),
    ([[1, 2], [3, 4]], TypeError, "x must be a torch.Tensor"),
    (None, TypeError, "x must be a torch.Tensor"),
])
def test_bad_inputs(bad, exc, match):
    with pytest.raises(exc, match=match):
        shift_right(bad)


def test_expanded_and_sliced_inputs():
    base = torch.randn(1, 8, 3)
    x = base.expand(5, 8, 3)              # stride 0 along dim 0
    assert torch.equal(shift_right(x), shift_right(x.contiguous()))
    y = torch.randn(6, 12, 3)[1:, ::2]      # sliced with a step
    assert torch.equal(shift_right(y), shift_right(y.contiguous()))


def test_does_not_alias_input():
    x = torch.randn(3, 4)
    y = shift_right(x)
    y.zero_()
    assert x.abs().sum() > 0


def test_picklable_function():
    assert pickle.loads(pickle.dumps(shift_right)) is shift_right

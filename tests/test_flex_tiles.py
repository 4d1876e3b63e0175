"""FlexAttention's tiles: where torch's own do not fit a GPU's shared memory (torch 2.11 on an H200, head size 64, bf16:
nbs/data/flex_options_cuda.json), `flex_bias_attention` compiles once more with `relpos.bias.FLEX_SMALL_TILES`, says so
once, and keeps that choice for the device, dtype and head size. Checked on the CPU with the compile's failure imitated."""
from unittest import mock

import pytest
import torch

import relpos.bias as B

OUT_OF_SHARED_MEMORY = ("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
                        "Required: 245760 Hardware limit:232448 Reducing block sizes or `num_stages` may help.")


class SmallGPU:
    "Stands in for the compiled FlexAttention of a GPU whose shared memory torch's default tiles overflow: eager FlexAttention when tiles are given."
    def __init__(self, error=OUT_OF_SHARED_MEMORY): self.error, self.options = error, []
    def __call__(self, q, k, v, kernel_options=None, **kw):
        self.options.append(kernel_options)
        if kernel_options is None: raise RuntimeError(self.error)
        return B._flex_attention(q, k, v, **kw)


def dense(q, k, v, table):
    "The readable path, causal."
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) * 0.25 + B.toeplitz(table, n, n)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float('-inf'))
    return s.softmax(-1) @ v


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 24, 16, dtype=torch.float64) for _ in range(3))
    return q, k, v, torch.randn(3, 47, dtype=torch.float64)


@pytest.mark.skipif(not B.flex_available(), reason="no FlexAttention in this torch")
def test_tiles_that_do_not_fit_are_replaced_once_and_remembered(inputs):
    q, k, v, table = inputs
    fake = SmallGPU()
    with mock.patch.dict(B._flex_compiled, {'cpu': fake}), mock.patch.dict(B._flex_tiles, clear=True):
        with pytest.warns(UserWarning, match='FLEX_SMALL_TILES'):
            got = B.flex_bias_attention(q, k, v, B.toeplitz_score_mod(table, 24), 0.25, causal=True)
        assert fake.options == [None, B.FLEX_SMALL_TILES]
        assert B._flex_tiles == {('cpu', torch.float64, 16): B.FLEX_SMALL_TILES}
        torch.testing.assert_close(got, dense(q, k, v, table), rtol=1e-12, atol=1e-12)
        B.flex_bias_attention(q, k, v, B.toeplitz_score_mod(table, 24), 0.25, causal=True)   # remembered: no failing try
        assert fake.options == [None, B.FLEX_SMALL_TILES, B.FLEX_SMALL_TILES]
        B.flex_bias_attention(q.float(), k.float(), v.float(), B.toeplitz_score_mod(table.float(), 24), 0.25, causal=True)
        assert fake.options[-2:] == [None, B.FLEX_SMALL_TILES]   # another dtype: its own try


@pytest.mark.skipif(not B.flex_available(), reason="no FlexAttention in this torch")
def test_other_failures_and_given_options_are_not_retried(inputs):
    q, k, v, table = inputs
    fake = SmallGPU(error="LoweringException: NotImplementedError: Using multiple indexing operations")
    with mock.patch.dict(B._flex_compiled, {'cpu': fake}), mock.patch.dict(B._flex_tiles, clear=True):
        with pytest.raises(RuntimeError, match='multiple indexing'):
            B.flex_bias_attention(q, k, v, B.toeplitz_score_mod(table, 24), 0.25, causal=True)
        assert fake.options == [None] and B._flex_tiles == {}
        mine = {'BLOCK_M': 32, 'BLOCK_N': 32}
        B.flex_bias_attention(q, k, v, B.toeplitz_score_mod(table, 24), 0.25, causal=True, kernel_options=mine)
        assert fake.options == [None, mine] and B._flex_tiles == {}   # the caller's options, as given, nothing remembered


def test_the_small_tiles_are_the_ones_measured_on_a_gpu():
    "The docs say `FLEX_SMALL_TILES` compiled and ran where torch's tiles did not (3b, the GPU guide): the stored probe must hold that row, in bf16, measured, beside a failed row of torch's own tiles."
    from relpos.bench import stored_cuda
    rows = [r for r in stored_cuda('flex_options')['rows'] if r['dtype'] == 'bfloat16']
    assert any(r['options'] == B.FLEX_SMALL_TILES and 'ms' in r and 'error' not in r for r in rows)
    assert any(r['options'] is None and 'out of resource' in r['error'] for r in rows)

"""The fast paths on a CUDA device: the same numbers as on CPU, and a number of kernels per call that does not grow with
batch x heads (counted as dispatched ops). Skipped where torch sees no GPU (CI never has one); run them on a GPU machine with `pytest tests/test_cuda.py`."""
import copy

import pytest
import torch
from mha_module_checks import OpCounter

from relpos.models import POSITION_BUILDERS, causal_mask
from relpos.relative_mha import relative_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
POSITIONS = [p for p in POSITION_BUILDERS if p != 'absolute']   # 'absolute' is 'none' at the layer


@pytest.fixture(autouse=True)
def many_compiled_score_mods(monkeypatch):
    "Each worker compiles FlexAttention for several methods' score_mods, in training and inference: past dynamo's default of 8 entries it would run the eager reference, and the FlexAttention tests would not test the compiled kernel."
    monkeypatch.setattr(torch._dynamo.config, 'recompile_limit', 256)


def layer(position, d_model, heads, n, device, dtype):
    torch.manual_seed(0)
    attn = POSITION_BUILDERS[position](d_model, heads, 0.0, n, 0).to(device, dtype)
    with torch.no_grad():   # position parameters away from their (often zero) initial values
        for p in attn.parameters(): p.add_(0.1 * torch.randn_like(p))
    return attn


def step(attn, x, mask):
    "Output and the gradients of inputs and parameters of `sum(out * w)`."
    x = x.detach().requires_grad_()
    attn.zero_grad()
    out = attn(x, x, x, mask)
    w = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    (out * w).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in attn.parameters()]


@pytest.mark.parametrize('causal', [True, False])
@pytest.mark.parametrize('position', POSITIONS)
def test_cuda_equals_cpu_float64(position, causal):
    "Every layer on the GPU in float64 gives the CPU's outputs and gradients (the CPU paths are tested against the readable ones)."
    n = 200
    cpu = layer(position, 64, 4, n, 'cpu', torch.float64)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(2, n, 64, dtype=torch.float64)
    mask = causal_mask(n, n, 'cpu') if causal else None
    want = step(cpu, x, mask)
    got = step(gpu, x.cuda(), None if mask is None else mask.cuda())
    for a, b in zip(got, want): torch.testing.assert_close(a.cpu(), b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize('position', POSITIONS)
def test_cuda_float32_close_to_float64(position):
    "float32 on the GPU (fused kernels, no TF32) stays within float32 error of the float64 result, causal mask, n = 1024."
    n = 1024
    ref = layer(position, 64, 4, n, 'cuda', torch.float64)
    f32 = copy.deepcopy(ref).float()
    x = torch.randn(2, n, 64, dtype=torch.float64, device='cuda')
    mask = causal_mask(n, n, 'cuda')
    want, got = step(ref, x, mask), step(f32, x.float(), mask)
    names = ['out', 'x.grad'] + [k for k, p in ref.named_parameters()]
    for name, a, b in zip(names, got, want):   # (norms: the key bias's gradient is 0 up to rounding, as softmax ignores it)
        assert (a.double() - b).norm() <= 1e-4 * b.norm() + 1e-4, (position, name, (a.double() - b).norm().item(), b.norm().item())


def ops_per_call(fn):
    "The number of ops one call of `fn` (forward and backward) dispatches."
    fn()   # lazy initialisation out of the count
    with OpCounter() as count: fn()
    return count.n


@pytest.mark.parametrize('position', POSITIONS)
def test_ops_per_call_do_not_grow_with_batch_and_heads(position):
    "A layer's call dispatches as many ops for batch 4 x 8 heads as for batch 2 x 2 heads: no Python loop over them."
    counts = []
    for batch, heads in [(2, 2), (4, 8)]:
        attn = layer(position, 16 * heads, heads, 128, 'cuda', torch.float32)
        x = torch.randn(batch, 128, 16 * heads, device='cuda', requires_grad=True)
        mask = causal_mask(128, 128, 'cuda')
        counts.append(ops_per_call(lambda: attn(x, x, x, mask).sum().backward()))
    assert counts[0] == counts[1], (position, counts)


def test_xl_kernel_ops_do_not_grow_with_batch_and_heads():
    "relpos.relative_attention (the XL kernel) on CUDA: as many ops for 2 x 2 as for 4 x 8 (blocks of 64 rows)."
    counts = []
    for b, h in [(2, 2), (4, 8)]:
        g = torch.Generator(device='cuda').manual_seed(0)
        qu, qp, k, v = (torch.randn(b, h, 256, 32, device='cuda', generator=g, requires_grad=True) for _ in range(4))
        R = torch.randn(h, 512, 32, device='cuda', generator=g, requires_grad=True)
        S = torch.randn(h, 512, device='cuda', generator=g, requires_grad=True)
        mask = torch.ones(256, 256, dtype=torch.bool, device='cuda').tril()[None, None]
        counts.append(ops_per_call(lambda: relative_attention(qu, qp, k, v, R, S, mask=mask, chunk_size=64).sum().backward()))
    assert counts[0] == counts[1], counts


# ---------------------------------------------------------------- the bias methods' FlexAttention route
import relpos.bias
from unittest import mock
from relpos.alibi import ALiBiMultiHeadAttention
from relpos.fourier import FourierMultiHeadAttention
from relpos.t5 import T5MultiHeadAttention
from relpos.fire import FireMultiHeadAttention

FLEX_LAYERS = {
    'alibi': lambda: ALiBiMultiHeadAttention(4, 64, dropout_prob=0.0),
    'alibi_bidirectional': lambda: ALiBiMultiHeadAttention(4, 64, dropout_prob=0.0, bidirectional=True),
    't5': lambda: T5MultiHeadAttention(4, 64, dropout_prob=0.0),
    'fourier': lambda: FourierMultiHeadAttention(4, 64, dropout_prob=0.0, max_number_of_keys=256, position_vector_size=16),
    'fire': lambda: FireMultiHeadAttention(4, 64, dropout_prob=0.0, init_L=100.5),   # queries on both sides of L
}


def _flex_masks(kind, nq, nk):
    if kind == 'none': return None
    if kind == 'causal': return torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None]   # with memory when nk > nq
    pad = torch.ones(1, nk, 2, dtype=torch.bool); pad[:, -37:, 1] = False                        # padding, causal too
    return pad & torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)[..., None]


@pytest.mark.skipif(not relpos.bias.flex_available(), reason="no FlexAttention in this torch")
@pytest.mark.parametrize('kind,nq,nk', [('causal', 300, 300), ('causal', 300, 364), ('padding', 300, 300)])
@pytest.mark.parametrize('name', list(FLEX_LAYERS))
def test_cuda_flex_route(name, kind, nq, nk):
    "On CUDA in float32 the bias layers run FlexAttention (score_mod on the distance table, a BlockMask), and give the float64 CPU readable path's output and gradients, the position parameters' included."
    torch.manual_seed(0)
    ref = FLEX_LAYERS[name]().double()
    with torch.no_grad():
        for p in ref.parameters(): p.add_(0.1 * torch.randn_like(p))
    gpu = copy.deepcopy(ref).float().cuda()
    x, kv = torch.randn(nq, 2, 64, dtype=torch.float64), torch.randn(nk, 2, 64, dtype=torch.float64)
    mask = _flex_masks(kind, nq, nk)

    def run(layer, x, kv, mask, need_weights):
        x, kv = x.clone().requires_grad_(), kv.clone().requires_grad_()
        layer.zero_grad()
        out = layer(query=x, key=kv, value=kv, mask=mask, need_weights=need_weights)
        w = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
        (out * w).sum().backward()
        return [out.detach(), x.grad, kv.grad] + [p.grad for p in layer.parameters() if p.grad is not None]

    want = run(ref, x, kv, mask, True)
    with mock.patch.object(relpos.bias, 'flex_bias_attention', wraps=relpos.bias.flex_bias_attention) as spy:
        got = run(gpu, x.float().cuda(), kv.float().cuda(), None if mask is None else mask.cuda(), False)
    assert spy.call_count == 1
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a.double().cpu() - b).norm() <= 1e-4 * b.norm() + 1e-4, (name, kind, (a.double().cpu() - b).norm().item(), b.norm().item())


# ---------------------------------------------------------------- mixed precision and the K/V cache on CUDA
from relpos.models import DecoderLM, POSITIONS as MODEL_POSITIONS
from relpos.cache import full_logits


def weighted_step(attn, x, mask):
    "Output, input gradient and the parameters' gradients (one flat vector) of `sum(out * w)`, w in [0.5, 1.5] (sums of w stay far from 0)."
    x = x.detach().requires_grad_()
    attn.zero_grad()
    out = attn(x, x, x, mask)
    w = torch.linspace(0.5, 1.5, out.numel(), device=out.device).view_as(out)
    (out.float() * w).sum().backward()
    grads = torch.cat([p.grad.flatten().float() for p in attn.parameters() if p.grad is not None])
    return dict(out=out.detach().float(), x_grad=x.grad.float(), param_grads=grads)


@pytest.mark.parametrize('position', POSITIONS)
def test_cuda_bf16_autocast_close_to_float32(position):
    "Under bf16 autocast (float32 parameters, as AMP training keeps them) every layer's output, input gradient and parameter gradients (together) stay within bfloat16 error of float32, the parameters' gradients stay float32, and nothing is NaN."
    n = 512
    ref = layer(position, 512, 8, n, 'cuda', torch.float32)   # head size 64, as in the benchmark
    x = torch.randn(2, n, 512, device='cuda')
    mask = causal_mask(n, n, 'cuda')
    want = weighted_step(ref, x, mask)
    with torch.autocast('cuda', dtype=torch.bfloat16):
        got = weighted_step(ref, x, mask)
    for name in want:
        a, b = got[name], want[name]
        assert torch.isfinite(a).all(), (position, name)
        assert (a - b).norm() <= 3e-2 * b.norm(), (position, name, (a - b).norm().item(), b.norm().item())
    assert all(p.grad.dtype == torch.float32 for p in ref.parameters() if p.grad is not None)


@pytest.mark.parametrize('position', ['none', 'rotary', 'alibi', 't5'])
def test_cuda_nan_query_row_gives_nan(position):
    "A NaN in one query (keys and values finite) comes out as NaN in that query's row on the GPU's fused kernels (never a silent 0), and the other rows stay finite."
    attn = layer(position, 128, 4, 64, 'cuda', torch.float32)
    x = torch.randn(2, 64, 128, device='cuda')
    q = x.clone()
    q[0, 10] = float('nan')
    with torch.no_grad(): out = attn(q, x, x, causal_mask(64, 64, 'cuda'))
    assert out[0, 10].isnan().all(), position
    assert torch.isfinite(out[1]).all() and torch.isfinite(out[0, :10]).all() and torch.isfinite(out[0, 11:]).all(), position


@pytest.mark.parametrize('position', MODEL_POSITIONS)
def test_cuda_cache_equals_full_model_float64(position):
    "`DecoderLM` on CUDA in float64: a prompt in one pass, then one token at a time through a `KVCache` (ring of 6 that wraps), gives the full model's logits with the same window."
    torch.manual_seed(0)
    lm = DecoderLM(64, d_model=32, heads=2, n_layers=2, position=position, max_len=64).double().cuda().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype).cuda())
    seq = torch.randint(0, 64, (3, 14), generator=g).cuda()
    with torch.no_grad():
        want = full_logits(lm, seq, max_cache_len=6)
        cache = lm.new_cache(3, 6)
        got = [lm(seq[:, :5], cache=cache)[0]] + [lm(seq[:, t:t + 1], cache=cache)[0] for t in range(5, 14)]
    assert (torch.cat(got, 1) - want).abs().max().item() <= 1e-9, position


@pytest.mark.skipif(not relpos.bias.flex_available(), reason="no FlexAttention in this torch")
@pytest.mark.parametrize('amp', [False, True])
@pytest.mark.parametrize('name', ['alibi', 't5', 'fourier', 'fire'])
def test_cuda_flex_head_64(name, amp):
    "The FlexAttention route at head size 64 (8 heads, d_model 512, n = 1024, causal), float32 and under bf16 autocast: it compiles (fits the GPU's shared memory) and gives the float64 CPU result within float32 / bfloat16 error."
    torch.manual_seed(0)
    make = {'alibi': lambda: ALiBiMultiHeadAttention(8, 512, dropout_prob=0.0),
            't5': lambda: T5MultiHeadAttention(8, 512, dropout_prob=0.0),
            'fourier': lambda: FourierMultiHeadAttention(8, 512, dropout_prob=0.0, max_number_of_keys=1024),
            'fire': lambda: FireMultiHeadAttention(8, 512, dropout_prob=0.0)}[name]
    ref = make().double()
    with torch.no_grad():
        for p in ref.parameters(): p.add_(0.05 * torch.randn_like(p))
    gpu = copy.deepcopy(ref).float().cuda()
    n = 1024
    x = torch.randn(n, 2, 512, dtype=torch.float64)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[..., None]

    def run(layer, x, mask):
        x = x.clone().requires_grad_()
        layer.zero_grad()
        with torch.autocast('cuda', dtype=torch.bfloat16, enabled=amp and x.is_cuda):
            out = layer(query=x, key=x, value=x, mask=mask)
        w = torch.linspace(0.5, 1.5, out.numel(), device=out.device, dtype=torch.float64).view_as(out)
        (out.double() * w).sum().backward()
        return dict(out=out.detach().double().cpu(), x_grad=x.grad.double().cpu(),
                    params=torch.cat([p.grad.flatten().double().cpu() for p in layer.parameters() if p.grad is not None]))

    want = run(ref, x, mask)
    with mock.patch.object(relpos.bias, 'flex_bias_attention', wraps=relpos.bias.flex_bias_attention) as spy:
        got = run(gpu, x.float().cuda(), mask.cuda())
    assert spy.call_count == 1
    tol = 3e-2 if amp else 1e-4
    for k in want:
        assert (got[k] - want[k]).norm() <= tol * want[k].norm() + tol, (name, amp, k, (got[k] - want[k]).norm().item(), want[k].norm().item())


def test_cuda_converted_llama_equals_transformers():
    "A Llama of transformers (random weights from a config) and `DecoderLM.from_transformers` of it on the GPU in float32 (no TF32): the same logits within float32 error and the same 16 greedy tokens."
    transformers = pytest.importorskip('transformers')
    import relpos.hf  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=256)
    hf = LlamaForCausalLM(cfg).eval()
    lm = DecoderLM.from_transformers(hf).eval()
    hf, lm = hf.cuda(), lm.cuda()
    prompt = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        want, got = hf(prompt).logits, lm(prompt)[0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max().item()
        ours = lm.generate(prompt, 16, temperature=0)
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_memorizing_study_runs_on_cuda_as_on_cpu():
    "`python -m bench.memorizing_study --device cuda`: a tiny kNN + XL run trains on the GPU, records where, and scores as on the CPU."
    import math
    import bench.memorizing_study as MS
    tiny = dict(steps=3, batch=2, seq=16, d_model=16, heads=2, n_layers=2, position='xl_paper', lr=1e-2, warmup=1,
                eval_docs=2, eval_bytes=64, label='knn 4x + xl', seed=0, knn_mult=4, knn_layer=1, top_k=4, mem_len=16)
    cpu, gpu = MS.train_run(**tiny), MS.train_run(**tiny, device='cuda')
    assert gpu['device'] == torch.cuda.get_device_name() and cpu['device'] == 'cpu (1 thread)'
    assert math.isfinite(gpu['bpb']) and abs(gpu['bpb'] - cpu['bpb']) < 1e-3 * cpu['bpb']   # float32 on both

"Checks every labml-layout attention module of relpos must pass (dtypes, modes, state, dropout): one copy, used by the test files of the modules."
import copy, io, pickle
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from relpos.mha import MultiHeadAttention


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(m, q, kv, mask=None, **kw):
    return m(query=q, key=kv, value=kv, mask=mask, **kw)


def check_bf16_module(m, need_weights):
    "The module in bfloat16 gives the float32 numbers to 3e-2, and bfloat16, finite gradients."
    x, mem = torch.randn(5, 2, 32), torch.randn(8, 2, 32)
    ref = run(m, x, mem)
    low = copy.deepcopy(m).bfloat16()
    out = run(low, x.bfloat16(), mem.bfloat16(), need_weights=need_weights)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) <= 3e-2
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.bfloat16 and p.grad.isfinite().all() for p in low.parameters())


def check_autocast_bf16(m):
    x = torch.randn(6, 2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(m, x, x)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), run(m, x, x)) <= 3e-2


def check_float64_matches_float32(m):
    x = torch.randn(6, 2, 32)
    torch.testing.assert_close(run(copy.deepcopy(m).double(), x.double(), x.double()).float(), run(m, x, x),
                               rtol=1e-5, atol=1e-6)


def check_no_state_from_the_mode_it_ran_in(m):
    "No cache: a call under inference_mode / no_grad / bf16 autocast leaves nothing that changes a later call."
    x = torch.randn(7, 2, 32)
    before = run(m, x, x)
    with torch.inference_mode(): run(m, x, x)
    with torch.no_grad(): run(m, x[:3], x)
    with torch.autocast("cpu", dtype=torch.bfloat16): run(m, x, x)
    after = run(m, x, x)
    assert torch.equal(before, after) and after.requires_grad
    assert list(m.buffers()) == []


def check_long_sequence_no_limit(m, n):
    x = torch.randn(n, 1, m.output.in_features)
    assert run(m, x[-2:], x).isfinite().all()


def check_state_dict_is_plain_mha_and_round_trips(m, other):
    "`m`'s checkpoint has exactly a plain MultiHeadAttention's keys; it loads into `other` (built with another seed)."
    assert list(m.state_dict()) == list(MultiHeadAttention(4, 32).state_dict())
    other.load_state_dict(m.state_dict())
    x = torch.randn(5, 2, 32)
    assert torch.equal(run(other, x, x), run(m, x, x))
    buf = io.BytesIO(); torch.save(m.state_dict(), buf); buf.seek(0)
    other.load_state_dict(torch.load(buf))
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert torch.equal(run(c, x, x), run(m, x, x))


def check_dropout_training_path_runs(m):
    x = torch.randn(6, 2, 32)
    run(m.train(), x, x).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched to the backend: each launches one or a few kernels. (Kernels themselves are no fit for
    the count: cuBLAS picks split-K variants by shape, so plain SDPA launches more of them at batch 4 x 8 heads.)"""
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def ops_forward_backward(call) -> tuple:
    "The ops dispatched by `out = call()` and by `out.sum().backward()`."
    with OpCounter() as fwd: out = call()
    with OpCounter() as bwd: out.sum().backward()
    return fwd.n, bwd.n


# ---------------------------------------------------------------- DecoderLM and its K/V cache (the method test files share these)
def perturbed_lm(position, **kw):
    "A float64 `DecoderLM` (vocabulary 13, d_model 16, 2 heads, 2 layers) with every parameter perturbed, so that zero-initialised position parameters do not make equalities vacuous."
    from relpos.models import DecoderLM
    torch.manual_seed(0)
    lm = DecoderLM(13, d_model=16, heads=2, n_layers=2, position=position, **kw).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return lm


def decode_through_cache(lm, seq, prompt_len, window, chunks=None, attention_mask=None):
    "Logits of a prompt in one pass, then the rest one token at a time (or in `chunks`), through a cache of `window` tokens."
    cache = lm.new_cache(seq.shape[0], window or seq.shape[1])
    with torch.no_grad():
        out = [lm(seq[:, :prompt_len], cache=cache, attention_mask=attention_mask)[0]]
        steps = chunks or [1] * (seq.shape[1] - prompt_len)
        i = prompt_len
        for c in steps: out.append(lm(seq[:, i:i + c], cache=cache)[0]); i += c
    return torch.cat(out, 1)


def check_left_padded_decoding(lm):
    "A left-padded prompt through the cache: each row's logits equal the full model on that row alone (float64, 1e-10)."
    from relpos.cache import full_logits
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(0, 13, (9,), generator=g), torch.randint(0, 13, (12,), generator=g)
    seq = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
    mask = torch.stack([torch.tensor([0] * 3 + [1] * 9), torch.ones(12, dtype=torch.long)])
    got = decode_through_cache(lm, seq, 6, None, attention_mask=mask[:, :6])
    assert (got[0, 3:] - full_logits(lm, a[None])[0]).abs().max() <= 1e-10
    assert (got[1] - full_logits(lm, b[None])[0]).abs().max() <= 1e-10

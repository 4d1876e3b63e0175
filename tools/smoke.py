#!/usr/bin/env python
"""Smoke run of every relpos attention module on whatever torch is installed: `make smoke-oldest` runs it against the
oldest torch that settings.ini claims, in a venv of its own. Each module: forward and backward on its fast path and on
its readable path (`need_weights=True`), with a causal mask and keys longer than queries, values and gradients compared,
second derivatives (create_graph) and torch.func.grad too; Shaw's fast path at small and large k, sdpa_bias's blockwise backward;
then one Transformer-XL training step, and `relpos.models.DecoderLM` for every position method when that chapter exists.
Prints one line per case and exits non-zero if any fails."""
import importlib, importlib.util, sys, traceback
import torch

torch.manual_seed(0)
H, D, NQ, NK, B = 2, 16, 5, 8, 3

def attention_modules():
    "(name, factory) of every labml-layout attention module in relpos (modules not written yet are skipped)."
    specs = [('mha', 'MultiHeadAttention', {}), ('relative_mha', 'RelativeMultiHeadAttention', {}),
             ('relative_mha', 'XLRelativeMultiHeadAttention', {}),
             ('fourier', 'FourierMultiHeadAttention', dict(max_number_of_keys=16, position_vector_size=8)),
             ('rotary', 'RotaryMultiHeadAttention', {}), ('alibi', 'ALiBiMultiHeadAttention', {}), ('t5', 'T5MultiHeadAttention', {})]
    for mod, cls, kw in specs:
        try: m = importlib.import_module(f'relpos.{mod}')
        except ModuleNotFoundError: continue
        yield f'{mod}.{cls}', (lambda m=m, cls=cls, kw=kw: getattr(m, cls)(H, D, dropout_prob=0.0, **kw))

def randomize(m):
    with torch.no_grad():
        for p in m.parameters(): p.copy_(torch.randn_like(p) * 0.3)
    return m

def check_attention(make):
    m = randomize(make())
    q = torch.randn(NQ, B, D, requires_grad=True); kv = torch.randn(NK, B, D, requires_grad=True)
    mask = (torch.arange(NK)[None, :] <= torch.arange(NQ)[:, None] + NK - NQ)[..., None]
    outs = []
    for need_weights in (False, True):
        y = m(query=q, key=kv, value=kv, mask=mask, need_weights=need_weights)
        g = torch.autograd.grad(y.square().sum(), [q, kv] + list(m.parameters()), allow_unused=True)
        outs.append((y, g))
    (y0, g0), (y1, g1) = outs
    torch.testing.assert_close(y0, y1, rtol=1e-4, atol=1e-5)
    # atol relative to the largest gradient entry: a gradient that is zero in exact arithmetic (the key bias's:
    # softmax ignores a constant added to a row of scores) holds only rounding noise, different on each path
    scale = max(b.abs().max().item() for b in g1 if b is not None)
    for a, b in zip(g0, g1):
        if a is not None or b is not None: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * scale)

def check_shaw():
    from relpos.shaw import RelationAwareMultiHeadAttention
    for k in (3, 40):   # 40: the per-bucket sums take scatter_add_ instead of the one-hot matmul
        m = randomize(RelationAwareMultiHeadAttention(D, H, k))
        x = torch.randn(B, NQ, D, requires_grad=True)
        outs = []
        for need_weights in (False, True):
            y = m(x, x, x, need_weights=need_weights)
            outs.append((y, torch.autograd.grad(y.square().sum(), [x] + list(m.parameters()))))
        (y0, g0), (y1, g1) = outs
        torch.testing.assert_close(y0, y1, rtol=1e-4, atol=1e-5)
        scale = max(b.abs().max().item() for b in g1)   # the key bias's gradient is 0 in exact arithmetic: noise
        for a, b in zip(g0, g1): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale)

def check_sdpa_bias():
    "relpos.fourier.sdpa_bias's blockwise backward (CPU flash forward) against SDPA's math path, bias gradient included."
    from relpos.fourier import sdpa_bias
    q, k, v = (torch.randn(2, H, n, 8, requires_grad=True) for n in (NQ, NK, NK))
    bias = torch.randn(1, H, NQ, NK, requires_grad=True)
    grads = []
    for f in (lambda *a: sdpa_bias(*a, 0.3, blockwise=True),
              lambda q, k, v, b: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=0.3)):
        y = f(q, k, v, bias)
        grads.append([y] + list(torch.autograd.grad(y.square().sum(), (q, k, v, bias))))
    for a, b in zip(*grads): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    second = []   # a gradient penalty: second derivatives through the blockwise backward
    for f in (lambda *a: sdpa_bias(*a, 0.3, blockwise=True),
              lambda q, k, v, b: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b, scale=0.3)):
        g, = torch.autograd.grad(f(q, k, v, bias).square().sum(), q, create_graph=True)
        second.append(torch.autograd.grad(g.square().sum(), (q, k, v, bias)))
    for a, b in zip(*second): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

def check_higher_order(make):
    "Second derivatives (create_graph) and torch.func.grad through the default path equal the readable path's."
    m = randomize(make()).double()
    x = torch.randn(NK, B, D, dtype=torch.float64, requires_grad=True)
    def penalty(need_weights):
        y = m(query=x[-NQ:], key=x, value=x, need_weights=need_weights)
        g, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        return torch.autograd.grad(g.square().sum(), x)[0]
    torch.testing.assert_close(penalty(False), penalty(True))
    f = lambda nw: (lambda x: m(query=x[-NQ:], key=x, value=x, need_weights=nw).square().sum())
    torch.testing.assert_close(torch.func.grad(f(False))(x), torch.func.grad(f(True))(x))

def check_xl_model():
    from relpos.relative_mha import TransformerXLModel
    m = TransformerXLModel(50, d_model=16, heads=2, d_ff=32, n_layers=2, mem_len=4, max_seq_len=8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, mem = torch.randint(0, 50, (6, 2)), None
    for _ in range(2):
        logits, mem = m(x, mem)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        opt.zero_grad(); loss.backward(); opt.step()

def check_models():
    models = importlib.import_module('relpos.models')
    for position in models.POSITIONS:
        m = models.DecoderLM(50, d_model=16, heads=2, n_layers=2, position=position, max_len=8)
        tokens = torch.randint(0, 50, (2, 8))
        logits, _ = m(tokens)
        logits.sum().backward()

def claimed_torch() -> str:
    "The torch requirement in settings.ini, the version `make smoke-oldest` installs by default."
    import configparser, os
    cfg = configparser.ConfigParser(); cfg.read(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'settings.ini'))
    return next((r for r in cfg['DEFAULT'].get('requirements', '').split() if r.startswith('torch')), 'torch (no requirement)')

def main():
    cases = [(name, lambda make=make: check_attention(make)) for name, make in attention_modules()]
    # the modules whose fast paths are relpos's own autograd.Functions (plain SDPA's fused CPU kernel has no double backward)
    higher_order = ('relative_mha.RelativeMultiHeadAttention', 'relative_mha.XLRelativeMultiHeadAttention', 'fourier.FourierMultiHeadAttention')
    cases += [(name + ' (create_graph, torch.func)', lambda make=make: check_higher_order(make))
              for name, make in attention_modules() if name in higher_order]
    cases += [('shaw.RelationAwareMultiHeadAttention', check_shaw), ('fourier.sdpa_bias (blockwise backward)', check_sdpa_bias),
              ('relative_mha.TransformerXLModel', check_xl_model)]
    if importlib.util.find_spec('relpos.models'): cases.append(('models.DecoderLM (every position)', check_models))
    failed = 0
    print(f'torch {torch.__version__} (settings.ini: {claimed_torch()})')
    for name, fn in cases:
        try: fn(); print(f'ok      {name}')
        except Exception:
            failed += 1; print(f'FAILED  {name}'); traceback.print_exc(limit=3)
    print(f'{len(cases) - failed} passed, {failed} failed')
    return 1 if failed else 0

if __name__ == '__main__': sys.exit(main())

#!/usr/bin/env python
"""Smoke run of every relpos attention module on whatever torch is installed: `make smoke-oldest` runs it against the
oldest torch that settings.ini claims, in a venv of its own. Each module: forward and backward on its fast path and on
its readable path (`need_weights=True`), with a causal mask and keys longer than queries, values and gradients compared;
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
             ('rotary', 'RotaryMultiHeadAttention', {}), ('alibi', 'AlibiMultiHeadAttention', {}), ('t5', 'T5MultiHeadAttention', {})]
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
    for a, b in zip(g0, g1):
        if a is not None or b is not None: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

def check_shaw():
    from relpos.shaw import RelationAwareMultiHeadAttention
    m = randomize(RelationAwareMultiHeadAttention(D, H, 3))
    x = torch.randn(B, NQ, D, requires_grad=True)
    y0, y1 = m(x, x, x), m(x, x, x, need_weights=True)
    torch.testing.assert_close(y0, y1, rtol=1e-4, atol=1e-5)
    y0.sum().backward()

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

def main():
    cases = [(name, lambda make=make: check_attention(make)) for name, make in attention_modules()]
    cases += [('shaw.RelationAwareMultiHeadAttention', check_shaw), ('relative_mha.TransformerXLModel', check_xl_model)]
    if importlib.util.find_spec('relpos.models'): cases.append(('models.DecoderLM (every position)', check_models))
    failed = 0
    print(f'torch {torch.__version__}')
    for name, fn in cases:
        try: fn(); print(f'ok      {name}')
        except Exception:
            failed += 1; print(f'FAILED  {name}'); traceback.print_exc(limit=3)
    print(f'{len(cases) - failed} passed, {failed} failed')
    return 1 if failed else 0

if __name__ == '__main__': sys.exit(main())

"""Packed documents (`packed_causal_mask` + `packed_position_ids`, chapter 01) for every position method: a row that
packs two documents gives, at each document's tokens, what each document gives alone (float64), with the gradients
of every parameter. A method that takes `position_ids` gets the restarted ids; one that refuses them must not need
them (its scores depend on the distance or the tokens between, not on where the document sits in the row)."""
import pytest
import torch

from relpos.mha import packed_causal_mask, packed_position_ids
from relpos.models import DecoderLM, POSITIONS

LENGTHS = (5, 7)   # two documents; both longer than the small FIRE threshold below, so its normaliser acts


def attention(position, seed=0):
    "The batch-first attention of a one-layer DecoderLM (float64, eval), as the model calls it."
    torch.manual_seed(seed)
    # max_len 8: FIRE's threshold L = 0.25 * 8 = 2 sits below both documents' lengths
    lm = DecoderLM(n_vocab=17, d_model=32, heads=4, n_layers=1, position=position, max_len=8, dropout=0.0).double().eval()
    with torch.no_grad():   # move every parameter off its initial value (zero-initialised tables included)
        for p in lm.parameters(): p.add_(0.05 * torch.randn_like(p))
    return lm.layers[0].self_attn


def takes_ids(attn): return getattr(getattr(attn, 'module', attn), 'accepts_position_ids', False)


def call(attn, x, doc_ids):
    "Attention over `x [1, n, d]` whose tokens belong to the documents `doc_ids [1, n]`."
    mask = packed_causal_mask(doc_ids).permute(2, 0, 1)                     # [batch, q, k]
    ids = {'position_ids': packed_position_ids(doc_ids)} if takes_ids(attn) else {}
    return attn(x, x, x, mask=mask, **ids)


@pytest.mark.parametrize('position', sorted(POSITIONS))
@pytest.mark.parametrize('need_weights', [False, True], ids=['fast', 'readable'])
def test_a_packed_row_equals_its_documents_alone(position, need_weights):
    attn = attention(position)
    inner = getattr(attn, 'module', attn)
    if hasattr(inner, 'need_weights'): inner.need_weights = need_weights
    elif need_weights: pytest.skip(f"{type(inner).__name__} has one path")
    docs = torch.tensor([[0] * LENGTHS[0] + [1] * LENGTHS[1]])
    x = torch.randn(1, sum(LENGTHS), 32, dtype=torch.float64, requires_grad=True)
    packed = call(attn, x, docs)
    alone = torch.cat([call(attn, x[:, :LENGTHS[0]], docs[:, :LENGTHS[0]]),
                       call(attn, x[:, LENGTHS[0]:], docs[:, LENGTHS[0]:] * 0)], dim=1)
    assert (packed - alone).abs().max() <= 1e-10
    w = torch.randn_like(packed)
    params = [p for p in attn.parameters() if p.requires_grad]
    g_packed = torch.autograd.grad((packed * w).sum(), [x] + params, allow_unused=True)
    g_alone = torch.autograd.grad((alone * w).sum(), [x] + params, allow_unused=True)
    for a, b in zip(g_packed, g_alone):
        if a is None or b is None: assert a is None and b is None; continue
        assert (a - b).abs().max() <= 1e-10


def test_fire_needs_the_restarted_positions():
    "Without the ids, FIRE's normaliser psi(max(i, L)) counts the second document's queries from the row's start."
    attn = attention('fire')
    docs = torch.tensor([[0] * LENGTHS[0] + [1] * LENGTHS[1]])
    x = torch.randn(1, sum(LENGTHS), 32, dtype=torch.float64)
    mask = packed_causal_mask(docs).permute(2, 0, 1)
    with torch.no_grad():
        second = attn(x[:, LENGTHS[0]:], x[:, LENGTHS[0]:], x[:, LENGTHS[0]:], mask=mask[:, LENGTHS[0]:, LENGTHS[0]:])
        without_ids = attn(x, x, x, mask=mask)[:, LENGTHS[0]:]
    assert (without_ids - second).abs().max() > 1e-3   # the trap the ids avoid (and why the chapter says so)


@pytest.mark.parametrize('position', sorted(POSITIONS))
def test_a_left_padded_row_with_its_ids_equals_the_row_unpadded(position):
    "The model passes `position_ids` to every method that takes them; FIRE's normaliser then counts from the first token."
    torch.manual_seed(0)
    lm = DecoderLM(n_vocab=17, d_model=32, heads=4, n_layers=2, position=position, max_len=8, dropout=0.0).double().eval()
    if not takes_ids(lm.layers[0].self_attn): pytest.skip(f"position={position!r} takes no position_ids")
    t = torch.randint(0, 17, (1, 12))
    keep = torch.tensor([[0] * 3 + [1] * 9])
    with torch.no_grad():
        padded = lm(t, attention_mask=keep, position_ids=(keep.cumsum(-1) - 1).clamp(min=0))[0][:, 3:]
        alone = lm(t[:, 3:])[0]
    assert (padded - alone).abs().max() <= 1e-10

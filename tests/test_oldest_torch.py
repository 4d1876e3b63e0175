"""The torch minimum that settings.ini claims is the one `make smoke-oldest` runs, and it is not older than the torch
features relpos's code calls (`make smoke-oldest` itself installs a multi-GB torch: run by hand, not here)."""
import configparser, re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def claimed_minimum():
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    reqs = cfg['DEFAULT']['requirements'].split()
    torch_req = [r for r in reqs if r.startswith('torch')]
    assert len(torch_req) == 1 and torch_req[0].startswith('torch>='), torch_req
    return tuple(int(x) for x in torch_req[0][len('torch>='):].split('.')[:2])


def test_smoke_oldest_runs_the_claimed_minimum():
    oldest = re.search(r'^TORCH_OLDEST \?= torch==(\d+)\.(\d+)\.\d+$', (ROOT / 'Makefile').read_text(), re.M)
    assert oldest, "Makefile: TORCH_OLDEST ?= torch==X.Y.Z"
    assert (int(oldest[1]), int(oldest[2])) == claimed_minimum()


def test_claimed_minimum_has_the_features_relpos_calls():
    "SDPA's enable_gqa came with torch 2.5, FlexAttention's gradients for captured tensors (learnable score_mod tables) with 2.6."
    code = ' '.join(p.read_text() for p in (ROOT / 'relpos').glob('*.py'))
    needed = [(2, 0)]
    if 'enable_gqa' in code: needed.append((2, 5))
    if 'flex_attention' in code and 'score_mod' in code: needed.append((2, 6))
    assert claimed_minimum() >= max(needed), (claimed_minimum(), needed)

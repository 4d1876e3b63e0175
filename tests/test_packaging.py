"The versions relpos claims are the versions it checks: settings.ini's torch floor is the one `make smoke-oldest` installs."
import configparser, re, runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_torch_floor_matches_smoke_target():
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT / 'settings.ini')
    floor = re.search(r'torch>=([\d.]+)', cfg['DEFAULT']['requirements']).group(1)
    oldest = re.search(r'^TORCH_OLDEST \?= torch==([\d.]+)', (ROOT / 'Makefile').read_text(), re.M).group(1)
    assert oldest.split('.')[:2] == floor.split('.')[:2], (floor, oldest)


def test_smoke_script_passes_on_this_torch():
    main = runpy.run_path(str(ROOT / 'tools' / 'smoke.py'))['main']
    assert main() == 0

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


def _requirement_names(key):
    cfg = configparser.ConfigParser(delimiters=['=']); cfg.read(ROOT / 'settings.ini')
    return {re.split(r'[<>=!~\[ ]', r, 1)[0].lower().replace('-', '_') for r in cfg['DEFAULT'][key].split()}


def test_runtime_imports_are_declared_requirements():
    "Every third-party package a relpos module imports at its top level is in settings.ini's `requirements`."
    import ast, sys
    declared = _requirement_names('requirements')
    missing = {}
    for path in sorted((ROOT / 'relpos').glob('*.py')):
        for node in ast.parse(path.read_text()).body:   # top level only: imports inside functions are optional (lazy)
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split('.')[0]
                if top == 'relpos' or top in sys.stdlib_module_names: continue
                if top.lower() not in declared: missing.setdefault(top, []).append(path.name)
    assert not missing, f"imported at run time but not in settings.ini requirements: {missing}"

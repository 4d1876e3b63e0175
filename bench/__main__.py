"`python -m bench [chapter ...]`: print every chapter's benchmark table (all chapters when none is named)."
import os, sys
from pathlib import Path
from relpos.bench import load_case

here = Path(__file__).parent
# study.py trains models for an hour (`make study`): not a benchmark table, so not part of the default list
# cuda.py is the GPU tables (`make bench DEVICE=cuda` includes it)
skip = {'study'} | (set() if os.environ.get('RELPOS_BENCH_DEVICE', '').startswith('cuda') else {'cuda'})
chapters = sys.argv[1:] or sorted(p.stem for p in here.glob('*.py') if not p.stem.startswith('_') and p.stem not in skip)
for chapter in chapters:
    print(f"\n## {chapter}\n", flush=True)
    print(load_case(f"bench.{chapter}:main")(), flush=True)

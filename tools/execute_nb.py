#!/usr/bin/env python
"""Execute notebooks in place so that the rendered docs show their outputs (plots, printed tensors, tables).

    .venv/bin/python tools/execute_nb.py [--with-slow | --with-slow=REGEX] nbs/03_shaw.ipynb [...]

Cells flagged `#| slow` (benchmarks, the study) are not run: they keep the outputs stored in the notebook, which come
from `make bench` or `make study`; `--with-slow` runs them too, `--with-slow=REGEX` only those whose source matches
REGEX (e.g. `--with-slow='run_bench|faiss_recall'`: a chapter's benchmark tables without its training demos). Everything else runs in order from `nbs/`, as `nbdev_test` runs it; the first error stops the
notebook unwritten. Run `nbdev_clean` afterwards.
"""
import re, sys, time
from pathlib import Path
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


class SkipSlow(NotebookClient):
    report_after = 2.0   # print the cells that take longer (seconds)
    run_slow = False   # True: every slow cell; a compiled pattern: the slow cells whose source it matches

    def skips(self, cell) -> bool:
        if cell.cell_type != 'code' or not cell.source.lstrip().startswith('#| slow'): return False
        return not self.run_slow if isinstance(self.run_slow, bool) else not self.run_slow.search(cell.source)

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if self.skips(cell): return cell
        t0 = time.perf_counter()
        cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        if (t := time.perf_counter() - t0) > self.report_after:
            print(f"  cell {cell_index} ({cell.get('id')}): {t:.1f} s  {cell.source.splitlines()[0][:60]!r}")
        return cell


def execute(path: Path, timeout: int = 600, run_slow=False):
    nb = nbformat.read(path, as_version=4)
    client = SkipSlow(nb, timeout=timeout if not run_slow else None, kernel_name='python3',
                      resources={'metadata': {'path': str(path.parent)}})
    client.run_slow = run_slow
    client.execute()
    nbformat.write(nb, path)


if __name__ == '__main__':
    args = sys.argv[1:]
    flags = [a for a in args if a.startswith('--with-slow')]
    run_slow = bool(flags) and (re.compile(flags[-1].split('=', 1)[1]) if '=' in flags[-1] else True)
    for p in [a for a in args if not a.startswith('--with-slow')]:
        try: execute(Path(p), run_slow=run_slow)
        except CellExecutionError as e:
            sys.exit(f"{p}: " + re.sub(r'\x1b\[[0-9;]*m', '', str(e))[-3000:])
        print(f"executed {p}")

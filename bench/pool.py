"""The worker pool both studies use (bench/study.py, bench/memorizing_study.py): one fresh process per run, a few
at a time, each single-threaded, and each finished run written to its own file at once (resumable studies)."""
import json, os
from multiprocessing import get_context
from pathlib import Path

def run_pool(fn, jobs:list, workers:int=2, threads:int=1) -> list:
    """`fn(job)` for every job, each in a fresh spawned process (`maxtasksperchild=1`: a run's peak memory is its own),
    `workers` at once, handed out in the order of `jobs`; `OMP_NUM_THREADS=threads` in the workers (read by OpenMP at
    start-up: two single-threaded runs share two cores evenly). Results in the order of `jobs`. `fn` must be importable."""
    if not jobs: return []
    old = os.environ.get('OMP_NUM_THREADS')
    os.environ['OMP_NUM_THREADS'] = str(threads)
    try:
        with get_context('spawn').Pool(min(workers, len(jobs)), maxtasksperchild=1) as pool:
            return pool.map(fn, jobs, chunksize=1)
    finally:
        if old is None: os.environ.pop('OMP_NUM_THREADS')
        else: os.environ['OMP_NUM_THREADS'] = old

def write_json(path, obj, indent=None) -> Path:
    "Write `obj` as JSON through a temporary file and a rename: a reader (or an interrupted study) never sees half a file."
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix('.tmp')
    tmp.write_text(json.dumps(obj, indent=indent))
    tmp.replace(path)
    return path

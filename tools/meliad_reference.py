#!/usr/bin/env python
"""Regenerate tests/data/fourier_meliad.npz: meliad's own numbers for relpos.fourier's parity tests, and the JAX timings
that chapter 04 (nbs/04_fourier.ipynb) shows next to its own benchmark.

relpos does not depend on JAX, and meliad is not on PyPI, so this script runs by hand, in a venv of its own, against a
clone of meliad's source (only `transformer/position.py` and `transformer/position_fourier.py` are loaded, straight from
their files; meliad's `transformer/__init__.py` and the rest of the package are not imported):

    git clone https://github.com/google-research/meliad /tmp/meliad
    python3 -m venv /tmp/meliad-venv
    /tmp/meliad-venv/bin/pip install jax flax gin-config numpy      # CPU jax is enough
    /tmp/meliad-venv/bin/python tools/meliad_reference.py --meliad /tmp/meliad            # compare with the stored file
    /tmp/meliad-venv/bin/python tools/meliad_reference.py --meliad /tmp/meliad --write    # rewrite it

Run it from the repository root (it writes `tests/data/fourier_meliad.npz`, or `--out PATH`). Without `--write` it
computes everything and compares it with the stored file: parity arrays must match to 1e-6 relative (they are
bit-identical on the same NumPy, because meliad computes its position vectors in NumPy float32), timings are only printed.
The stored file was made with jax 0.10.2, flax 0.12.8 and NumPy 2.4.6 on the 2-core CPU machine that runs relpos's
benchmarks; its `versions` entry records the jax and NumPy versions. `--no-timing` skips the timings (and keeps the stored
ones when writing).

What the file holds (the names tests/test_fourier.py and the chapter read):
  pe_*            `position.position_encoding(n, d, offset=, max_wavelength=)`, with `pe_*_args` = (n, d, offset, max_wavelength)
  small_*         `RelativeFourierPositions(4 heads, 64 keys, 32-vector)` biases with `small_rotation`
                  (`np.random.default_rng(0).standard_normal((4, 32))`, float32) at every kind of offset meliad accepts;
                  `small_*_args` = (num_queries, num_keys, offset), offset -10**9 meaning None; `small_init_rotation`: its init
  big_init        meliad's default module (8 heads, 1024 keys, 128-vector) at init, 64 queries x 128 keys
  big_random      the same with `big_rotation` (the same generator, next draw, times 1/8)
  jax_times       rows (n, forward seconds, forward+backward seconds) of the default module's bias under `jax.jit`, CPU:
                  median of 7 calls after one warm-up, `block_until_ready`; forward = the `[1, 8, n, n]` bias,
                  forward+backward = the gradient of sum(B * G) for a random G with respect to the rotation matrix
  versions        [jax version, NumPy version]
"""
import argparse, importlib.util, statistics, sys, time, types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NONE_OFFSET = -10**9   # how `small_*_args` stores offset=None

PE_CASES = {'pe_default': (50, 16, 0, 0), 'pe_offset': (40, 32, -13, 256), 'pe_large': (300, 64, 0, 2048),
            'pe_odd_wl': (20, 8, 5, 3.5)}
SMALL_CASES = {'default_square': (16, 16, None), 'default_memory': (8, 24, None), 'inside': (8, 24, 3),
               'before': (8, 24, -5), 'after': (8, 24, 30), 'q_longer': (24, 8, 0), 'q_longer_neg': (24, 8, -20),
               'far': (6, 10, 500)}
TIMING_NS = (128, 512, 1024, 2048)


def load_meliad(root: Path):
    "meliad's `transformer.position` and `transformer.position_fourier`, loaded from their files in a clone at `root`."
    tdir = Path(root)/'transformer'
    for f in ('position.py', 'position_fourier.py'):
        if not (tdir/f).is_file(): sys.exit(f"{tdir/f} not found: --meliad must point at a clone of google-research/meliad")
    pkg = types.ModuleType('transformer'); pkg.__path__ = [str(tdir)]
    sys.modules['transformer'] = pkg   # a bare package: `from transformer import position` finds the module loaded below
    mods = []
    for name in ('position', 'position_fourier'):
        spec = importlib.util.spec_from_file_location(f'transformer.{name}', tdir/f'{name}.py')
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod; setattr(pkg, name, mod)
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def compute(position, position_fourier, timing=True):
    import jax, jax.numpy as jnp
    RFP = position_fourier.RelativeFourierPositions
    out = {}
    for name, (n, d, off, mw) in PE_CASES.items():
        out[name] = np.asarray(position.position_encoding(n, d, offset=off, max_wavelength=mw), dtype=np.float32)
        out[name + '_args'] = np.array([n, d, off, mw], dtype=np.float64)

    def bias(module, nq, nk, offset, rotation=None):
        params = module.init(jax.random.PRNGKey(0), nq, nk, offset)
        init = np.asarray(params['params']['rotation_matrix'])
        if rotation is not None: params = {'params': {'rotation_matrix': jnp.asarray(rotation)}}
        return np.asarray(module.apply(params, nq, nk, offset)), init

    rng = np.random.default_rng(0)
    small_rotation = rng.standard_normal((4, 32)).astype(np.float32)
    big_rotation = (rng.standard_normal((8, 128)) * 0.125).astype(np.float32)
    small = RFP(num_heads=4, max_number_of_keys=64, position_vector_size=32)
    _, out['small_init_rotation'] = bias(small, 4, 4, None)
    out['small_rotation'] = small_rotation
    for name, (nq, nk, off) in SMALL_CASES.items():
        out[f'small_{name}'], _ = bias(small, nq, nk, off, small_rotation)
        out[f'small_{name}_args'] = np.array([nq, nk, NONE_OFFSET if off is None else off], dtype=np.int64)
    big = RFP()   # meliad's defaults: 8 heads, 1024 keys, 128-vector
    out['big_init'], _ = bias(big, 64, 128, None)
    out['big_rotation'] = big_rotation
    out['big_random'], _ = bias(big, 64, 128, None, big_rotation)
    if timing: out['jax_times'] = np.array([[n, *time_bias(big, n)] for n in TIMING_NS], dtype=np.float64)
    out['versions'] = np.array([jax.__version__, np.__version__])
    return out


def time_bias(module, n, reps=7):
    "Median seconds of the jitted `[1, 8, n, n]` bias and of the jitted gradient of sum(B * G) w.r.t. the rotation matrix."
    import jax, jax.numpy as jnp
    params = module.init(jax.random.PRNGKey(0), n, n)
    g = jax.random.normal(jax.random.PRNGKey(1), (1, module.num_heads, n, n), dtype=jnp.float32)
    # G is an argument, not a constant of the jitted function: the gradient is linear in G and would be constant-folded
    forward = jax.jit(lambda p, g: module.apply(p, n, n))
    backward = jax.jit(jax.grad(lambda p, g: jnp.sum(module.apply(p, n, n) * g)))
    res = []
    for f in (forward, backward):
        jax.block_until_ready(f(params, g))   # warm-up: compile
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter(); jax.block_until_ready(f(params, g)); ts.append(time.perf_counter() - t0)
        res.append(statistics.median(ts))
    return res


def compare(new, stored_path):
    "Print how the new numbers compare with the stored file; True if every parity array matches to 1e-6 relative."
    old, ok = np.load(stored_path), True
    for k in sorted(set(new) | set(old.files)):
        if k not in new or k not in old.files:
            print(f"  {k}: only in {'the stored file' if k in old.files else 'this run'}"); ok &= k in ('jax_times',); continue
        a, b = new[k], old[k]
        if k in ('versions', 'jax_times'): print(f"  {k}: stored {b.tolist()}, this run {a.tolist()}"); continue
        if a.shape != b.shape: print(f"  {k}: shape {a.shape} != stored {b.shape}"); ok = False; continue
        err = float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30)) if a.size else 0.0
        same = err <= 1e-6
        ok &= same
        if not same or not np.array_equal(a, b): print(f"  {k}: relative difference {err:.2e}{'' if same else '  MISMATCH'}")
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split('\n', 1)[1])
    ap.add_argument('--meliad', required=True, help='a clone of https://github.com/google-research/meliad')
    ap.add_argument('--out', default=str(ROOT/'tests'/'data'/'fourier_meliad.npz'))
    ap.add_argument('--write', action='store_true', help='write the file (default: compare with it)')
    ap.add_argument('--no-timing', action='store_true', help='skip the JAX timings')
    a = ap.parse_args(argv)
    position, position_fourier = load_meliad(Path(a.meliad))
    new = compute(position, position_fourier, timing=not a.no_timing)
    out = Path(a.out)
    if 'jax_times' in new:
        for n, f, b in new['jax_times']: print(f"meliad bias under jax.jit, n={int(n)}: forward {f*1e3:.3g} ms, forward+backward {b*1e3:.3g} ms")
    if a.write:
        if 'jax_times' not in new and out.exists() and 'jax_times' in np.load(out).files: new['jax_times'] = np.load(out)['jax_times']
        np.savez(out, **new)
        print(f"wrote {out}")
        return 0
    if not out.exists(): sys.exit(f"{out} does not exist: run with --write")
    ok = compare(new, out)
    print('parity data: ' + ('matches the stored file' if ok else 'DIFFERS from the stored file'))
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())

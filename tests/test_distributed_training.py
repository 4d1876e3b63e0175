"""relpos.train under PyTorch's engine: two gloo processes on the CPU, small models.

One spawn of two processes runs every check that needs a process group, so torch is imported twice, not once per case:
- for every entry of `relpos.models.POSITIONS` (with Transformer-XL memory where the method takes it) and for kNN layers:
  two optimizer steps of two micro-steps each under DDP, under FSDP2, and under FSDP2 with activation checkpointing
  give the single process's loss and gradients at every step (float64, <= 1e-9 relative), and at the end each rank's
  XL and kNN memories are the single process's rows of that rank (the second step reads what the first left);
- `train()` stopped after two steps and resumed from its checkpoint repeats the uninterrupted run's losses bit for bit
  (DDP and FSDP2, XL memory, a kNN layer and dropout: model, optimizer, memories and random state all restored);
- bf16 under FSDP2 (`MixedPrecisionPolicy`) stays within BF16_TOLERANCE of float32 over three steps;
- `--compile` (Inductor's CPU kernels, when a C++ compiler is there) under DDP gives the uncompiled float64 losses.
Then `torchrun --nproc_per_node 2 -m relpos.train` trains (FSDP2, float64), stops, resumes, and gives the single
process's losses; and in this process: activation checkpointing keeps fewer activations, --help, refused options.
"""
import gc, json, os, shutil, socket, subprocess, sys
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from relpos.models import POSITIONS, DecoderLM
from relpos import train as T

ROOT = Path(__file__).resolve().parent.parent
WORLD, ROWS, SEQ, MEM, STEPS, ACC = 2, 4, 8, 8, 2, 2
TOL = 1e-9             # float64: relative to the largest gradient entry (or 1)
BF16_TOLERANCE = 0.05  # nats: |loss(bf16) - loss(fp32)| at each of the first steps of a run (the loss is about 5.5)
MODEL = ['--d-model', '16', '--heads', '2', '--n-layers', '2', '--d-ff', '32', '--seq-len', str(SEQ)]


def _supports_memory(position):
    return DecoderLM(256, 16, 2, 1, position=position, max_len=SEQ).supports_memory


def _cases():
    "name -> extra command-line options: every position method (memory where it takes it), and kNN layers."
    cases = {p: ['--position', p] + (['--mem-len', str(MEM)] if _supports_memory(p) else []) for p in POSITIONS}
    knn = ['--memorizing-layers', '1', '--knn-capacity', '24', '--top-k', '4']
    cases['xl+knn'] = ['--position', 'xl', '--mem-len', str(MEM)] + knn
    cases['rotary+knn'] = ['--position', 'rotary'] + knn
    return cases


def _args(extra, data='unused', batch=ROWS // WORLD, strategy='none', dtype='fp64'):
    return T.train_parser().parse_args(['--data', str(data), *MODEL, '--batch-size', str(batch), '--grad-accum', str(ACC),
                                        '--strategy', strategy, '--dtype', dtype, '--device', 'cpu', *extra])


def _data():
    return torch.randint(0, 256, (ROWS * (STEPS * ACC * SEQ + 1) + 3,), generator=torch.Generator().manual_seed(3),
                         dtype=torch.uint8)


def _model(args, strategy, checkpoint=False):
    "Built as train() builds it, its parameters moved off their initial values (XL's tables start at zero and would hide a wrong gradient)."
    model = T.build_model(args)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g))
    return T.parallelize(model, strategy, torch.device('cpu'), args.dtype, checkpoint=checkpoint)


def _full(t):
    return t.full_tensor() if hasattr(t, 'full_tensor') else t   # FSDP2's gradients are sharded DTensors


def _steps(args, strategy, rank=0, world=1, checkpoint=False):
    "Loss (mean over ranks) and full gradients of each of STEPS optimizer steps of ACC micro-steps, memory carried"
    " throughout; and the XL and kNN memories at the end."
    model, data = _model(args, strategy, checkpoint), _data()
    opt = torch.optim.AdamW(T.unwrap(model).parameters(), lr=1e-2)
    memory, out = None, []
    per_rank = ROWS // world
    for step in range(STEPS):
        batches = [T.batch_at(data, step * ACC + i, SEQ, ROWS, rank * per_rank, per_rank) for i in range(ACC)]
        loss, memory = T.accumulate(model, batches, memory)
        grads = {n: _full(p.grad).detach().clone() for n, p in T.unwrap(model).named_parameters() if p.grad is not None}
        out.append((T.mean_over_ranks(loss), grads))
        T.optimizer_step(model, opt, 1e-2, clip=1.0)
    knn = {i: {k: v.clone() for k, v in m.items() if k in ('keys', 'values')}
           for i, m in T.unwrap(model).knn_memory_state_dict().items()}
    return out, dict(xl=[m.clone() for m in memory], knn=knn)


def _resume_args(tmp, strategy, *extra):
    return T.train_parser().parse_args([
        '--data', str(tmp/'data.bin'), *MODEL, '--batch-size', '2', '--grad-accum', '2', '--strategy', strategy,
        '--dtype', 'fp64', '--device', 'cpu', '--position', 'xl', '--mem-len', str(MEM), '--memorizing-layers', '1',
        '--knn-capacity', '24', '--top-k', '4', '--dropout', '0.1', '--steps', '4', '--warmup', '1', '--lr', '1e-2',
        '--log-every', '100', *extra])


def _worker(rank, port, tmp):
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=WORLD)
    try:
        res = {'grads': {}, 'memory': {}, 'resume': {}, 'bf16': {}, 'compile': {}}
        for name, extra in _cases().items():
            args = _args(extra)
            for mode, strategy, checkpoint in (('ddp', 'ddp', False), ('fsdp', 'fsdp', False), ('fsdp+checkpointing', 'fsdp', True)):
                res['grads'].setdefault(name, {})[mode], res['memory'].setdefault(name, {})[mode] = _steps(
                    args, strategy, rank, WORLD, checkpoint)
        for strategy in ('ddp', 'fsdp'):
            ckpt = tmp/f'ckpt_{strategy}'
            whole = T.train(_resume_args(tmp, strategy))
            first = T.train(_resume_args(tmp, strategy, '--stop-at', '2', '--ckpt-dir', str(ckpt)))
            rest = T.train(_resume_args(tmp, strategy, '--ckpt-dir', str(ckpt), '--resume'))
            res['resume'][strategy] = (whole, first, rest)
        for position in ('xl', 'fire'):
            res['bf16'][position] = {dtype: T.train(T.train_parser().parse_args([
                '--data', str(tmp/'data.bin'), *MODEL, '--batch-size', '2', '--strategy', 'fsdp', '--dtype', dtype,
                '--device', 'cpu', '--position', position, '--mem-len', str(MEM), '--steps', '3', '--warmup', '1',
                '--lr', '1e-2', '--log-every', '100'])) for dtype in ('fp32', 'bf16')}
        if shutil.which('g++') or shutil.which('cc'):   # Inductor's CPU kernels are C++
            res['compile'] = {flag: T.train(T.train_parser().parse_args([
                '--data', str(tmp/'data.bin'), *MODEL, '--batch-size', '2', '--strategy', 'ddp', '--dtype', 'fp64',
                '--device', 'cpu', '--position', 'rotary', '--mem-len', str(MEM), '--steps', '2', '--warmup', '1',
                '--lr', '1e-2', '--log-every', '100', *flag])) for flag in ((), ('--compile',))}
        torch.save(res, tmp/f'result{rank}.pt')
    finally:
        gc.collect()   # FSDP2's gloo work objects freed while the interpreter exits can abort it (see relpos.train.main)
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def spawned(tmp_path_factory):
    "The two-process job's results (run once for the tests below)."
    tmp = tmp_path_factory.mktemp('distributed')
    (tmp/'data.bin').write_bytes(bytes(_data().tolist()) * 4)
    os.environ['OMP_NUM_THREADS'] = '1'   # inherited by the spawned children
    mp.spawn(_worker, args=(_free_port(), tmp), nprocs=WORLD, join=True)
    return tmp, [torch.load(tmp/f'result{r}.pt', weights_only=False) for r in range(WORLD)]


def _compare(got, want):
    "Differences between two `_steps` results, as readable lines."
    errors = []
    for step, ((loss, grads), (loss_s, grads_s)) in enumerate(zip(got, want)):
        if abs(loss - loss_s) > TOL * max(1.0, abs(loss_s)): errors.append(f"step {step}: loss {loss!r} vs {loss_s!r}")
        if grads.keys() != grads_s.keys(): errors.append(f"step {step}: parameters with a gradient differ"); continue
        for k, g in grads_s.items():
            err = (grads[k] - g).abs().max().item()
            if err > TOL * max(1.0, g.abs().max().item()): errors.append(f"step {step}: {k} max abs diff {err:.2e}")
    return errors


def test_every_position_ddp_fsdp_checkpointing_equal_single_process(spawned):
    "Loss and gradients at both steps; and each rank's XL and kNN memories at the end are the single process's rows of that rank."
    torch.set_num_threads(1)
    _, ranks = spawned
    res = ranks[0]
    assert set(res['grads']) == set(_cases()) and set(POSITIONS) <= set(res['grads'])
    errors, n = [], ROWS // WORLD
    for name, extra in _cases().items():
        single, memory = _steps(_args(extra, batch=ROWS), 'none')
        for mode, got in res['grads'][name].items():
            errors += [f"{name} {mode}: {e}" for e in _compare(got, single)]
            for r in range(WORLD):
                own = ranks[r]['memory'][name][mode]
                xl = [m[r * n:(r + 1) * n] for m in memory['xl']]
                if len(own['xl']) != len(xl) or any(not torch.allclose(a, b, rtol=TOL, atol=TOL) for a, b in zip(own['xl'], xl)):
                    errors.append(f"{name} {mode}: rank {r}'s XL memory is not rows {r * n}..{(r + 1) * n - 1}")
                for i, knn in memory['knn'].items():
                    for k, v in knn.items():
                        if not torch.allclose(own['knn'][i][k], v[r * n:(r + 1) * n], rtol=TOL, atol=TOL):
                            errors.append(f"{name} {mode}: rank {r}'s kNN {k} of layer {i} are not its rows")
        assert bool(memory['xl']) == ('--mem-len' in extra) and bool(memory['knn']) == ('--memorizing-layers' in extra)
    assert not errors, "\n".join(errors[:20])


def test_checkpointing_keeps_fewer_activations():
    "checkpoint_layers is in effect: the forward keeps a fraction of the activations for the backward (kNN layers keep theirs)."
    torch.set_num_threads(1)
    saved = {}
    for name, checkpoint in (('plain', False), ('checkpointed', True)):
        model = _model(_args(['--position', 'rotary', '--n-layers', '4', '--seq-len', '32', '--d-model', '32']), 'none', checkpoint)
        x = torch.randint(0, 256, (2, 32))
        sizes = []
        def pack(t): sizes.append(t.numel()); return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, _ = model(x)
        logits.sum().backward()
        saved[name] = sum(sizes)
    assert saved['checkpointed'] < saved['plain'] / 2, saved


def test_resumed_run_repeats_losses_bit_for_bit(spawned):
    tmp, (res, _) = spawned
    for strategy, (whole, first, rest) in res['resume'].items():
        assert len(whole) == 4 and len(first) == 2 and len(rest) == 2, strategy
        assert first + rest == whole, (strategy, first + rest, whole)   # exact float equality
    meta = json.loads((tmp/'ckpt_fsdp'/'step_00000002'/'meta.json').read_text())
    assert meta == dict(world_size=2, batch_size=2, seq_len=SEQ, grad_accum=2, step=2)
    assert {p.name for p in (tmp/'ckpt_fsdp'/'step_00000002').glob('rank*.pt')} == {'rank0.pt', 'rank1.pt'}


def test_bf16_fsdp_close_to_fp32(spawned):
    _, (res, _) = spawned
    for position, runs in res['bf16'].items():
        fp32, bf16 = runs['fp32'], runs['bf16']
        assert len(fp32) == len(bf16) == 3
        diffs = [abs(a - b) for a, b in zip(fp32, bf16)]
        assert max(diffs) <= BF16_TOLERANCE, (position, fp32, bf16)
        assert fp32 != bf16, position   # bf16 did run in bf16


def test_compiled_layers_under_ddp(spawned):
    "--compile (each decoder layer through torch.compile, Inductor's CPU kernels) under DDP: the uncompiled run's float64 losses."
    _, (res, _) = spawned
    if not res['compile']: pytest.skip('no C++ compiler for Inductor')
    plain, compiled = res['compile'][()], res['compile'][('--compile',)]
    assert len(plain) == len(compiled) == 2
    for a, b in zip(plain, compiled): assert abs(a - b) <= TOL * abs(a), (plain, compiled)


def test_torchrun_trains_stops_and_resumes(tmp_path):
    "The command line under torchrun: FSDP2 on two processes, stopped after two steps, resumed to four; float64 losses equal a single process's."
    data = tmp_path/'data.txt'
    data.write_bytes((ROOT/'LICENSE').read_bytes()[:6000])
    opts = ['--data', str(data), *MODEL, '--position', 'rotary', '--mem-len', str(MEM), '--batch-size', '2',
            '--steps', '4', '--warmup', '1', '--lr', '1e-2', '--log-every', '1', '--dtype', 'fp64', '--device', 'cpu',
            '--ckpt-dir', str(tmp_path/'ckpt'), '--log-file', str(tmp_path/'log.jsonl')]
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', '-m', 'relpos.train',
           '--strategy', 'fsdp', *opts]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    outs = [subprocess.run(cmd + extra, env=env, capture_output=True, text=True, cwd=tmp_path)
            for extra in (['--stop-at', '2'], ['--resume'])]
    for r in outs: assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert 'step 2/4 | loss' in outs[0].stdout and 'step 3/4' not in outs[0].stdout
    assert 'resumed from step_00000002 (step 2)' in outs[1].stdout and 'step 4/4 | loss' in outs[1].stdout
    assert 'tokens/s' in outs[1].stdout
    log = [json.loads(l) for l in (tmp_path/'log.jsonl').read_text().splitlines()]
    assert [l['step'] for l in log] == [1, 2, 3, 4]
    torch.set_num_threads(1)
    single = T.train(T.train_parser().parse_args([*opts[:-4], '--batch-size', '4']))   # no checkpoints, no log file
    for l, s in zip(log, single): assert abs(l['loss'] - s) <= TOL * abs(s), (log, single)


def test_help_and_refusals(tmp_path, capsys):
    "--help names the options; a bad option value exits with status 2 and a message naming it; a resume with another layout is refused."
    with pytest.raises(SystemExit) as e: T.main(['--help'])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ('--strategy', '--dtype', '--checkpoint-activations', '--compile', '--grad-accum', '--resume', 'torchrun'):
        assert opt in out, opt
    data = tmp_path/'data.txt'
    data.write_bytes(b'x' * 100)
    for bad, want in ((['--seq-len', '0'], '--seq-len must be >= 1'), (['--resume'], '--resume needs --ckpt-dir'),
                      (['--seq-len', '64', '--batch-size', '2'], 'fewer than seq_len + 1'),
                      (['--position-kwargs', '[1]'], '--position-kwargs must be a JSON object'),
                      (['--memorizing-layers', 'a'], '--memorizing-layers must be layer indices')):
        with pytest.raises(SystemExit) as e: T.main(['--data', str(data), '--device', 'cpu', *bad])
        assert e.value.code == 2 and want in capsys.readouterr().err, (bad, want)
    run = ['--data', str(data), '--device', 'cpu', *MODEL, '--batch-size', '2', '--steps', '1', '--ckpt-dir', str(tmp_path/'c')]
    T.main(run)
    with pytest.raises(SystemExit) as e: T.main(run[:-2] + ['--batch-size', '3', '--ckpt-dir', str(tmp_path/'c'), '--resume', '--steps', '2'])
    assert e.value.code == 2 and 'batch_size=2' in capsys.readouterr().err

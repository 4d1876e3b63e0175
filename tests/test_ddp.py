"""Two-process DistributedDataParallel (gloo, CPU) training steps for every relpos module with parameters.

Each rank gets half of the batch; after DDP's all-reduce both ranks must hold identical gradients,
equal (<= 1e-6) to those of a single process on the concatenated batch, for two SGD steps.
All modules run in one spawn of two processes, so torch is imported only twice.
"""
import importlib, os, socket, tempfile
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, BATCH, SEQ_Q, SEQ_K, D, H, VOCAB = 2, 4, 5, 8, 16, 2, 13

# name -> (module, class, constructor kwargs, layout)
SPECS = {
    "mha.MultiHeadAttention": ("mha", "MultiHeadAttention", dict(heads=H, d_model=D, dropout_prob=0.0), "labml"),
    "fourier.FourierMultiHeadAttention": ("fourier", "FourierMultiHeadAttention",
                                          dict(heads=H, d_model=D, dropout_prob=0.0, max_number_of_keys=16,
                                               position_vector_size=8), "labml"),
    "rotary.RotaryMultiHeadAttention": ("rotary", "RotaryMultiHeadAttention",
                                        dict(heads=H, d_model=D, dropout_prob=0.0, rotary_dim=4), "labml"),
    "alibi.ALiBiMultiHeadAttention": ("alibi", "ALiBiMultiHeadAttention", dict(heads=H, d_model=D, dropout_prob=0.0),
                                      "labml"),
    "relative_mha.RelativeMultiHeadAttention": ("relative_mha", "RelativeMultiHeadAttention",
                                                dict(heads=H, d_model=D, dropout_prob=0.0), "labml"),
    "relative_mha.XLRelativeMultiHeadAttention": ("relative_mha", "XLRelativeMultiHeadAttention",
                                                  dict(heads=H, d_model=D, dropout_prob=0.0), "labml"),
    "relative_mha.TransformerXLModel": ("relative_mha", "TransformerXLModel",
                                        dict(n_vocab=VOCAB, d_model=D, heads=H, d_ff=32, n_layers=2, mem_len=SEQ_Q,
                                             max_seq_len=SEQ_Q), "tokens"),
    "shaw.RelationAwareMultiHeadAttention": ("shaw", "RelationAwareMultiHeadAttention",
                                             dict(hidden_size=D, num_heads=H, k=3), "shaw"),
    "context_choice.ContextChoiceLinear": ("context_choice", "ContextChoiceLinear",
                                           dict(attention_heads=H, embedding_dim=D), "gate"),
}


def _available():
    out = []
    for name, (module, cls, _, _) in SPECS.items():
        try:
            mod = importlib.import_module(f"relpos.{module}")
        except ModuleNotFoundError as e:
            if e.name in (f"relpos.{module}", "relpos"): continue
            raise
        if hasattr(mod, cls): out.append(name)
    return out


def _build(name):
    module, cls, kw, _ = SPECS[name]
    torch.manual_seed(0)
    m = getattr(importlib.import_module(f"relpos.{module}"), cls)(**kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # tables initialised at zero (Transformer-XL's) would hide wrong gradients
        for p in m.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m


def _data(name, step):
    "Full-batch inputs for one step, and the batch dim of each."
    layout = SPECS[name][3]
    g = torch.Generator().manual_seed(100 + step)
    if layout == "labml":   # [seq, batch, d]; queries are the last SEQ_Q of SEQ_K positions (memory)
        x = torch.randn(SEQ_K, BATCH, D, generator=g)
        mask = torch.ones(SEQ_Q, SEQ_K, 1, dtype=torch.bool).tril(SEQ_K - SEQ_Q)
        return dict(query=x[-SEQ_Q:], key=x, value=x, mask=mask), dict(query=1, key=1, value=1, mask=2)
    if layout == "shaw":    # [batch, seq, d], padding mask [batch, seq]
        x = torch.randn(BATCH, SEQ_K, D, generator=g)
        mask = torch.ones(BATCH, SEQ_K); mask[0, -2:] = 0; mask[3, -1:] = 0
        return dict(query=x, key=x, value=x, mask=mask), dict(query=0, key=0, value=0, mask=0)
    if layout == "tokens":  # one segment per step; the second attends to the memory of the first
        return dict(x=torch.randint(0, VOCAB, (SEQ_Q, BATCH), generator=g)), dict(x=1)
    loc, glo = torch.randn(2, BATCH, SEQ_K, D, generator=g)
    return dict(embeddings_local=loc, embeddings_global=glo), dict(embeddings_local=0, embeddings_global=0)


def _shard(data, dims, rank):
    "This rank's half of the batch (a mask with batch size 1 broadcasts and is kept whole)."
    n = BATCH // WORLD
    return {k: v if v.shape[dims[k]] == 1 else v.narrow(dims[k], rank * n, n) for k, v in data.items()}


def _call(m, name, data, state):
    layout = SPECS[name][3]
    if layout == "labml": return m(**data)
    if layout == "tokens":
        out, state["mem"] = m(data["x"], state.get("mem"))
        return out
    if layout == "shaw": return m(data["query"], data["key"], data["value"], mask=data["mask"])
    return m(data["embeddings_local"], data["embeddings_global"])


def _loss(out, name, m):
    loss = out.square().mean()
    if SPECS[name][3] == "gate": loss = loss + m.get_loss_component()
    return loss


def _train(m, name, rank=None):
    "Two SGD steps; returns the gradients of each step (by parameter name)."
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    grads, state = [], {}
    for step in range(2):
        data, dims = _data(name, step)
        if rank is not None: data = _shard(data, dims, rank)
        opt.zero_grad()
        inner = m.module if hasattr(m, "module") else m
        _loss(_call(m, name, data, state), name, inner).backward()
        grads.append({k: p.grad.detach().clone() for k, p in inner.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def _worker(rank, port, names, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for name in names:
            ddp = torch.nn.parallel.DistributedDataParallel(_build(name))
            results[name] = _train(ddp, name, rank)
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_matches_single_process():
    # One test (not one per module): under pytest-xdist a module-scoped fixture would spawn the
    # process group once per worker.
    names = _available()
    if not names: pytest.skip("no relpos module with parameters exists yet")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(_free_port(), names, outdir), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=True) for r in range(WORLD)]
    torch.set_num_threads(1)
    errors = []
    for name in names:
        single = _train(_build(name), name)
        for step in range(2):
            g0, g1, gs = ranks[0][name][step], ranks[1][name][step], single[step]
            if not (g0.keys() == g1.keys() == gs.keys()):
                errors.append(f"{name} step {step}: parameters with a gradient differ"); continue
            for k in gs:
                if not torch.equal(g0[k], g1[k]): errors.append(f"{name} step {step}: {k} differs between ranks")
                err = (g0[k] - gs[k]).abs().max().item()
                if err > 1e-6 * max(1.0, gs[k].abs().max().item()):
                    errors.append(f"{name} step {step}: {k} DDP vs single process, max abs diff {err:.2e}")
    print(f"DDP (gloo, 2 ranks, 2 SGD steps) checked: {', '.join(names)}; "
          f"not there yet: {', '.join(n for n in SPECS if n not in names) or 'none'}")
    assert not errors, "\n".join(errors)

"""The PyTorch contender of ``bench_training.py --torch``: the same MLP training step in
PyTorch, in one process and with DistributedDataParallel (DDP) over gloo.

This script runs under a separate interpreter that has PyTorch (a CPU build), by default
``benchmarks/.torch-venv`` (``bench_training.py --torch`` makes it; by hand:
``~/.pyenv/versions/3.11.7/bin/python -m venv benchmarks/.torch-venv &&
benchmarks/.torch-venv/bin/pip install torch==2.13.0``).  It does not import synkhronos,
PyTensor or numpy.

What a step is, as in ``bench_training.py``: gather the batch's rows from the training set
(``X[idx]``, ``idx`` a shuffled index array made before the timing), forward (Linear +
ReLU layers, last layer linear), softmax cross-entropy (``F.cross_entropy``, mean over the
batch), backward, optimizer step (``torch.optim.Adam`` or ``SGD``, ``fused=True``: the
fastest of PyTorch's three implementations on CPU here).  Everything is float32.

* ``single``: one process, ``torch.set_num_threads(threads)`` (all cores by default).
* ``ddp``: ``world`` processes (started once, ``spawn``), each ``torch.set_num_threads(1)``,
  ``torch.distributed`` with the gloo backend over loopback (``tcp://127.0.0.1``,
  ``GLOO_SOCKET_IFNAME=lo``), the model wrapped in ``DistributedDataParallel`` (default
  buckets; the all-reduce of the gradients overlaps the backward pass); each rank takes its
  contiguous share of every batch's rows (``batch / world`` rows), as synkhronos' ranks do.
  The ranks start each timed run together (a barrier); the time reported is the slowest
  rank's.

Two ways to run it:

``serve`` (what ``bench_training.py`` uses): JSON lines on stdin, one reply line on stdout
each, so that the caller can interleave PyTorch's runs with its own (a change of load on a
shared machine then affects all contenders alike).  The first line out is
``{"ready": true, "torch": version, ...}``.  A request
``{"cmd": "run", "who": "single"|"ddp", "sizes": [784, 512, 512, 10], "batch": 256,
"steps": 20, "rule": "adam", "lr": 0.001, "n_rows": 8192, "seed": 0}`` (optionally
``"ddp_kwargs": {...}``, keywords of ``DistributedDataParallel``) runs ``steps``
steps (on the same ``steps`` index arrays every time for that model, batch and contender)
and answers ``{"t": seconds per step, "loss": last loss}`` (``"threads": k`` in a
"single" request sets ``torch.set_num_threads(k)`` for it; default ``--threads``); ``{"cmd": "quit"}`` ends it.
Models, optimizers and data are built on their first request and kept, so a warm-up run
is one more request.

``run`` (standalone): ``python _torch_train.py run --sizes 784,512,512,10 --batches
64,256,1024`` times both contenders (median of ``--reps`` runs of ``--steps`` steps, after
a warm-up run) and prints a JSON object.

``device`` (``benchmarks/gpu_check.py``'s PyTorch contender): one process on a GPU (CUDA,
else the CPU), each step's batch from host memory (page-locked, copied without blocking)
and its loss read, as gpu_check's synkhronos and plain PyTensor JAX steps do; float32
matmuls as TF32 on the GPU (``set_float32_matmul_precision("high")``), as JAX's default
there.  ``python _torch_train.py device --sizes 784,1024,1024,10 --batches 256,4096 --rule
sgd --lr 0.01`` prints a JSON object.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message=".*NumPy.*")      # no numpy in this venv: not used

import torch  # noqa: E402

WARM_S = 0.15      # untimed steps before each timed run (bench_training.WARM_S)
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def make_model(sizes):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_optimizer(params, rule, lr):
    cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[rule]
    try:
        return cls(params, lr=lr, fused=True), "fused"
    except (RuntimeError, TypeError, ValueError):      # an older PyTorch without fused on CPU
        return cls(params, lr=lr), "default"


class Contender:
    """One model, optimizer, data set and list of index arrays: ``run()`` times the steps.
    ``rank``/``world``: this process's share of each batch (DDP), else the whole batch."""

    def __init__(self, req, rank=0, world=1, ddp=False):
        sizes, batch, steps = [int(s) for s in req["sizes"]], int(req["batch"]), int(req["steps"])
        seed, n_rows = int(req.get("seed", 0)), int(req.get("n_rows", 8192))
        torch.manual_seed(seed)                              # same initial weights on every rank
        model = make_model(sizes)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model, **req.get("ddp_kwargs", {}))
        self.model, self.ddp = model, ddp
        self.opt, self.impl = make_optimizer(model.parameters(), req.get("rule", "adam"),
                                             float(req.get("lr", 1e-3)))
        g = torch.Generator().manual_seed(seed + 1)
        self.X = torch.rand(n_rows, sizes[0], generator=g)
        self.Y = torch.randint(0, sizes[-1], (n_rows,), generator=g)
        lo, hi = rank * batch // world, (rank + 1) * batch // world
        self.idxs = [torch.randperm(n_rows, generator=g)[:batch][lo:hi].contiguous()
                     for _ in range(steps)]
        self.loss = None

    def step(self, idx):
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(self.X[idx]), self.Y[idx])
        loss.backward()
        self.opt.step()
        return loss

    def run(self):
        end, k = time.perf_counter() + WARM_S, 0      # untimed, as bench_training.timed does:
        while True:                                   # the previous runner's threads may still spin
            self.step(self.idxs[k % len(self.idxs)])
            k += 1
            more = torch.tensor([int(time.perf_counter() < end)])
            if self.ddp:                              # DDP ranks make the same number of steps
                import torch.distributed as dist
                dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                break
        t0 = time.perf_counter()
        for idx in self.idxs:
            loss = self.step(idx)
        t = (time.perf_counter() - t0) / len(self.idxs)
        self.loss = float(loss.detach())
        return t


def _key(req):
    return (int(req.get("threads", 0)), tuple(int(s) for s in req["sizes"]), int(req["batch"]),
            int(req["steps"]), req.get("rule", "adam"), float(req.get("lr", 1e-3)),
            int(req.get("seed", 0)), int(req.get("n_rows", 8192)),
            json.dumps(req.get("ddp_kwargs", {}), sort_keys=True))


def _ddp_rank(rank, world, port, conn):
    """One DDP rank: 1 thread, gloo over loopback; runs the requests that ``conn`` brings."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    states = {}
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:                                 # the server is gone
                break
            if req is None:
                break
            try:
                k = _key(req)
                if k not in states:
                    states[k] = Contender(req, rank, world, ddp=True)
                c = states[k]
                dist.barrier()                               # start together
                t = c.run()
                conn.send({"t": t, "loss": c.loss, "impl": c.impl})
            except Exception as e:                           # reported by the server
                conn.send({"error": f"rank {rank}: {type(e).__name__}: {e}"})
    finally:
        dist.destroy_process_group()


class DDP:
    """``world`` DDP ranks in child processes (spawned once), driven through pipes."""

    def __init__(self, world=2):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        with socket.socket() as s:                           # a free port on loopback
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(world):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_ddp_rank, args=(rank, world, port, b), daemon=True)
            p.start()
            b.close()
            self.conns.append(a)
            self.procs.append(p)
        self.world = world

    def run(self, req):
        for c in self.conns:
            c.send(req)
        replies = []
        for rank, (c, p) in enumerate(zip(self.conns, self.procs)):
            t_end = time.monotonic() + 600
            while not c.poll(0.5):
                if not p.is_alive():
                    raise RuntimeError(f"DDP rank {rank} died (exit code {p.exitcode})")
                if time.monotonic() > t_end:
                    raise RuntimeError(f"DDP rank {rank} did not answer in 600 s")
            replies.append(c.recv())
        errs = [r["error"] for r in replies if "error" in r]
        if errs:
            raise RuntimeError("; ".join(errs))
        return {"t": max(r["t"] for r in replies), "loss": replies[0]["loss"],
                "impl": replies[0]["impl"], "ranks_t": [r["t"] for r in replies]}

    def close(self):
        for c in self.conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)


class Server:
    def __init__(self, threads, world):
        self.threads, self.world = threads, world
        torch.set_num_threads(threads)
        self.single = {}
        self.ddp = None

    def handle(self, req):
        if req.get("who") == "ddp":
            if self.ddp is None:
                self.ddp = DDP(self.world)
            return self.ddp.run(req)
        threads = int(req.get("threads") or self.threads)
        req = dict(req, threads=threads)
        torch.set_num_threads(threads)
        k = _key(req)
        if k not in self.single:
            self.single[k] = Contender(req)
        c = self.single[k]
        t = c.run()
        return {"t": t, "loss": c.loss, "impl": c.impl}

    def close(self):
        if self.ddp is not None:
            self.ddp.close()


def info(threads, world):
    return {"torch": torch.__version__, "python": sys.version.split()[0], "threads": threads,
            "ddp_world": world, "ddp_threads_per_rank": 1, "backend": "gloo",
            "mkldnn": torch.backends.mkldnn.is_available(),
            "blas": torch.__config__.show().count("BLAS_INFO=mkl") and "mkl" or "other"}


def serve(args):
    srv = Server(args.threads, args.world)
    out = sys.stdout
    out.write(json.dumps(dict(ready=True, **info(args.threads, args.world))) + "\n")
    out.flush()
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            req = json.loads(line)
            if req.get("cmd") == "quit":
                break
            try:
                reply = srv.handle(req)
            except Exception as e:
                reply = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        srv.close()


def standalone(args):
    srv = Server(args.threads, args.world)
    sizes = [int(s) for s in args.sizes.split(",")]
    res = dict(info(args.threads, args.world), sizes=sizes, rule=args.rule, steps=args.steps,
               reps=args.reps, rows=[])
    try:
        for b in [int(b) for b in args.batches.split(",")]:
            row = {"batch": b}
            for who, threads in (("single", args.threads), ("single", 1), ("ddp", 1)):
                req = dict(cmd="run", who=who, sizes=sizes, batch=b, steps=args.steps,
                           rule=args.rule, lr=args.lr, threads=threads)
                srv.handle(req)                                   # warm-up
                ts = [srv.handle(req)["t"] for _ in range(args.reps)]
                t = statistics.median(ts)
                label = f"ddp {args.world}x1" if who == "ddp" else f"single {threads} threads"
                row[label] = {"s_per_step": t, "samples_per_s": b / t}
            res["rows"].append(row)
    finally:
        srv.close()
    print(json.dumps(res, indent=1))


def on_device(args):
    """``device``: the step on one device, a batch from host memory every step."""
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.set_float32_matmul_precision("high")
    sizes = [int(s) for s in args.sizes.split(",")]
    res = dict(torch=torch.__version__, python=sys.version.split()[0], device=str(dev),
               gpu=torch.cuda.get_device_name(0) if cuda else None, tf32=cuda, sizes=sizes, rule=args.rule,
               lr=args.lr, rows=[])
    for b in [int(b) for b in args.batches.split(",")]:
        torch.manual_seed(0)
        model = make_model(sizes).to(dev)
        opt, impl = make_optimizer(model.parameters(), args.rule, args.lr)
        g = torch.Generator().manual_seed(1)
        X, Y = torch.rand(b, sizes[0], generator=g), torch.randint(0, sizes[-1], (b,), generator=g)
        if cuda:
            X, Y = X.pin_memory(), Y.pin_memory()

        def step():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(X.to(dev, non_blocking=True)), Y.to(dev, non_blocking=True))
            loss.backward()
            opt.step()
            return float(loss.detach())    # read every step, as the other contenders' steps
        for _ in range(10):
            step()
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            ts.append((time.perf_counter() - t0) / args.steps)
        res["rows"].append({"batch": b, "s_per_step": statistics.median(ts), "optimizer": impl})
    print(json.dumps(res))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("serve", "run", "device"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads of the single process (default: all usable cores)")
    ap.add_argument("--world", type=int, default=2, help="DDP processes, 1 thread each")
    ap.add_argument("--sizes", default="784,512,512,10", help="(run) layer widths")
    ap.add_argument("--batches", default="64,256,1024", help="(run) batch sizes")
    ap.add_argument("--steps", type=int, default=20, help="(run) steps per timed run")
    ap.add_argument("--reps", type=int, default=5, help="(run) timed runs; the median is kept")
    ap.add_argument("--rule", choices=("adam", "sgd"), default="adam")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    {"serve": serve, "run": standalone, "device": on_device}[args.mode](args)


if __name__ == "__main__":
    main()

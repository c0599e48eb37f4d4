"""fp16 all-reduce (``synkhronos.extensions.exchange``) against the float32 all-reduce.

For each size (64 MB of float32 by default, plus smaller ones with ``--sizes``), at n ranks:

* ``fp32``: ``synk.all_reduce(v, "avg")``;
* ``fp16``: ``exchange.all_reduce(v, "avg", compress="fp16", error_feedback=False)``: on
  every rank float32 -> float16 (numba kernel), the comm plane's float16 all-reduce (summed
  in float32), float16 -> float32;
* ``fp16+EF``: the same with error feedback (residual kept per rank);
* ``f16 all_reduce``: the comm plane's all-reduce of the float16 shadow alone (half the
  bytes, what a float16 wire would cost without the conversions).

Each in two cases: **steady** (the variable still holds the previous result: the float32
path finds it in its shared-memory slot, the best case for float32) and **fresh** (a
function, ``v <- -v``, has just replaced the value in every rank, as a gradient is in
training: the float32 path must first copy it into its slot; the replacing call is not
timed).  Medians
over ``--reps`` repetitions after a warm-up; every path is timed in turn in each round, so
load from other programs hits all alike.  Also timed in one process: the conversion
kernels against numpy's casts, and the accuracy of the fp16 result against float32.

``--mpi`` runs the same program under ``mpiexec`` on two simulated hosts (``tests/simhosts.py``,
one rank per host: every all-reduce crosses the hosts; needs root).  Between hosts the comm
plane widens float16 to float32 before MPI (MPI has no float16 type), so there fp16 moves
as many bytes as float32.

Also the parameter server (``ParameterServer.run``, n - 1 workers): the time per applied
update of a model whose gradient has the size (trivial compute: a round trip is the
gradient up, the update rule in the master, the weights down); under ``--mpi`` the worker
is on the other host (its host's agent relays it, ``backends.mpi.channel``).

Prints a table; saves ``benchmarks/results/exchange_allreduce.json``.

Usage: python benchmarks/bench_exchange.py [--n 2] [--sizes 64] [--reps 15] [--mpi]"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from common import write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MB = 1 << 20
PATHS = ("fp32", "fp16", "fp16+EF", "f16 all_reduce")


def timed(fn, before=None):
    if before is not None:
        before()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def kernels(size, reps):
    """Conversions of ``size`` bytes of float32 in this process: numba kernels vs numpy."""
    from synkhronos.kernels import half
    n = size // 4
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    h = np.empty(n, np.float16)
    r = np.zeros(n, np.float32)
    r2 = np.empty(n, np.float32)
    y = np.empty(n, np.float32)
    work = {"compress (numba)": lambda: half.compress(x, h),
            "compress + error feedback (numba)": lambda: half.compress(x, h, r, r2),
            "decompress (numba)": lambda: half.decompress(h, y),
            "float32 -> float16 (numpy astype)": lambda: np.copyto(h, x, casting="unsafe"),
            "float16 -> float32 (numpy astype)": lambda: np.copyto(y, h),
            "copy float32 (np.copyto)": lambda: np.copyto(y, x)}
    out = {}
    for name, fn in work.items():
        fn()
        out[name] = float(np.median([timed(fn) for _ in range(max(3, reps // 3))]))
    return out


def child(spec):
    """The measurements, in one synkhronos session (run directly, or under mpiexec)."""
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import exchange, updates
    n = synk.fork(spec["n"])
    try:
        sizes = [int(s * MB) for s in spec["sizes"]]
        top = max(sizes) // 4
        v32 = pytensor.shared(np.zeros(top, np.float32), name="v32")
        v16 = pytensor.shared(np.zeros(top, np.float32), name="v16")
        vef = pytensor.shared(np.zeros(top, np.float32), name="vef")
        ar16 = exchange.Fp16AllReduce([v16], error_feedback=False)
        aref = exchange.Fp16AllReduce([vef], error_feedback=True)
        replace = {v: synk.function([], updates=[(v, -v)], name=f"replace_{v.name}") for v in (v32, v16, vef)}
        servers = {}
        for size in sizes:                # a gradient of ``size`` bytes, computed at no cost
            pv = pytensor.shared(np.zeros(size // 4, np.float32), name=f"pv{size}")
            px = T.matrix(f"px{size}", dtype="float32")
            servers[size] = exchange.ParameterServer(T.sum(pv) * T.mean(px), [pv], [px], updates.sgd,
                                                     learning_rate=1e-6, name=f"ps{size}")
        synk.distribute()
        px_data = synk.data(np.ones((8 * n, 2), np.float32))
        rng = np.random.default_rng(1)
        res = {"n": n, "sizes": spec["sizes"], "steady": {}, "fresh": {}, "accuracy": {}, "ps": {}}
        for size in sizes:
            m = size // 4
            vals = [(rng.standard_normal(m) * 1e-2).astype(np.float32) for _ in range(n)]
            for r in range(n):
                synk.set_value(r, [v32, v16, vef], [vals[r]] * 3)
            for fn in replace.values():                       # (compiles)
                fn()
            synk.all_reduce(v32, "avg")
            ar16("avg")
            want = synk.get_value(0, v32)
            got = synk.get_value(0, v16)
            res["accuracy"][size] = float(np.abs(got - want).max() / np.abs(want).max())
            fns = {"fp32": lambda: synk.all_reduce(v32, "avg"), "fp16": lambda: ar16("avg"),
                   "fp16+EF": lambda: aref("avg"),
                   "f16 all_reduce": lambda: synk.all_reduce(ar16.shadows[0], "avg")}
            var_of = {"fp32": v32, "fp16": v16, "fp16+EF": vef}
            for case in ("steady", "fresh"):
                ts = {k: [] for k in fns}
                paths = [k for k in fns if case == "steady" or k in var_of]   # a shadow is never replaced
                before = {k: replace[var_of[k]] if case == "fresh" else None for k in paths}
                for k in paths:                               # warm-up
                    timed(fns[k], before[k])
                for _ in range(spec["reps"]):
                    for k in paths:
                        ts[k].append(timed(fns[k], before[k]))
                res[case][size] = {k: float(np.median(t)) for k, t in ts.items() if t}
            ps = servers[size]
            ps.run(px_data, steps=2, batch_size=1, verbose=False, sync=False)         # (compiles)
            per = []
            for _ in range(3):
                r = ps.run(px_data, steps=spec["reps"], batch_size=1, verbose=False, sync=False)
                per.append(r.seconds / r.applied)
            res["ps"][size] = float(np.median(per))
            print(f"  {size // MB} MB done", file=sys.stderr, flush=True)
        res["kernels"] = kernels(max(sizes), spec["reps"])
        return res
    finally:
        synk.close()


def run_mpi(spec, shm_size):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import simhosts
    ok, why = simhosts.available()
    if not ok:
        raise SystemExit(f"--mpi needs simulated hosts: {why}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        with simhosts.SimHosts(("hA", "hB"), shm_size=shm_size) as hosts:
            cmd = hosts.mpiexec_cmd(2, 1, [sys.executable, os.path.abspath(__file__), "--child",
                                           json.dumps(dict(spec, out=out))])
            p = hosts.run(cmd, timeout=1800, cwd=ROOT)
            if p.returncode != 0:
                raise RuntimeError(f"mpiexec failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        with open(out) as fh:
            return json.load(fh)


def table(res, title):
    lines = [title, f"{'size':>6} {'case':>7} " + " ".join(f"{p:>15}" for p in PATHS) + "   fp16/fp32"]
    for size in res["steady"]:
        for case in ("steady", "fresh"):
            t = res[case][size]
            cells = " ".join(f"{t[p] * 1e3:12.2f} ms" if p in t else f"{'-':>15}" for p in PATHS)
            lines.append(f"{int(size) // MB:4d}MB {case:>7} {cells}   {t['fp16'] / t['fp32']:6.2f}x")
    acc = ", ".join(f"{int(s) // MB} MB: {a:.1e}" for s, a in res["accuracy"].items())
    lines.append(f"max |fp16 - fp32| / max |fp32|: {acc}")
    if res.get("ps"):
        per = ", ".join(f"{int(s) // MB} MB: {t * 1e3:.2f} ms" for s, t in res["ps"].items())
        lines.append(f"parameter server, time per update (one worker's round trip): {per}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--sizes", default="64", help="MB of float32, comma-separated (default 64)")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--mpi", action="store_true", help="also on two simulated hosts (root)")
    p.add_argument("--shm-size", default="2g", help="each simulated host's /dev/shm (default 2g)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        spec = json.loads(a.child)
        res = child(spec)
        if spec.get("out"):
            with open(spec["out"], "w") as fh:
                json.dump(res, fh)
        return res
    spec = {"n": a.n, "sizes": [float(s) for s in a.sizes.split(",")], "reps": a.reps}
    results = {"shm": child(spec)}
    print(table(results["shm"], f"shared memory, one host, n = {results['shm']['n']} (medians)"))
    print("conversions of the largest size in one process:")
    for k, t in results["shm"]["kernels"].items():
        print(f"  {k:38s} {t * 1e3:8.2f} ms")
    if a.mpi:
        results["mpi"] = run_mpi(dict(spec, n=2), a.shm_size)
        print(table(results["mpi"], "two simulated hosts (mpiexec), one rank each (medians)"))
    path = write_results(results, "exchange_allreduce.json")
    print(f"saved {path}")
    return results


if __name__ == "__main__":
    main()

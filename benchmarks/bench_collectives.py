"""Collectives benchmark (issue 4): ``synk.all_reduce`` and ``synk.broadcast`` of float32
buffers from 4 KB to 256 MB at n=2 CPU ranks, beside mpi4py's ``Allreduce``/``Bcast``
(MPICH, ``mpiexec -n 2``, run as a separate process: benchmarks/_mpi_collectives.py) and
beside one ``np.copyto`` of the same buffer (the memory-bandwidth bound).

Times are medians over all repetitions (after a warm-up) of several rounds; each round
measures synkhronos, then mpi4py, then copyto, so that load from other processes on a shared
machine affects all of them alike.  A synkhronos time is measured in the master from the
call until every worker has replied; an MPI time is the slowest rank's, after a barrier.
Bandwidths use the nccl-tests formulas: algbw = bytes / time; busbw = algbw * 2(n-1)/n for
all_reduce, algbw for broadcast.  "copy-in" is all_reduce right after a function update has replaced the
variable's storage with a new array in every rank (the value must first be copied into
shared memory), the usual case in a training loop.

Prints tables and the targets, saves benchmarks/results/collectives.csv and
benchmarks/results/collectives.png.

Usage: python benchmarks/bench_collectives.py [--quick] [--n 2] [--max-mb 256] [--no-mpi]"""
import argparse
import csv
import json
import os
import subprocess
import sys
import time

import numpy as np
from tqdm import tqdm

from common import pyplot

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
KB, MB = 1 << 10, 1 << 20


def sizes_and_reps(max_mb, quick):
    sizes, s = [], 4 * KB
    while s <= max_mb * MB:
        sizes.append(s)
        s *= 4
    reps = []
    for s in sizes:
        if s <= 64 * KB:
            r = 300
        elif s <= MB:
            r = 100
        elif s <= 16 * MB:
            r = 30
        elif s <= 64 * MB:
            r = 15
        else:
            r = 7
        reps.append(max(5, r // 5) if quick else r)
    return sizes, reps


def median(ts):
    return float(np.median(ts))


def timed(fn, warmup, reps, before=None):
    ts = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        if i >= warmup:
            ts.append(dt)
    return ts


def bench_copyto(sizes, reps, warmup, bar, out):
    for size, r in zip(sizes, reps):
        a = np.ones(size // 4, np.float32)
        b = np.empty_like(a)
        out.setdefault(size, []).extend(timed(lambda: np.copyto(b, a), warmup, r))
        bar.update()


class SynkBench:
    """One synkhronos session: ``v`` (registered by a function that is never called) and
    ``c``, whose storage the function ``replace`` (update ``c <- -c``) replaces in every rank."""

    def __init__(self, n):
        import pytensor
        import synkhronos as synk
        self.synk, self.n = synk, n
        synk.fork(n_parallel=n)
        self.v = pytensor.shared(np.zeros(1, np.float32), name="v")
        self.c = pytensor.shared(np.zeros(1, np.float32), name="c")
        synk.function([], outputs=self.v.sum())
        self.replace = synk.function([], updates=[(self.c, -self.c)])
        synk.distribute()
        synk.broadcast(self.c, np.ones(1, np.float32))
        self.replace()                                       # JIT before timing

    def run(self, sizes, reps, warmup, bar, out):
        synk, v, c = self.synk, self.v, self.c
        for size, r in zip(sizes, reps):
            val = np.full(size // 4, 1.0 / self.n, np.float32)
            synk.broadcast([v, c], [val, val])
            out["all_reduce"].setdefault(size, []).extend(
                timed(lambda: synk.all_reduce(v, op="sum"), warmup, r))
            bar.update()
            out["all_reduce_copy_in"].setdefault(size, []).extend(
                timed(lambda: synk.all_reduce(c, op="sum"), warmup, r, before=self.replace))
            bar.update()
            out["broadcast"].setdefault(size, []).extend(timed(lambda: synk.broadcast(v), warmup, r))
            bar.update()
            g = synk.gather(v)                               # sanity: every rank has the value
            assert np.array_equal(g[0], g[-1])

    def close(self):
        self.synk.close()


def bench_mpi(sizes, reps, warmup, n, bar, out):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    spec = json.dumps({"sizes": sizes, "reps": reps, "warmup": warmup})
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([mpiexec, "-n", str(n), sys.executable,
                           os.path.join(HERE, "_mpi_collectives.py"), spec],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    raw = json.loads(line)
    for key, op in (("allreduce", "all_reduce"), ("bcast", "broadcast")):
        for k, ts in raw[key].items():
            out[op].setdefault(int(k), []).extend(ts)
    bar.update(2 * len(sizes))


def fmt_size(s):
    return f"{s // MB} MB" if s >= MB else f"{s // KB} KB"


def bw(op, size, t, n):
    alg = size / t / 1e9
    return alg, alg * (2 * (n - 1) / n if op == "all_reduce" else 1.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--n", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--max-mb", type=int, default=256, help="largest buffer in MB (default 256)")
    ap.add_argument("--no-mpi", action="store_true", help="skip the mpi4py comparison")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (synkhronos, mpi4py, copyto) measurements, interleaved so that "
                         "load from other processes affects all alike (default 3)")
    ap.add_argument("--out", default=RESULTS, help="directory for the CSV and the figure")
    args = ap.parse_args()
    n = args.n
    sizes, reps = sizes_and_reps(args.max_mb, args.quick)
    warmup = 3
    rounds = max(1, args.rounds)
    reps = [max(3, -(-r // rounds)) for r in reps]
    steps = rounds * len(sizes) * (1 + 3 + (0 if args.no_mpi else 2))
    t_start = time.perf_counter()
    raw_synk = {"all_reduce": {}, "all_reduce_copy_in": {}, "broadcast": {}}
    raw_mpi = {"all_reduce": {}, "broadcast": {}}
    raw_copy = {}
    with tqdm(total=steps, desc="collectives", unit="step") as bar:
        sb = SynkBench(n)
        try:
            for _ in range(rounds):
                sb.run(sizes, reps, warmup, bar, raw_synk)
                if not args.no_mpi:
                    bench_mpi(sizes, reps, warmup, n, bar, raw_mpi)
                bench_copyto(sizes, reps, warmup, bar, raw_copy)
        finally:
            sb.close()
    synk_res = {op: {s: median(ts) for s, ts in d.items()} for op, d in raw_synk.items()}
    mpi_res = None if args.no_mpi else {op: {s: median(ts) for s, ts in d.items()}
                                        for op, d in raw_mpi.items()}
    copy_res = {s: median(ts) for s, ts in raw_copy.items()}

    rows = []
    for size in sizes:
        rows.append(("copyto", "numpy", size, copy_res[size]))
        for op in ("all_reduce", "broadcast"):
            rows.append((op, "synk", size, synk_res[op][size]))
            if mpi_res:
                rows.append((op, "mpi4py", size, mpi_res[op][size]))
        rows.append(("all_reduce", "synk copy-in", size, synk_res["all_reduce_copy_in"][size]))
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, "collectives.csv")
    with open(csv_path, "w", newline="") as fh:
        wr = csv.writer(fh)
        wr.writerow(["op", "impl", "n", "bytes", "time_us", "algbw_GBps", "busbw_GBps"])
        for op, impl, size, t in rows:
            alg, bus = bw("broadcast" if op == "copyto" else op, size, t, n)
            wr.writerow([op, impl, n, size, f"{t * 1e6:.2f}", f"{alg:.3f}", f"{bus:.3f}"])

    def us(t):
        return f"{t * 1e6:10.1f}"

    print(f"\nall_reduce (sum, float32, n={n}): time [us], algbw / busbw [GB/s]")
    hdr = f"{'size':>7} | {'copyto':>10} | {'synk':>10} {'alg':>6} {'bus':>6} | {'copy-in':>10} {'bus':>6}"
    if mpi_res:
        hdr += f" | {'mpi4py':>10} {'alg':>6} {'bus':>6} | {'mpi/synk':>8}"
    print(hdr)
    print("-" * len(hdr))
    for size in sizes:
        t = synk_res["all_reduce"][size]
        tc = synk_res["all_reduce_copy_in"][size]
        a, b = bw("all_reduce", size, t, n)
        _, bc = bw("all_reduce", size, tc, n)
        line = f"{fmt_size(size):>7} | {us(copy_res[size])} | {us(t)} {a:6.2f} {b:6.2f} | {us(tc)} {bc:6.2f}"
        if mpi_res:
            tm = mpi_res["all_reduce"][size]
            am, bm = bw("all_reduce", size, tm, n)
            line += f" | {us(tm)} {am:6.2f} {bm:6.2f} | {tm / t:8.2f}"
        print(line)

    print(f"\nbroadcast (float32, n={n}): time [us], algbw = busbw [GB/s]")
    hdr = f"{'size':>7} | {'copyto':>10} | {'synk':>10} {'bw':>6}"
    if mpi_res:
        hdr += f" | {'mpi4py':>10} {'bw':>6} | {'mpi/synk':>8}"
    print(hdr)
    print("-" * len(hdr))
    for size in sizes:
        t = synk_res["broadcast"][size]
        a, _ = bw("broadcast", size, t, n)
        line = f"{fmt_size(size):>7} | {us(copy_res[size])} | {us(t)} {a:6.2f}"
        if mpi_res:
            tm = mpi_res["broadcast"][size]
            am, _ = bw("broadcast", size, tm, n)
            line += f" | {us(tm)} {am:6.2f} | {tm / t:8.2f}"
        print(line)

    print("\ntargets:")
    if 64 * MB in sizes:
        ratio = synk_res["all_reduce"][64 * MB] / copy_res[64 * MB]
        print(f"  64 MB all_reduce / 64 MB np.copyto = {ratio:.2f}  (target <= 2): "
              f"{'ok' if ratio <= 2 else 'MISSED'}")
    lat = synk_res["all_reduce"][sizes[0]] * 1e6
    print(f"  {fmt_size(sizes[0])} all_reduce latency = {lat:.1f} us  (target <= 100): "
          f"{'ok' if lat <= 100 else 'MISSED'}")
    if mpi_res:
        for op in ("all_reduce", "broadcast"):
            slower = [fmt_size(s) for s in sizes if s >= MB and synk_res[op][s] >= mpi_res[op][s]]
            print(f"  {op} faster than mpi4py at every size >= 1 MB: "
                  f"{'ok' if not slower else 'MISSED at ' + ', '.join(slower)}")
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)  {csv_path}")

    plt = pyplot("matplotlib not installed: no figure")
    if plt is None:
        return
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    x = np.array(sizes)
    for col, op in enumerate(("all_reduce", "broadcast")):
        series = [("synk", synk_res[op], "C0", "-o")]
        if op == "all_reduce":
            series.append(("synk copy-in (value just replaced by a function)", synk_res["all_reduce_copy_in"],
                           "C0", "--s"))
        if mpi_res:
            series.append(("mpi4py", mpi_res[op], "C1", "-^"))
        series.append(("np.copyto (bound)", copy_res, "0.5", ":"))
        for label, res, color, style in series:
            t = np.array([res[s] for s in sizes])
            axes[0, col].loglog(x, t * 1e6, style, color=color, label=label)
            bus = np.array([bw("broadcast" if label.startswith("np.") else op, s, res[s], n)[1]
                            for s in sizes])
            axes[1, col].semilogx(x, bus, style, color=color, label=label)
        axes[0, col].set_title(f"{op} (float32, n={n})")
        axes[0, col].set_ylabel("time [us]")
        axes[1, col].set_ylabel("busbw [GB/s]" + (" (copyto: bytes/time)" if col == 0 else ""))
        axes[1, col].set_xlabel("buffer size [bytes]")
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.text(0.01, 0.005, "synk: the variable still holds the previous result, which lies in the shared slot; "
             "synk copy-in: a function has just replaced the value (as a gradient is in training), so it is first "
             "copied into the slot.\nnp.copyto (bound): one copy of the buffer in this process; mpi4py: "
             "Allreduce/Bcast over the same ranks (mpich, mpiexec).", fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    png = os.path.join(args.out, "collectives.png")
    fig.savefig(png, dpi=110)
    print(png)


if __name__ == "__main__":
    main()

"""Multi-host benchmark: synkhronos under ``mpiexec`` on two simulated hosts (hA, hB), 2 ranks
per host (4 ranks in all), every figure measured within one run of this script.

1. ``all_reduce`` (float32, "sum") from 4 KB to 256 MB: synkhronos (``mpiexec -n 2 -ppn 1``,
   ``synk.fork(4)``: 2 ranks per host, hierarchical collectives) against plain mpi4py
   ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` over the same 4 ranks
   (``mpiexec -n 4 -ppn 2``).  A synkhronos time is the master's, from the call until every
   rank of every host is done; the variable's storage stays the collective's result between
   repetitions (as in training).  An mpi4py time is the slowest rank's, after a Barrier.
   Medians over all repetitions (after a warm-up) of ``--rounds`` rounds, each round running
   synkhronos then mpi4py, so that load from other programs affects both alike.  Bandwidths:
   algbw = bytes / time, busbw = algbw * 2(n-1)/n.
2. Per-call overhead of a tiny function (``synk.function([x], (T.sum(x), "sum"))`` on an
   8-element float32 ``synk.data``): 2 hosts x 2 ranks (mpiexec) against the same program
   on one host without MPI (2 ranks, plain ``python``) and against a plain PyTensor call.
3. Time to first step of ``demos/mnist_mlp.py`` (small configuration) on 2 hosts (mpiexec,
   4 ranks) against one host (plain python, 2 ranks): wall time from process start to each
   milestone of its output, and the demo's own figures.  The numba cache is made warm first
   by one untimed run of each.

The programs run under ``mpiexec`` are in ``benchmarks/_mpi_bench_prog.py``; the hosts are
``tests/simhosts.py`` (network, UTS, mount and IPC namespaces, a private tmpfs /dev/shm per
host, joined by a veth pair): **root is needed** (``sudo``).  The hosts share this machine's
CPUs, so on a 2-core machine 4 ranks, the MPI processes and the launchers compete for 2
cores: read the absolute numbers with that in mind (the ratios are taken in one run).

Prints a line per measurement and tables; saves ``benchmarks/results/mpi.json`` and
``benchmarks/results/mpi.png``.  Checks after every program that no process and no
/dev/shm entry is left in either host, and at the end that nothing is left on this machine.

Usage (from the repository root)::

    sudo .venv/bin/python benchmarks/bench_mpi.py            # ~3 minutes on 2 cores
    sudo .venv/bin/python benchmarks/bench_mpi.py --quick    # fewer repetitions, 1 round
    options: --rounds N, --max-mb MB, --shm-size SIZE, --skip-demo, --out DIR
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
PROG = os.path.join(HERE, "_mpi_bench_prog.py")
DEMO = os.path.join(ROOT, "demos", "mnist_mlp.py")
KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
HOSTS = ("hA", "hB")
N_RANKS = 4            # 2 hosts x 2 ranks
DEMO_ARGS = ["--epochs", "1", "--train-subset", "400", "--batch-size", "128", "--no-progress"]
MAX_CALLS = 90         # all_reduce calls per size: 2**-60 * 4**90 = 2**120 < float32 max

sys.path.insert(0, os.path.join(ROOT, "tests"))
import simhosts  # noqa: E402  (tests/simhosts.py)

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def fmt_size(s):
    return f"{s // GB} GB" if s >= GB else f"{s // MB} MB" if s >= MB else f"{s // KB} KB"


def fmt_t(t):
    return f"{t * 1e3:.2f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


def sizes_and_reps(max_mb, quick):
    sizes = [s for s in (4 * KB, 64 * KB, MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB) if s <= max_mb * MB]
    table = {4 * KB: 40, 64 * KB: 40, MB: 30, 4 * MB: 20, 16 * MB: 12, 64 * MB: 7, 256 * MB: 5}
    reps = [max(3, table[s] // 3) if quick else table[s] for s in sizes]
    return sizes, reps, 2 if quick else 3


def shm_used(hosts, host):
    st = os.statvfs(hosts.shm_path(host))
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class CpuShare:
    """Share of the machine's CPU (0..1) busy between creation and ``share()`` (/proc/stat)."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4], sum(v)

    def share(self):
        b1, t1 = self._read()
        return (b1 - self.start[0]) / max(1, t1 - self.start[1])


class Bench:
    def __init__(self, hosts, tmp, args):
        self.hosts, self.tmp, self.args = hosts, tmp, args
        self.py = sys.executable
        self.issues = []
        self.shm_peak = {h: 0 for h in HOSTS}
        self.k = 0
        self.prefix_log = os.path.join(tmp, "prefixes.log")   # every session prefix made
        self.prefixes = []
        self.run_tmp = os.path.join(tmp, "tmp")    # TMPDIR of the programs (and of mpiexec)
        os.mkdir(self.run_tmp, 0o700)

    # ---- running one program -----------------------------------------------------------
    def run(self, label, cmd, on_result=None, timeout=600):
        """Run ``cmd`` (argv already placed on a host) with output lines timestamped (s since
        start), follow its result file (``on_result`` per BENCH line as it appears); return
        (returncode, [(t, line)], [results], wall)."""
        self.k += 1
        rfile = os.path.join(self.tmp, f"result{self.k}.jsonl")
        env = {"SYNK_RESULT_FILE": rfile, "PYTHONUNBUFFERED": "1",
               "SYNK_PREFIX_LOG": self.prefix_log, "TMPDIR": self.run_tmp}
        lines, results = [], []
        t0 = time.perf_counter()
        p = self.hosts.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, text=True, cwd=ROOT)

        def reader():
            for ln in p.stdout:
                lines.append((time.perf_counter() - t0, ln.rstrip("\n")))
        th = threading.Thread(target=reader, daemon=True)
        th.start()
        seen = 0

        def follow():
            nonlocal seen
            if not os.path.exists(rfile):
                return
            with open(rfile) as fh:
                fh.seek(seen)
                chunk = fh.read()
            done = chunk[:chunk.rfind("\n") + 1]
            seen += len(done.encode())
            for ln in done.splitlines():
                if ln.startswith("BENCH "):
                    r = json.loads(ln[6:])
                    results.append(r)
                    if on_result:
                        on_result(r)
        timed_out = False
        while p.poll() is None:
            follow()
            for h in HOSTS:
                try:
                    self.shm_peak[h] = max(self.shm_peak[h], shm_used(self.hosts, h))
                except OSError:
                    pass
            if time.perf_counter() - t0 > timeout:
                timed_out = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.hosts.kill_all()
                break
            time.sleep(0.1)
        p.wait()
        wall = time.perf_counter() - t0
        th.join(10)
        p.stdout.close()
        follow()
        if os.path.exists(rfile):
            os.unlink(rfile)
        if os.path.exists(self.prefix_log):
            with open(self.prefix_log) as fh:
                self.prefixes = sorted({ln.strip().lstrip("/") for ln in fh if ln.strip()})
        if timed_out or p.returncode != 0:
            tail = "\n".join(ln for _, ln in lines[-40:])
            self.issues.append(f"{label}: exit {p.returncode}{' (timed out)' if timed_out else ''}")
            log(f"{label} FAILED (exit {p.returncode}{', timed out' if timed_out else ''}):\n{tail}")
        self.check_clean(label)
        return p.returncode, lines, results, wall

    def check_clean(self, label):
        """No process and no /dev/shm entry may be left on either host after a program."""
        if not self.hosts.wait_idle(10):
            left = self.hosts.processes()
            self.issues.append(f"after {label}: processes left {left}")
            log(f"WARNING after {label}: processes left {left}; killing them")
            self.hosts.kill_all()
        left = os.listdir(self.run_tmp)
        if left:
            self.issues.append(f"after {label}: temp files left in TMPDIR: {sorted(left)}")
            log(f"WARNING after {label}: temp files left in TMPDIR {sorted(left)}; removing them")
            for e in left:
                path = os.path.join(self.run_tmp, e)
                shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        t = time.monotonic() + 5
        while any(self.hosts.shm_files().values()) and time.monotonic() < t:
            time.sleep(0.05)
        files = self.hosts.shm_files()
        if any(files.values()):
            self.issues.append(f"after {label}: /dev/shm entries left {files}")
            log(f"WARNING after {label}: /dev/shm entries left {files}; removing them")
            self.hosts.clear_shm()

    def mpiexec(self, n, ppn, argv):
        return self.hosts.mpiexec_cmd(n, ppn, [self.py, *argv])

    def on_host(self, argv, host="hA"):
        return self.hosts.host_argv([self.py, *argv], host)

    # ---- 1. all_reduce -------------------------------------------------------------------
    def allreduce(self, sizes, reps, warm, rounds):
        raw = {"synk": {s: [] for s in sizes}, "mpi4py": {s: [] for s in sizes}}
        per_round = {"synk": {s: [] for s in sizes}, "mpi4py": {s: [] for s in sizes}}
        checks_ok = True
        sessions = {}
        for rnd in range(rounds):
            for impl in ("synk", "mpi4py"):
                def show(r, impl=impl, rnd=rnd):
                    nonlocal checks_ok
                    if r["kind"] == "session":
                        sessions[impl] = r["ranks"]
                        return
                    ts = r["times"]
                    raw[impl][r["size"]] += ts
                    per_round[impl][r["size"]].append(float(np.median(ts)))
                    checks_ok &= bool(r["ok"])
                    log(f"all_reduce {impl:6s} round {rnd + 1}/{rounds} {fmt_size(r['size']):>6}: "
                        f"median {fmt_t(float(np.median(ts)))} over {len(ts)} reps "
                        f"(min {fmt_t(min(ts))}){'' if r['ok'] else '  WRONG RESULT ' + json.dumps(r['check'])}")
                spec = {"sizes": sizes, "reps": reps, "warmup": warm}
                if impl == "synk":
                    spec["n"] = N_RANKS
                    cmd = self.mpiexec(2, 1, [PROG, "synk_allreduce", json.dumps(spec)])
                else:
                    cmd = self.mpiexec(4, 2, [PROG, "mpi_allreduce", json.dumps(spec)])
                rc, _, res, wall = self.run(f"all_reduce {impl} round {rnd + 1}", cmd, show)
                log(f"  (program {impl} round {rnd + 1}: {wall:.1f} s wall, exit {rc})")
        return raw, per_round, checks_ok, sessions

    # ---- 2. per-call overhead --------------------------------------------------------------
    def overhead(self, rounds, blocks, block_s):
        out = {"two_hosts": [], "one_host": []}
        for rnd in range(rounds):
            for where in ("two_hosts", "one_host"):
                if where == "two_hosts":
                    spec = {"n": N_RANKS, "blocks": blocks, "block_s": block_s}
                    cmd = self.mpiexec(2, 1, [PROG, "overhead", json.dumps(spec)])
                else:
                    spec = {"n": 2, "blocks": blocks, "block_s": block_s}
                    cmd = self.on_host([PROG, "overhead", json.dumps(spec)])
                rc, _, res, wall = self.run(f"overhead {where} round {rnd + 1}", cmd)
                for r in res:
                    if r["kind"] == "overhead":
                        out[where].append(r)
                        log(f"per-call {where:9s} round {rnd + 1}/{rounds} ({r['n']} ranks on "
                            f"{', '.join(r['hosts'])}): synk {np.median(r['synk']) * 1e6:.1f} us, "
                            f"plain PyTensor {np.median(r['pytensor']) * 1e6:.2f} us"
                            f"{'' if r['ok'] else '  WRONG RESULT'}")
        return out

    # ---- 3. demo -----------------------------------------------------------------------------
    def demo_cmd(self, where):
        if where == "two_hosts":
            return self.mpiexec(2, 1, [DEMO, *DEMO_ARGS, "--n-parallel", str(N_RANKS)])
        return self.on_host([DEMO, *DEMO_ARGS, "--n-parallel", "2"])

    def demo(self, where, label):
        rc, lines, _, wall = self.run(f"demo {where} {label}", self.demo_cmd(where))
        d = parse_demo(lines)
        d["wall_s"], d["exit"] = wall, rc
        return d


def parse_demo(lines):
    """Milestones (seconds since the process started) and the demo's own figures."""
    d = {}
    for t, ln in lines:
        if "t_fork" not in d and ln.startswith("Synkhronos: ") and "ranks" in ln:
            d["t_fork"] = t
        m = re.search(r"\.\.\.distribution complete \(([\d.]+) s\)", ln)
        if m:
            d["t_distributed"], d["distribute_s"] = t, float(m.group(1))
        if ln.startswith("serial (1 process"):
            d["t_serial_done"] = t
        if ln.startswith("synkhronos (") and "t_first_step" not in d:
            d["t_first_step"] = t
        m = re.match(r"epoch\s+1/\d+\s.*\[([\d.]+) s\]", ln)
        if m and "epoch_s" not in d:
            d["t_epoch1"], d["epoch_s"] = t, float(m.group(1))
        m = re.search(r"first call \(JIT compile or cache load, excluded\): serial ([\d.]+) s, "
                      r"synkhronos ([\d.]+) s \(graph build ([\d.]+) s\)", ln)
        if m:
            d["jit_serial_s"], d["jit_synk_s"], d["graph_build_s"] = map(float, m.groups())
        if ln.startswith("RESULT:"):
            d["result_line"] = ln
            m = re.search(r"test accuracy ([\d.]+)", ln)
            if m:
                d["test_acc"] = float(m.group(1))
    if all(k in d for k in ("t_first_step", "t_serial_done", "t_distributed")):
        d["t_first_step_wo_serial"] = d["t_first_step"] - (d["t_serial_done"] - d["t_distributed"])
    return d


def med(ts):
    return float(np.median(ts)) if len(ts) else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one round")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of (synkhronos, mpi4py) runs, pooled (default 2; 1 with --quick)")
    ap.add_argument("--max-mb", type=int, default=256, help="largest all_reduce buffer (MB)")
    ap.add_argument("--shm-size", default=None,
                    help="tmpfs size of each simulated host's /dev/shm (default: 4g for 256 MB "
                         "buffers, scaled down for smaller --max-mb)")
    ap.add_argument("--skip-demo", action="store_true", help="skip the demo (3.)")
    ap.add_argument("--out", default=RESULTS, help="directory for mpi.json and mpi.png")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    sizes, reps, warm = sizes_and_reps(args.max_mb, args.quick)
    reps = [min(r, MAX_CALLS - warm) for r in reps]
    shm_size = args.shm_size or f"{max(1, -(-16 * max(sizes) // GB))}g"
    ok, why = simhosts.available()
    if not ok:
        sys.exit(f"bench_mpi.py needs simulated hosts: {why} (run it as root: sudo)")
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        sys.exit("no mpiexec next to the interpreter: pip install 'synkhronos[mpi]'")

    cores = len(os.sched_getaffinity(0))
    log(f"bench_mpi: hosts {', '.join(HOSTS)} x 2 ranks, {cores} cores on this machine, "
        f"rounds {rounds}, sizes {', '.join(fmt_size(s) for s in sizes)}, /dev/shm {shm_size} per host")
    idle = CpuShare()
    time.sleep(1.0)
    busy_before = idle.share()
    load_before = os.getloadavg()
    log(f"machine busy before starting (other programs): {busy_before * 100:.0f}% of all cores, "
        f"load average {load_before[0]:.2f}")
    shm_before = set(os.listdir("/dev/shm"))
    prefixes = []
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    tmp = tempfile.mkdtemp(prefix="synk-bench-mpi-")
    res = {"config": dict(hosts=list(HOSTS), ranks=N_RANKS, ranks_per_host=2, cores=cores,
                          rounds=rounds, sizes=sizes, reps=reps, warmup=warm, quick=args.quick,
                          shm_size=shm_size, demo_args=DEMO_ARGS, python=sys.executable,
                          busy_before=busy_before, loadavg_before=load_before[0])}
    during = CpuShare()
    t_all = time.perf_counter()
    try:
        with simhosts.SimHosts(HOSTS, shm_size=shm_size) as hosts:
            b = Bench(hosts, tmp, args)
            if not args.skip_demo:
                for where in ("two_hosts", "one_host"):
                    log(f"warming the numba cache: one untimed run of the demo on {where.replace('_', ' ')}")
                    d = b.demo(where, "warm-up")
                    log(f"  warm-up run done ({d['wall_s']:.1f} s, exit {d['exit']})")
            raw, per_round, checks_ok, sessions = b.allreduce(sizes, reps, warm, rounds)
            ovh = b.overhead(rounds, blocks=5 if args.quick else 7, block_s=0.15 if args.quick else 0.25)
            demos = {"two_hosts": [], "one_host": []}
            if not args.skip_demo:
                for rnd in range(rounds):
                    for where in ("two_hosts", "one_host"):
                        d = b.demo(where, f"round {rnd + 1}")
                        demos[where].append(d)
                        log(f"demo {where:9s} round {rnd + 1}/{rounds}: first step done at "
                            f"{d.get('t_first_step', float('nan')):.2f} s, exit after {d['wall_s']:.2f} s"
                            f" (exit {d['exit']})")
            shm_peak = dict(b.shm_peak)
            issues = b.issues
            prefixes = b.prefixes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    busy_during = during.share()
    total = time.perf_counter() - t_all

    # ---- leftovers on this machine ---------------------------------------------------------
    time.sleep(0.5)
    # (the programs ran inside the hosts' private /dev/shm, checked after each; here: nothing
    # of their sessions may have reached this machine's /dev/shm.  Other programs' entries,
    # e.g. a test suite running meanwhile, are not counted: every session prefix of ours was
    # logged through SYNK_PREFIX_LOG)
    shm_new = sorted(set(os.listdir("/dev/shm")) - shm_before)
    shm_ours = [e for e in shm_new if any(p in e for p in prefixes)]
    tmp_new = sorted(set(os.listdir(tempfile.gettempdir())) - tmp_before)
    mine = [e for e in tmp_new if e.startswith(("synk-bench-mpi-", simhosts.NS_PREFIX))]
    if shm_ours:
        issues.append(f"entries of our sessions in this machine's /dev/shm: {shm_ours}")
    if mine:
        issues.append(f"temp entries left: {mine}")
    left_procs = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cl = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if (PROG in cl or "mnist_mlp.py" in cl and "mpiexec" in cl) and int(pid) != os.getpid():
                left_procs.append((int(pid), cl[:120]))
    if left_procs:
        issues.append(f"processes left: {left_procs}")

    # ---- 1. table ------------------------------------------------------------------------------
    n = N_RANKS
    ar = {}
    print(f"\n1. all_reduce (float32, sum) over 2 hosts x 2 ranks: median time, algbw / busbw "
          f"[GB/s]; ratio = mpi4py / synk (>1: synk faster); per-round ratios in brackets")
    hdr = (f"{'size':>7} | {'synk':>10} {'alg':>6} {'bus':>6} | {'mpi4py':>10} {'alg':>6} {'bus':>6} | "
           f"{'ratio':>6}  {'(per round)':<14}")
    print(hdr)
    print("-" * len(hdr))
    for s in sizes:
        ts, tm = med(raw["synk"][s]), med(raw["mpi4py"][s])
        rr = [m / q for q, m in zip(per_round["synk"][s], per_round["mpi4py"][s])]
        a_s, a_m = s / ts / 1e9, s / tm / 1e9
        f = 2 * (n - 1) / n
        ar[s] = dict(synk_s=ts, mpi4py_s=tm, ratio=tm / ts, ratio_per_round=rr,
                     synk_algbw_GBps=a_s, synk_busbw_GBps=a_s * f, mpi4py_algbw_GBps=a_m,
                     mpi4py_busbw_GBps=a_m * f, synk_times=raw["synk"][s], mpi4py_times=raw["mpi4py"][s])
        print(f"{fmt_size(s):>7} | {fmt_t(ts):>10} {a_s:6.3f} {a_s * f:6.3f} | {fmt_t(tm):>10} "
              f"{a_m:6.3f} {a_m * f:6.3f} | {tm / ts:6.2f}  [{' '.join(f'{x:.2f}' for x in rr)}]")
    big = [s for s in sizes if s >= 4 * MB]
    if big:
        met = [s for s in big if ar[s]["ratio"] >= 1.5]
        listed = ", ".join(f"{fmt_size(s)} {ar[s]['ratio']:.2f}" for s in big)
        print(f"goal (issue): synk >= 1.5x faster than mpi4py from 4 MB up: "
              f"{'MET' if len(met) == len(big) else 'NOT MET'} (ratios {listed})")
    print(f"results checked (every value after the last call, first and last rank): "
          f"{'ok' if checks_ok else 'WRONG RESULTS (see above)'}")

    # ---- 2. table ------------------------------------------------------------------------------
    ov = {}
    print("\n2. per-call time of a tiny function (sum of an 8-element float32 synk.data), median "
          "of blocks [us]")
    for where, label in (("two_hosts", "synk, 2 hosts x 2 ranks (mpiexec)"),
                         ("one_host", "synk, 1 host x 2 ranks (no MPI)")):
        rs = ovh[where]
        s_all = [t for r in rs for t in r["synk"]]
        p_all = [t for r in rs for t in r["pytensor"]]
        ov[where] = dict(synk_us=med(s_all) * 1e6, pytensor_us=med(p_all) * 1e6,
                         synk_blocks_us=[t * 1e6 for t in s_all],
                         per_round_us=[med(r["synk"]) * 1e6 for r in rs],
                         ok=all(r["ok"] for r in rs), n=rs[0]["n"] if rs else None)
    if ov["two_hosts"]["n"] and ov["one_host"]["n"]:
        pt_us = med([t * 1e6 for w in ("two_hosts", "one_host") for r in ovh[w] for t in r["pytensor"]])
        t2, t1 = ov["two_hosts"]["synk_us"], ov["one_host"]["synk_us"]
        print(f"  {'plain PyTensor call':38s} {pt_us:10.2f}")
        print(f"  {'synk, 1 host x 2 ranks (no MPI)':38s} {t1:10.1f}   (+{t1 - pt_us:.1f} over PyTensor)"
              f"   per round {' '.join(f'{x:.1f}' for x in ov['one_host']['per_round_us'])}")
        print(f"  {'synk, 2 hosts x 2 ranks (mpiexec)':38s} {t2:10.1f}   (+{t2 - pt_us:.1f}; "
              f"{t2 / t1:.1f}x one host)   per round "
              f"{' '.join(f'{x:.1f}' for x in ov['two_hosts']['per_round_us'])}")
        ov["pytensor_us"] = pt_us
        ov["two_over_one_host"] = t2 / t1

    # ---- 3. table ------------------------------------------------------------------------------
    dm = {}
    if not args.skip_demo:
        print(f"\n3. demos/mnist_mlp.py {' '.join(DEMO_ARGS)} (numba cache warm: one untimed run "
              f"of each first): seconds since process start, median of {rounds} run(s)")
        keys = [("t_fork", "synk.fork() done"), ("t_distributed", "distribute() done"),
                ("t_serial_done", "serial baseline done (demo's own)"),
                ("t_first_step", "first synk step (+first evaluate) done"),
                ("t_first_step_wo_serial", "  same, minus the serial-baseline span"),
                ("wall_s", "process exit"), ("distribute_s", "demo: distribute() took"),
                ("jit_synk_s", "demo: synk first call (excluded)"),
                ("jit_serial_s", "demo: serial first call (excluded)"),
                ("graph_build_s", "demo: graph build"), ("epoch_s", "demo: synk epoch (3 steps)")]
        print(f"  {'':42s} {'2 hosts (4 ranks)':>18s} {'1 host (2 ranks)':>17s}")
        for k, label in keys:
            v2 = med([d[k] for d in demos["two_hosts"] if k in d])
            v1 = med([d[k] for d in demos["one_host"] if k in d])
            dm[k] = {"two_hosts": v2, "one_host": v1}
            print(f"  {label:42s} {v2:18.2f} {v1:17.2f}")
        dm["runs"] = demos
        for where in ("two_hosts", "one_host"):
            for d in demos[where][:1]:
                print(f"  {where}: {d.get('result_line', '(no RESULT line)')}")

    # ---- summary ---------------------------------------------------------------------------------
    print(f"\nmachine: {cores} cores; other programs kept {busy_before * 100:.0f}% busy before; "
          f"whole machine {busy_during * 100:.0f}% busy during the benchmark; "
          f"peak /dev/shm use hA {shm_peak['hA'] / MB:.0f} MB, hB {shm_peak['hB'] / MB:.0f} MB "
          f"(of {shm_size} each)")
    print("clean-up: " + ("nothing left (processes, /dev/shm of both hosts and of this machine, "
                          "temp files)" if not issues else "PROBLEMS: " + "; ".join(issues)))
    print(f"  ({len(prefixes)} synkhronos session prefixes made on the hosts; entries of them in this "
          f"machine's /dev/shm: {len(shm_ours)})")
    if len(shm_new) > len(shm_ours):
        print(f"  (this machine's /dev/shm got {len(shm_new) - len(shm_ours)} entries from other "
              f"programs meanwhile, not from this benchmark)")
    other_tmp = [e for e in tmp_new if e not in mine]
    if other_tmp:
        print(f"  ({len(other_tmp)} new entries in {tempfile.gettempdir()} meanwhile, none of them this "
              f"benchmark's (temp dirs synk-bench-mpi-*, {simhosts.NS_PREFIX}-*), e.g. {other_tmp[:3]})")
    print(f"total {total:.0f} s")
    res.update(allreduce={str(s): v for s, v in ar.items()}, overhead=ov, demo=dm,
               machine=dict(busy_during=busy_during, shm_peak_bytes=shm_peak,
                            loadavg_after=os.getloadavg()[0]),
               sessions=sessions, session_prefixes=len(prefixes), checks_ok=checks_ok, issues=issues, total_s=total)
    os.makedirs(args.out, exist_ok=True)
    jpath = os.path.join(args.out, "mpi.json")
    with open(jpath, "w") as fh:
        json.dump(res, fh, indent=1)
    print(jpath)
    plot(sizes, ar, ov, os.path.join(args.out, "mpi.png"))


def plot(sizes, ar, ov, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure")
        return
    x = np.array(sizes)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.3))
    for impl, style, color in (("synk", "-o", "C0"), ("mpi4py", "-^", "C1")):
        ax[0].loglog(x, [ar[s][f"{impl}_s"] * 1e3 for s in sizes], style, color=color,
                     label="synkhronos (hierarchical)" if impl == "synk" else "mpi4py Allreduce")
        ax[1].loglog(x, [ar[s][f"{impl}_busbw_GBps"] for s in sizes], style, color=color, label=impl)
    ax[0].set_ylabel("time [ms]")
    ax[0].set_title("all_reduce float32, 2 hosts x 2 ranks")
    ax[1].set_ylabel("busbw [GB/s]")
    ax[1].set_title("bus bandwidth (algbw x 2(n-1)/n)")
    ratio = [ar[s]["ratio"] for s in sizes]
    ax[2].semilogx(x, ratio, "-o", color="C2", label="mpi4py / synk (pooled median)")
    for i, s in enumerate(sizes):
        rr = ar[s]["ratio_per_round"]
        ax[2].plot([s] * len(rr), rr, "x", color="0.5", label="per round" if i == 0 else None)
    ax[2].axhline(1.0, color="0.3", lw=0.8)
    ax[2].axhline(1.5, color="C3", ls="--", lw=0.8, label="goal from 4 MB: 1.5")
    ax[2].set_ylabel("time ratio (>1: synk faster)")
    ax[2].set_title("ratio")
    for a in ax:
        a.set_xlabel("buffer size [bytes]")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    if ov.get("pytensor_us") is not None:
        fig.suptitle(f"per-call tiny function: PyTensor {ov['pytensor_us']:.1f} us, synk 1 host "
                     f"{ov['one_host']['synk_us']:.0f} us, synk 2 hosts {ov['two_hosts']['synk_us']:.0f} us",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(path)


if __name__ == "__main__":
    main()

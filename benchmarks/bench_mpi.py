"""Multi-host benchmark: synkhronos under ``mpiexec`` on two simulated hosts (hA, hB), one rank
per host (``--per-host 2``: two, 4 ranks in all), every figure measured within one run of
this script.

1. ``all_reduce`` (float32, "sum") from 4 KB to 256 MB: synkhronos (``mpiexec -n 2 -ppn 1``,
   ``synk.fork(2)``, or ``fork(4)`` with 2 ranks per host: hierarchical collectives) against
   plain mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`` over as many MPI
   processes placed alike (``mpiexec -n 2 -ppn 1``, ``-n 4 -ppn 2``); the goal: synkhronos
   within 1.5x of mpi4py at every size.  A synkhronos time is the master's, from the call until every
   rank of every host is done; the variable's storage stays the collective's result between
   repetitions (as in training).  An mpi4py time is the slowest rank's, after a Barrier.
   Medians over all repetitions (after a warm-up) of ``--rounds`` rounds; each round runs
   every program once, so that load from other programs affects all alike.  Bandwidths:
   algbw = bytes / time, busbw = algbw * 2(n-1)/n.
2. Per-call time of a tiny function (``synk.function([x], (T.sum(x), "sum"))`` on an
   8-element float32 ``synk.data``): 2 hosts (mpiexec) against the same program on one host
   without MPI (2 ranks, plain ``python``) and against a plain PyTensor call; the goal: the
   call over two hosts within 3x of the call on one host.  Also on one host with as many
   ranks as the two-host job has processes (3 with one rank per host: the second host runs
   an MPI process beside its rank), which shows what taking turns for the cores costs.
3. Time to first step of ``demos/mnist_mlp.py`` (small configuration) on 2 hosts (mpiexec,
   4 ranks) against one host (plain python, 2 ranks): wall time from process start to each
   milestone of its output, and the demo's own figures.  The demo's serial runs (plain
   PyTensor in the master) take turns with its data-parallel epochs, after its first
   synkhronos step; only their first calls come before it.  The numba cache is made warm
   first by one untimed run of each.

Placement. The simulated hosts share this machine's cores, and the processes that talk MPI
busy-poll while they wait (MPICH's blocking calls; synkhronos's MPI processes look between
yields of their core while an answer from another host is due, and sleep otherwise): when
two that talk to each other land on the same core, every exchange between hosts waits for
the scheduler (milliseconds), something real hosts never do. Where that happens is the
kernel's choice and tends to hold for a whole program, so small-size results are bimodal
from run to run (measured on this 2-core machine: synkhronos's 4 KB all_reduce took ~1 ms
with the master and hB's agent pinned to different cores, 10-15 ms with both pinned to
the same one).  By default the kernel places everything (as a user of this machine would get
it); ``--pinned`` adds a second set of 2-host runs of 1. and 2. with each host's MPI leader
on a core of its own, as on real hosts (synkhronos: the master on core 0 and hB's agent on
core 1, pinned by this script once the session is up, the ranks' workers left free; mpi4py:
the first rank of each host, MPICH's node leader, pins itself).  On a machine that other
programs keep busy, pinning can hurt as much as it helps (a pinned process cannot move away
from a busy core).

The programs run under ``mpiexec`` are in ``benchmarks/_mpi_bench_prog.py``; the hosts are
``tests/simhosts.py`` (network, UTS, mount and IPC namespaces, a private tmpfs /dev/shm per
host, joined by a veth pair): **root is needed** (``sudo``).  On a 2-core machine the 4
ranks, the MPI processes and the launchers share 2 cores: read absolute numbers with that
in mind (the ratios are taken within one run).

Prints a line per measurement and tables; saves ``benchmarks/results/mpi.json`` and
``benchmarks/results/mpi.png``.  Checks after every program that no process, no /dev/shm
entry and no temp file is left in either host, and at the end on this machine.

Usage (from the repository root)::

    sudo .venv/bin/python benchmarks/bench_mpi.py            # ~3.5 minutes on 2 cores
    sudo .venv/bin/python benchmarks/bench_mpi.py --quick    # fewer repetitions, 1 round (~1 min)
    options: --per-host 1|2, --rounds N, --max-mb MB, --shm-size SIZE, --pinned (+~1.5 min), --skip-demo,
             --out DIR
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

import _mpi_report as report
from _mpi_report import GB, KB, MB, fmt_size, fmt_t, med
from common import RESULTS, write_results

from synkhronos import machine_load

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROG = os.path.join(HERE, "_mpi_bench_prog.py")
DEMO = os.path.join(ROOT, "demos", "mnist_mlp.py")
HOSTS = ("hA", "hB")
PER_HOST = 1           # ranks per host (--per-host)
N_RANKS = 2 * PER_HOST
DEMO_ARGS = ["--epochs", "1", "--train-subset", "400", "--batch-size", "128", "--no-progress"]
MAX_CALLS = 90         # all_reduce calls per size: 2**-60 * 4**90 = 2**120 < float32 max

sys.path.insert(0, os.path.join(ROOT, "tests"))
import simhosts  # noqa: E402  (tests/simhosts.py)

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sizes_and_reps(max_mb, quick):
    sizes = [s for s in (4 * KB, 64 * KB, MB, 4 * MB, 16 * MB, 64 * MB, 256 * MB) if s <= max_mb * MB]
    table = {4 * KB: 40, 64 * KB: 40, MB: 30, 4 * MB: 20, 16 * MB: 12, 64 * MB: 7, 256 * MB: 5}
    reps = [max(3, table[s] // 3) if quick else table[s] for s in sizes]
    return sizes, reps, 2 if quick else 3


def shm_used(hosts, host):
    st = os.statvfs(hosts.shm_path(host))
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def is_generated_src(path):
    """PyTensor's numba backend writes the source it generates (each graph, composite scalar
    op, ...) to a ``tmp*`` file it keeps (``pytensor.link.utils.write_generated_src`` when
    ``config.generated_src_dir`` is unset)."""
    if not os.path.basename(path).startswith("tmp") or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as fh:
            return fh.read(256).lstrip().startswith(b"def ")
    except OSError:
        return False


class Bench:
    def __init__(self, hosts, tmp):
        self.hosts, self.tmp = hosts, tmp
        self.py = sys.executable
        self.issues = []
        self.shm_peak = {h: 0 for h in HOSTS}
        self.k = 0
        self.prefix_log = os.path.join(tmp, "prefixes.log")   # every session prefix made
        self.prefixes = []
        self.run_tmp = os.path.join(tmp, "tmp")    # TMPDIR of the programs (and of mpiexec)
        os.mkdir(self.run_tmp, 0o700)
        self.generated_src = 0
        self.cpus = sorted(os.sched_getaffinity(0))
        self.pinned = []

    # ---- running one program -----------------------------------------------------------
    def run(self, label, cmd, on_result=None, timeout=600, pin=False):
        """Run ``cmd`` (argv already placed on a host) with output lines timestamped (s since
        start), follow its result file (``on_result`` per BENCH line as it appears); with
        ``pin``, pin the MPI processes once the program says "ready", then let it go (the
        program waits for the file ``self.go_path()``, passed in its spec as "go").
        Returns (returncode, [(t, line)], [results], wall)."""
        go = self.go_path()
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
            seen += len(done)
            for ln in done.splitlines():
                if ln.startswith("BENCH "):
                    r = json.loads(ln[6:])
                    results.append(r)
                    if r["kind"] == "ready" and pin:
                        self.pin_leaders(label)
                        open(go, "w").close()
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
            time.sleep(0.05)
        p.wait()
        wall = time.perf_counter() - t0
        th.join(10)
        p.stdout.close()
        follow()
        for f in (rfile, go):
            if os.path.exists(f):
                os.unlink(f)
        if os.path.exists(self.prefix_log):
            with open(self.prefix_log) as fh:
                self.prefixes = sorted({ln.strip().lstrip("/") for ln in fh if ln.strip()})
        if timed_out or p.returncode != 0:
            tail = "\n".join(ln for _, ln in lines[-40:])
            self.issues.append(f"{label}: exit {p.returncode}{' (timed out)' if timed_out else ''}")
            log(f"{label} FAILED (exit {p.returncode}{', timed out' if timed_out else ''}):\n{tail}")
        self.check_clean(label)
        return p.returncode, lines, results, wall

    def go_path(self):
        """The file the next program waits for before measuring (when its spec names it)."""
        return os.path.join(self.tmp, f"go{self.k + 1}")

    def pin_leaders(self, label):
        """The MPI process of each host (synkhronos: the master, the agent) on its own core."""
        ranks = self.hosts.rank_pids()           # {MPI rank: (host, pid)}
        done = []
        for rank, (host, pid) in ranks.items():
            cpu = self.cpus[HOSTS.index(host) % len(self.cpus)]
            try:
                os.sched_setaffinity(pid, {cpu})
                done.append((rank, host, cpu))
            except OSError as e:
                self.issues.append(f"{label}: could not pin MPI rank {rank} ({e})")
        self.pinned.append((label, done))

    def check_clean(self, label):
        """No process, no /dev/shm entry and no temp file may be left after a program."""
        if not self.hosts.wait_idle(10):
            left = self.hosts.processes()
            self.issues.append(f"after {label}: processes left {left}")
            log(f"WARNING after {label}: processes left {left}; killing them")
            self.hosts.kill_all()
        other = []
        for e in os.listdir(self.run_tmp):
            path = os.path.join(self.run_tmp, e)
            if is_generated_src(path):
                self.generated_src += 1
            else:
                other.append(e)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
        if other:
            self.issues.append(f"after {label}: temp files left (removed): {sorted(other)}")
            log(f"WARNING after {label}: temp files left {sorted(other)}; removed them")
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
    def allreduce(self, sizes, reps, warm, rounds, placements):
        keys = [(impl, pl) for pl in placements for impl in ("synk", "mpi4py", "mpi4py_driven")]
        raw = {k: {s: [] for s in sizes} for k in keys}
        per_round = {k: {s: [] for s in sizes} for k in keys}
        checks = []
        for rnd in range(rounds):
            for impl, pl in keys:
                def show(r, key=(impl, pl), rnd=rnd):
                    if r["kind"] != "allreduce":
                        return
                    ts = r["times"]
                    raw[key][r["size"]] += ts
                    per_round[key][r["size"]].append(med(ts))
                    checks.append(bool(r["ok"]))
                    log(f"all_reduce {key[0]:13s} {key[1]:7s} round {rnd + 1}/{rounds} "
                        f"{fmt_size(r['size']):>6}: median {fmt_t(med(ts))} over {len(ts)} reps "
                        f"(min {fmt_t(min(ts))})"
                        f"{'' if r['ok'] else '  WRONG RESULT ' + json.dumps(r['check'])}")
                spec = {"sizes": sizes, "reps": reps, "warmup": warm}
                if impl == "synk":
                    spec["n"] = N_RANKS
                    if pl == "pinned":
                        spec["go"] = self.go_path()
                    cmd = self.mpiexec(2, 1, [PROG, "synk_allreduce", json.dumps(spec)])
                else:
                    spec.update(ppn=PER_HOST, pin=pl == "pinned", driven=impl == "mpi4py_driven")
                    cmd = self.mpiexec(N_RANKS, PER_HOST, [PROG, "mpi_allreduce", json.dumps(spec)])
                rc, _, _, wall = self.run(f"all_reduce {impl} {pl} round {rnd + 1}", cmd, show,
                                          pin=impl == "synk" and pl == "pinned")
                log(f"  (program: {wall:.1f} s, exit {rc})")
        return raw, per_round, all(checks) and bool(checks)

    # ---- 2. per-call time ----------------------------------------------------------------
    def overhead(self, rounds, blocks, block_s, placements):
        wheres = [f"two_hosts_{pl}" for pl in placements] + ["one_host", "one_host_procs"]
        out = {w: [] for w in wheres}
        for rnd in range(rounds):
            for where in wheres:
                if where.startswith("two_hosts"):
                    spec = {"n": N_RANKS, "blocks": blocks, "block_s": block_s}
                    if where.endswith("pinned"):
                        spec["go"] = self.go_path()
                    cmd = self.mpiexec(2, 1, [PROG, "overhead", json.dumps(spec)])
                else:       # (one_host_procs: as many processes as the 2-host job, its agent counted)
                    spec = {"n": 2 if where == "one_host" else N_RANKS + 1, "blocks": blocks, "block_s": block_s}
                    cmd = self.on_host([PROG, "overhead", json.dumps(spec)])
                _, _, res, _ = self.run(f"overhead {where} round {rnd + 1}", cmd,
                                        pin=where.endswith("pinned"))
                for r in res:
                    if r["kind"] == "overhead":
                        out[where].append(r)
                        log(f"per-call {where:17s} round {rnd + 1}/{rounds} ({r['n']} ranks on "
                            f"{', '.join(r['hosts'])}): synk {med(r['synk']) * 1e6:.1f} us, "
                            f"plain PyTensor {med(r['pytensor']) * 1e6:.2f} us"
                            f"{'' if r['ok'] else '  WRONG RESULT'}")
        return out

    # ---- 3. demo ---------------------------------------------------------------------------
    def demo(self, where, label):
        if where == "two_hosts":
            cmd = self.mpiexec(2, 1, [DEMO, *DEMO_ARGS, "--n-parallel", str(N_RANKS)])
        else:
            cmd = self.on_host([DEMO, *DEMO_ARGS, "--n-parallel", "2"])
        rc, lines, _, wall = self.run(f"demo {where} {label}", cmd)
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
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, one round")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds (every program once per round), pooled (default 2; 1 with --quick)")
    ap.add_argument("--max-mb", type=int, default=256, help="largest all_reduce buffer (MB)")
    ap.add_argument("--shm-size", default=None,
                    help="tmpfs size of each simulated host's /dev/shm (default: 16x the "
                         "largest buffer, at least 1g: 4g for 256 MB)")
    ap.add_argument("--pinned", action="store_true",
                    help="also run the 2-host programs of 1. and 2. with each host's MPI leader "
                         "pinned to a core of its own (see 'Placement' above)")
    ap.add_argument("--skip-demo", action="store_true", help="skip the demo (3.)")
    ap.add_argument("--per-host", type=int, choices=(1, 2), default=1,
                    help="ranks per host (1: mpiexec -n 2 against synk.fork(2); 2: 4 ranks)")
    ap.add_argument("--out", default=RESULTS, help="directory for mpi.json and mpi.png")
    args = ap.parse_args()
    global PER_HOST, N_RANKS
    PER_HOST, N_RANKS = args.per_host, 2 * args.per_host
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
    placements = ["default"] + (["pinned"] if args.pinned and cores >= 2 else [])

    log(f"bench_mpi: hosts {', '.join(HOSTS)} x {PER_HOST} rank(s), {cores} cores here, rounds {rounds}, "
        f"placements {', '.join(placements)}, sizes {', '.join(fmt_size(s) for s in sizes)}, "
        f"/dev/shm {shm_size} per host")
    idle = machine_load.MachineLoad()
    time.sleep(1.0)
    busy_before = idle.share()
    load_before = os.getloadavg()[0]
    log(f"machine busy before starting (other programs): {busy_before * 100:.0f}% of all cores, "
        f"load average {load_before:.2f}")
    shm_before = set(os.listdir("/dev/shm"))
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    tmp = tempfile.mkdtemp(prefix="synk-bench-mpi-")
    res = {"config": dict(hosts=list(HOSTS), ranks=N_RANKS, ranks_per_host=PER_HOST, cores=cores,
                          rounds=rounds, placements=placements, sizes=sizes, reps=reps,
                          warmup=warm, quick=args.quick, shm_size=shm_size, demo_args=DEMO_ARGS,
                          python=sys.executable, busy_before=busy_before, loadavg_before=load_before)}
    during = machine_load.MachineLoad()
    t_all = time.perf_counter()
    demos = {"two_hosts": [], "one_host": []}
    prefixes = []
    try:
        with simhosts.SimHosts(HOSTS, shm_size=shm_size) as hosts:
            b = Bench(hosts, tmp)
            if not args.skip_demo:
                for where in ("two_hosts", "one_host"):
                    log(f"warming the numba cache: one untimed run of the demo on "
                        f"{where.replace('_', ' ')}")
                    d = b.demo(where, "warm-up")
                    log(f"  warm-up run done ({d['wall_s']:.1f} s, exit {d['exit']})")
            raw, per_round, checks_ok = b.allreduce(sizes, reps, warm, rounds, placements)
            ovh = b.overhead(rounds, 5 if args.quick else 7, 0.15 if args.quick else 0.25, placements)
            if not args.skip_demo:
                for rnd in range(rounds):
                    for where in ("two_hosts", "one_host"):
                        d = b.demo(where, f"round {rnd + 1}")
                        demos[where].append(d)
                        log(f"demo {where:9s} round {rnd + 1}/{rounds}: first step done at "
                            f"{d.get('t_first_step', float('nan')):.2f} s, exit after "
                            f"{d['wall_s']:.2f} s (exit {d['exit']})")
            shm_peak, issues, prefixes = dict(b.shm_peak), b.issues, b.prefixes
            generated_src, pinned = b.generated_src, b.pinned
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    busy_during = during.share()
    total = time.perf_counter() - t_all

    # ---- leftovers on this machine ---------------------------------------------------------
    # The programs ran inside the hosts (private /dev/shm and TMPDIR, checked after each);
    # here nothing of their sessions may have reached this machine's /dev/shm (other
    # programs' entries, e.g. a test suite running meanwhile, are told apart by the session
    # prefixes ours logged through SYNK_PREFIX_LOG), nor a temp dir of ours, nor a process.
    time.sleep(0.5)
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
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cl = fh.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if PROG in cl or (DEMO in cl and "mpiexec" in cl) or tmp in cl:
                left_procs.append((int(pid), cl[:120]))
    if left_procs:
        issues.append(f"processes left: {left_procs}")

    ar = report.allreduce_table(sizes, placements, raw, per_round, checks_ok, PER_HOST)
    ov = report.overhead_table(ovh, placements, PER_HOST)
    dm = {} if args.skip_demo else report.demo_table(demos, rounds, PER_HOST, DEMO_ARGS)

    # ---- summary ------------------------------------------------------------------------------
    print(f"\nmachine: {cores} cores; other programs kept {busy_before * 100:.0f}% of them busy "
          f"before the start (load average {load_before:.2f}); the whole machine was "
          f"{busy_during * 100:.0f}% busy during the benchmark; peak /dev/shm use "
          f"hA {shm_peak['hA'] / MB:.0f} MB, hB {shm_peak['hB'] / MB:.0f} MB (of {shm_size} each)")
    print("clean-up: " + ("nothing left (processes and /dev/shm of both hosts and of this machine, "
                          "temp files)" if not issues else "PROBLEMS: " + "; ".join(issues)))
    print(f"  {len(prefixes)} synkhronos session prefixes made; entries of them in this machine's "
          f"/dev/shm: {len(shm_ours)}")
    if generated_src:
        print(f"  {generated_src} temp files of PyTensor's generated source (PyTensor keeps one per "
              f"generated function and process when config.generated_src_dir is unset) were "
              f"left by the programs in their TMPDIR and removed")
    if len(shm_new) > len(shm_ours):
        print(f"  this machine's /dev/shm got {len(shm_new) - len(shm_ours)} entries from other "
              f"programs meanwhile (not from this benchmark)")
    print(f"total {total:.0f} s")
    res.update(allreduce={pl: {str(s): v for s, v in d.items()} for pl, d in ar.items()},
               overhead=ov, demo=dm, checks_ok=checks_ok, pinned=pinned,
               machine=dict(busy_during=busy_during, shm_peak_bytes=shm_peak,
                            loadavg_after=os.getloadavg()[0]),
               session_prefixes=len(prefixes), generated_src_files_removed=generated_src,
               issues=issues, total_s=total)
    jpath = write_results(res, "mpi.json", args.out)
    print(jpath)
    report.plot(sizes, ar, ov, os.path.join(args.out, "mpi.png"), PER_HOST)


if __name__ == "__main__":
    main()

"""The chaos soak across hosts (``tests/test_chaos.py``): run under ``mpiexec`` with one
MPI process per (simulated) host, ``python _chaos_mpi.py RUNS SEED``.

Each run forks a session of 4 ranks (2 per host), 3 (2 and 1) or 2 (one per host: a host's
one rank runs its reductions between hosts in its own buffers, not a host buffer), makes a
shared variable of a random size (4 KB to 64 MB) and a function, then repeats one
operation (a long call, ``all_reduce``, ``broadcast``, ``gather`` or ``scatter`` of the
variable) while one fault lands at a random moment: a worker rank of either host killed
(SIGKILL) or frozen (SIGSTOP), an exception in a rank's share of a call, or Ctrl-C in the
master.  What it must end in:

=========  ==============================================================================
kill       ``WorkerDied`` naming the rank and its host within 5 s; the session is closed
stop       ``WorkerStopped`` naming the rank and its host within 5 s; the session is closed
raise      ``WorkerError`` naming the rank; the session goes on (checked with a collective)
ctrl-c     ``KeyboardInterrupt``; the session goes on (checked with a collective)
=========  ==============================================================================

then the next run forks again.  A run that lasts over ``HANG_S`` is a hang: every thread's
stack is printed and the program exits (code 3).  The master prints ``SYNK-RESULT {json}``:
the runs, the outcomes by fault, the slowest report, and every run that went wrong."""
import faulthandler
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _fault_ops as fo  # noqa: E402
from _fault_scripts import _emit  # noqa: E402

FAULTS = ("kill", "stop", "raise", "ctrl-c")
OPS = ("call", "all_reduce", "broadcast", "gather", "scatter")
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
REPORT_S = 5.0          # a lost rank must be reported this soon
STALL_S = 20.0          # the stall warning (with the flight recorder's report) comes this soon
HANG_S = 60.0           # a run this long is a hang


def watchdog(state):
    """Dump every thread and exit when a run lasts over HANG_S (a hang, never a wait)."""
    def watch():
        while True:
            time.sleep(1.0)
            started = state.get("started")
            if started is not None and time.monotonic() - started > HANG_S:
                print(f"SYNK-HANG run {state.get('run')}: {state.get('what')}", flush=True)
                _emit("SYNK-HANG", dict(run=state.get("run"), what=state.get("what")))
                faulthandler.dump_traceback(all_threads=True)
                from mpi4py import MPI
                MPI.COMM_WORLD.Abort(3)       # the whole job ends (the agents too)
    threading.Thread(target=watch, daemon=True, name="chaos-watchdog").start()


def one_run(synk, rng, run, state):
    import pytensor
    import pytensor.tensor as T
    fault = FAULTS[rng.integers(len(FAULTS))]
    n = int((2, 3, 4)[rng.integers(3)])
    synk.fork(n, stall=STALL_S)
    info = synk.session_info()
    ranks = {r.rank: (r.host, r.pid) for r in info.ranks}
    victim = int(rng.integers(1, n))                         # a worker, on either host (n = 2: hB's)
    size = int(SIZES[rng.integers(len(SIZES))])
    v = pytensor.shared(np.zeros(size // 4, np.float32), name="v")
    x = T.vector("x", dtype="float64")
    action = "raise" if fault == "raise" else "sleep"
    f = synk.function([x], [(T.sum(fo.Fault(action, victim)(x)), "sum"), (T.sum(v), "sum")])
    synk.distribute()
    op = "call" if fault == "raise" else OPS[rng.integers(len(OPS))]
    data = fo.with_trigger(np.ones(8), victim, n)              # the victim's shard holds the trigger
    full = np.ones(size // 4 * n, np.float32)

    def once():
        if op == "call":
            f(data)
        elif op == "all_reduce":
            synk.all_reduce(v, "sum")
        elif op == "broadcast":
            synk.broadcast(v, np.ones(size // 4, np.float32))
        elif op == "gather":
            synk.gather(v)
        else:
            synk.scatter(v, full)

    once() if op != "call" else f(np.ones(8))                  # warm (compiled, loaded everywhere)
    host, pid = ranks[victim]
    delay = float(rng.uniform(0.0, 0.4))
    landed = {}

    def inject():
        landed["t"] = time.monotonic()
        if fault == "kill":
            os.kill(pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(pid, signal.SIGSTOP)
        elif fault == "ctrl-c":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    rec = dict(run=run, n=n, fault=fault, op=op, size=size, victim=victim, host=host, delay=round(delay, 3))
    _emit("SYNK-RUN", rec)
    state["what"] = f"{fault} of rank {victim} ({host}) during {op} of {size} B"
    timer = threading.Timer(delay, inject) if fault != "raise" else None
    t0 = time.monotonic()
    err = None
    try:
        if timer is not None:
            timer.start()
        while time.monotonic() - t0 < delay + REPORT_S + 2.0:
            once()
    except (synk.SynkError, KeyboardInterrupt) as e:
        err = e
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
        if fault == "stop":
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    seconds = time.monotonic() - landed.get("t", t0)
    rec.update(raised=type(err).__name__ if err is not None else None, seconds=round(seconds, 3),
               message=str(err)[:300] if err is not None else None)
    rec["ok"] = _as_promised(synk, fault, victim, host, err, seconds, v)
    synk.close()
    prefix = info.resources["shm_prefix"].lstrip("/") + "_"
    left = [e for e in os.listdir("/dev/shm") if e.startswith(prefix) or e.startswith("sem." + prefix)]
    if left:
        rec["ok"], rec["left"] = False, left
    census = shm_census()
    own = os.readlink("/proc/self/ns/mnt")
    rec["free_mib"] = {("this host" if ns == own else "other"): h["free_mib"]
                       for ns, h in census["shm"].items() if h["free_mib"] < 4096}
    if os.environ.get("SYNK_CHAOS_CENSUS"):
        rec["holders"] = [(p["pid"], p["cmd"][-30:], p["named_mib"], p["removed_mib"]) for p in census["procs"]]
    if not rec["ok"]:
        rec["census"] = census
    return rec


def shm_census():
    """Who holds shared memory now, for a run that went wrong: each mount namespace's
    /dev/shm (free MiB, its files), and every process mapping /dev/shm files (MiB mapped of
    files still named and of files already removed)."""
    by_ns, procs = {}, []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ns = os.readlink(f"/proc/{pid}/ns/mnt")
            with open(f"/proc/{pid}/maps") as fh:
                maps = fh.read().splitlines()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")[:80]
        except OSError:
            continue
        named = removed = 0
        for ln in maps:
            if "/dev/shm/" not in ln:
                continue
            lo, hi = (int(a, 16) for a in ln.split()[0].split("-"))
            if ln.endswith("(deleted)"):
                removed += hi - lo
            else:
                named += hi - lo
        if named or removed:
            procs.append(dict(pid=int(pid), ns=ns, cmd=cmd, named_mib=round(named / 2**20, 1),
                              removed_mib=round(removed / 2**20, 1)))
        if ns not in by_ns:
            try:
                st = os.statvfs(f"/proc/{pid}/root/dev/shm")
                files = {e.name: e.stat().st_blocks * 512 >> 20
                         for e in os.scandir(f"/proc/{pid}/root/dev/shm")}
                by_ns[ns] = dict(free_mib=st.f_bavail * st.f_frsize >> 20,
                                 files={k: v for k, v in files.items() if v})
            except OSError:
                pass
    return dict(shm=by_ns, procs=procs)


def _as_promised(synk, fault, victim, host, err, seconds, v):
    if fault in ("kill", "stop"):
        want = synk.WorkerDied if fault == "kill" else synk.WorkerStopped
        return (isinstance(err, want) and err.rank == victim and err.host == host
                and f"rank {victim} on host {host}" in str(err) and seconds <= REPORT_S
                and synk.session_info() is None)
    if fault == "raise":
        ok = isinstance(err, synk.WorkerError) and victim in err.ranks
    else:
        ok = isinstance(err, KeyboardInterrupt)
    try:                                                       # the session goes on
        synk.all_reduce(v, "max")
    except Exception:
        return False
    return ok


def main(runs, seed):
    import synkhronos as synk
    faulthandler.enable()          # a crash (SIGSEGV, SIGBUS) prints every thread's stack
    fo.quiet()
    rng = np.random.default_rng(seed)
    state = {}
    if int(os.environ.get("PMI_RANK", "0")) == 0:      # (the other MPI processes become agents)
        watchdog(state)
    records = []
    for run in range(runs):
        state.update(run=run, started=time.monotonic(), what="a run")
        print(f"chaos run {run}: starting", flush=True)
        try:
            records.append(one_run(synk, rng, run, state))
        except Exception:                                 # anything else is a failure, reported
            import traceback
            records.append(dict(run=run, ok=False, error=traceback.format_exc()[-1500:], census=shm_census()))
            synk.close()
        state["started"] = None
        r = records[-1]
        print(f"chaos run {run}: {r.get('fault')} of rank {r.get('victim')} ({r.get('host')}) during "
              f"{r.get('op')} {r.get('size')} B -> {r.get('raised')} in {r.get('seconds')} s "
              f"(/dev/shm free MiB {r.get('free_mib')}{' held by ' + str(r['holders']) if r.get('holders') else ''}) "
              f"{'ok' if r['ok'] else 'WRONG'}{'' if r['ok'] else ': ' + str(r.get('error') or r.get('message'))}",
              flush=True)
    outcomes = {}
    for r in records:
        key = f"{r.get('fault')} -> {r.get('raised')}"
        outcomes[key] = outcomes.get(key, 0) + 1
    sessions = {}
    for r in records:
        key = f"{r.get('n')} ranks"
        sessions[key] = sessions.get(key, 0) + 1
    _emit("SYNK-RESULT", dict(runs=runs, faults=len(records), hangs=0, outcomes=outcomes, sessions=sessions,
                              wrong=[r for r in records if not r["ok"]],
                              slowest=max((r.get("seconds", 0) for r in records
                                           if r.get("fault") in ("kill", "stop")), default=0.0),
                              records=records))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

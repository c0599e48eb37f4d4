"""What a round trip through another host's MPI process costs, without synkhronos.

    sudo .venv/bin/python benchmarks/bench_handoffs.py            # ~1 minute
    sudo .venv/bin/python benchmarks/bench_handoffs.py --trips 5000 --rounds 3

The same path as a tiny synkhronos call from the master to a rank on another host, made of
mpi4py, shared memory and ``os.fork`` alone: on two simulated hosts (``tests/simhosts.py``:
root needed), the master (MPI rank 0, host hA) sends 64 bytes to hB's MPI process, which
hands them to a "rank" it forked through a word of shared memory; the rank answers the same
way, and hB's MPI process sends 64 bytes back.  Three processes, as in synkhronos (the
master, hB's agent, hB's rank).  What differs between the rows is only how each waits:

* ``spin``: every process looks between yields of its core (``sched_yield``);
* ``pipes``: hB's two processes block on a pipe for each other (the MPI ones spin);
* ``semaphores``: they wait on posix semaphores with a 0.2 ms timeout, as synkhronos'
  ranks and agents sleep; ``semaphores + 15 us``: hB's MPI process works ~15 µs after
  waking the rank (synkhronos' agents go on with their round);
* ``blocking MPI``: the master and hB's MPI process block in ``MPI_Recv``, the rank on a pipe.

The figure is the median round trip (after 200 untimed ones).  On the project's 2-core VM
(the two hosts share its cores) every row was 24-57 µs, against ~240 µs for a tiny
synkhronos call on the same hosts (``bench_mpi.py``): the turn-taking of three processes
on two cores alone does not make a call slow; each process's own work between the
hand-offs does, during which the process it woke waits for the core.  Prints a table and
saves ``results/handoffs.json``."""
import argparse
import json
import mmap
import os
import statistics
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = {"spin": "every process looks between yields",
         "pipes": "hB's processes block on pipes",
         "semaphores": "hB's processes wait on posix semaphores (0.2 ms timeout)",
         "semaphores + 15 us": "the same, hB's MPI process working ~15 us after a hand-off",
         "blocking MPI": "MPI processes block in MPI_Recv, the rank on a pipe"}
MSG = 64
STOP = -1


# ---- the program under mpiexec (two MPI processes, one per host) ---------------------------------

def _spin_until(buf, off, want):
    while struct.unpack_from("q", buf, off)[0] != want:
        os.sched_yield()


class _Doorbell:
    """How hB's two processes wake each other, per mode: ``ring()`` / ``wait()``."""

    def __init__(self, mode):
        self.mode = mode
        if mode.startswith("semaphores"):
            import secrets

            import posix_ipc
            self.sem = posix_ipc.Semaphore(f"/synk-bench-{secrets.token_hex(8)}", posix_ipc.O_CREX, 0o600)
            self.sem.unlink()                    # (the two processes keep it open: nothing left behind)
            self.busy = posix_ipc.BusyError
        else:
            self.r, self.w = os.pipe()

    def ring(self):
        if self.mode.startswith("semaphores"):
            self.sem.release()
        elif self.mode != "spin":
            os.write(self.w, b"x")

    def wait(self, buf, off, want):
        if self.mode == "spin":
            _spin_until(buf, off, want)
        elif self.mode.startswith("semaphores"):
            while True:
                try:
                    self.sem.acquire(0.0002)
                    return
                except self.busy:
                    pass
        else:
            os.read(self.r, 1)


def _work(us):
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def mpi_program(mode, trips):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    block = mode == "blocking MPI"
    out, back = bytearray(MSG), bytearray(MSG)
    if comm.Get_rank() == 0:                     # the master
        times = []
        for i in range(trips + 1):
            struct.pack_into("q", out, 0, STOP if i == trips else i)
            t = time.perf_counter()
            req = comm.Isend(out, dest=1, tag=1)
            if i == trips:
                req.Wait()
                break
            if not block:
                while not comm.Iprobe(source=1, tag=2):
                    os.sched_yield()
            comm.Recv(back, source=1, tag=2)
            req.Wait()
            times.append(time.perf_counter() - t)
        times = times[200:]
        print("RESULT " + json.dumps({"mode": mode, "median_us": statistics.median(times) * 1e6,
                                      "p10_us": sorted(times)[len(times) // 10] * 1e6,
                                      "p90_us": sorted(times)[9 * len(times) // 10] * 1e6}), flush=True)
        return
    buf = mmap.mmap(-1, 4096)                    # [0]: command number, [8]: answer number, [16]: stop
    to_rank, to_agent = _Doorbell(mode), _Doorbell(mode)
    pid = os.fork()
    if pid == 0:                                 # hB's "rank"
        seq = 0
        while True:
            seq += 1
            to_rank.wait(buf, 0, seq)
            if struct.unpack_from("q", buf, 16)[0]:
                os._exit(0)
            struct.pack_into("q", buf, 8, seq)
            to_agent.ring()
    seq = 0                                      # hB's MPI process (the agent)
    while True:
        if block:
            comm.Recv(out, source=0, tag=1)
        else:
            while not comm.Iprobe(source=0, tag=1):
                os.sched_yield()
            comm.Recv(out, source=0, tag=1)
        seq += 1
        stop = struct.unpack_from("q", out, 0)[0] == STOP
        struct.pack_into("q", buf, 16, int(stop))
        struct.pack_into("q", buf, 0, seq)
        to_rank.ring()
        if stop:
            break
        if mode == "semaphores + 15 us":
            _work(15)
        to_agent.wait(buf, 8, seq)
        comm.Send(back, dest=0, tag=2)
    os.waitpid(pid, 0)


# ---- the parent: hosts, rounds, table ------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trips", type=int, default=3000, help="round trips per program (200 more untimed)")
    p.add_argument("--rounds", type=int, default=2, help="every mode once per round")
    a = p.parse_args(argv)
    if a.trips < 10 or a.rounds < 1:
        p.error("--trips must be >= 10 and --rounds >= 1")
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import simhosts
    from common import write_results
    ok, why = simhosts.available()
    if not ok:
        sys.exit(f"bench_handoffs.py needs simulated hosts: {why} (run it as root)")
    got = {m: [] for m in MODES}
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        for rnd in range(a.rounds):
            for mode in MODES:
                cmd = hosts.mpiexec_cmd(2, 1, [sys.executable, os.path.abspath(__file__), "--program", mode,
                                               str(a.trips + 200)])
                r = hosts.run(cmd, timeout=300)
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                if r.returncode or not lines:
                    sys.exit(f"{mode}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
                res = json.loads(lines[0][len("RESULT "):])
                got[mode].append(res)
                print(f"round {rnd + 1}/{a.rounds}  {mode:20s} median {res['median_us']:6.1f} us  "
                      f"(p10 {res['p10_us']:.1f}, p90 {res['p90_us']:.1f})", flush=True)
    left = hosts.leftovers()                     # (after the hosts were taken down)
    print(f"\nround trip master (hA) -> hB's MPI process -> its forked rank -> back, {a.trips} trips, "
          f"medians of each round [us]:")
    for mode, what in MODES.items():
        print(f"  {mode:20s} {' '.join(f'{r['median_us']:6.1f}' for r in got[mode])}   {what}")
    print(f"cores here: {len(os.sched_getaffinity(0))}; left on the hosts afterwards: {left or 'nothing'}")
    print("results:", write_results({"trips": a.trips, "rounds": got, "modes": MODES}, "handoffs.json"))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--program":
        mpi_program(sys.argv[2], int(sys.argv[3]))
    else:
        main()

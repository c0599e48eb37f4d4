"""The hosts of a session under ``mpiexec``: how many ranks each gets, what each host's
workers are told, and the ends of the sessions on the other hosts."""
import os
import time

from .world import BYE, END, ENDED, EXIT, READY, START, world
from ..host.device import usable_cores
from ..shm import segments as shm


def plan_hosts(n_parallel):
    """The master learns every MPI process's host and cores (each agent says so when it
    starts) and decides how many ranks each host gets: its usable cores, or ``n_parallel``
    split over the hosts.  Returns (ranks per MPI process, [(host, pid)] per MPI process)."""
    w = world()
    info = {0: (w.host, usable_cores(), os.getpid())}
    deadline = time.monotonic() + 120
    while len(info) < w.size:
        for src, tag, obj in w.poll():
            if tag == READY:
                info[src] = obj
        if time.monotonic() > deadline:
            raise RuntimeError(f"synkhronos: MPI processes {sorted(set(range(w.size)) - set(info))} did not "
                               "report (did every process of the job call synk.fork()?)")
        time.sleep(0.001)
    if n_parallel is None:
        sizes = [info[m][1] for m in range(w.size)]
    else:
        if n_parallel < w.size:
            raise ValueError(f"n_parallel={n_parallel} is less than the {w.size} MPI processes (one "
                             "per host): every host needs at least one rank")
        sizes = [n_parallel // w.size + (1 if m < n_parallel % w.size else 0) for m in range(w.size)]
    return sizes, [(info[m][0], info[m][2]) for m in range(w.size)]


def worker_config(prefix, slots, slot, members, lead, mirror, host_index, sizes, grank, master_pid, mpi_shm):
    return dict(topology="mpi", prefix=prefix, slots=slots, slot=slot, members=list(members), lead=lead,
                mirror=mirror, host_index=host_index, host_sizes=list(sizes), rank=grank,
                master_pid=master_pid, mpi_shm=list(mpi_shm))


def finish(close_session):
    """The master process exits (at exit): ``close_session()`` closes its session, then
    every agent is told to exit."""
    w = world()
    if w.rank == 0 and not w.finished:
        w.finished = True
        close_session()
        for m in range(1, w.size):
            w.isend(None, m, EXIT)
        w.flush()
        # a message only sent may still be lost when its sender finalizes and exits: wait
        # (a while) until every agent says it got it
        waiting, deadline = set(range(1, w.size)), time.monotonic() + 10.0
        while waiting and time.monotonic() < deadline:
            for src, tag, _ in w.poll():
                if tag == BYE:
                    waiting.discard(src)
            time.sleep(0.001)


def start_agents(sizes, settings, device_config):
    """Open a session on every other host: each agent gets what its workers need
    (``settings``, the device with its host's number of ranks, the ranks it leads)."""
    w = world()
    firsts = [sum(sizes[:m]) for m in range(w.size)]
    for m in range(1, w.size):
        dev = dict(device_config, local_n=sizes[m])
        w.isend(dict(settings, device=dev, host_index=m, host_sizes=sizes, first=firsts[m]), m, START)


def end_agents(graceful, timeout=10.0):
    """Close the session on every other host (``graceful``: its workers quit cleanly), and
    wait until every agent says it has (``ENDED``), dropping whatever else they sent
    before: no message of this session (a late reply, a lost rank) can reach the next one."""
    w = world()
    for m in range(1, w.size):
        w.isend(not graceful, m, END)
    w.flush()
    waiting, deadline = set(range(1, w.size)), time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for src, tag, _ in w.poll():
            if tag == ENDED:
                waiting.discard(src)
        time.sleep(0.0005)


def remove_job_files(cfg):
    """A worker whose host's MPI process is gone frees the host's shared memory (MPICH's
    own file included: MPICH was killed with the job and cannot)."""
    shm.remove_all(cfg["prefix"])
    for name in cfg.get("mpi_shm", ()):
        try:
            os.unlink(os.path.join(shm.SHM_DIR, name))
        except OSError:
            pass


_hosts_seen = None


def hosts(n_parallel):
    """``plan_hosts`` once per job (agents report once)."""
    global _hosts_seen
    if _hosts_seen is None:
        _hosts_seen = plan_hosts(None)
    sizes, where = _hosts_seen
    if n_parallel is not None:
        w = world()
        if n_parallel < w.size:
            raise ValueError(f"n_parallel={n_parallel} is less than the {w.size} MPI processes (one "
                             "per host): every host needs at least one rank")
        sizes = [n_parallel // w.size + (1 if m < n_parallel % w.size else 0) for m in range(w.size)]
    return sizes, where

"""The composition root: the one place that chooses a session's implementations and wires
them together.  Nothing else in synkhronos imports a backend's module.

A session has five planes, each an implementation named in ``registry.REGISTRY`` and
keeping the contract of its interface module:

=========  ==========================  ==================================================
plane      contract                    implementations
=========  ==========================  ==================================================
launcher   ``synkhronos.launcher``     subprocess (this host), mpi (several hosts)
control    ``synkhronos.control``      shm (one host), mpi (the master across hosts)
comm       ``synkhronos.comm``         shm, hier (across hosts), staged, xla (JAX devices)
device     ``synkhronos.device``       cpu (numba), jax (GPU or CPU)
channel    ``synkhronos.channel``      shm, mpi
=========  ==========================  ==================================================

Two topologies: ``local`` (the ranks of this host: subprocess + shm + shm, with ``xla``
and ``staged`` in front of ``shm`` for a device that keeps arrays on itself) and ``mpi``
(the same script under ``mpiexec``: mpi launcher and control, hier comm; every worker on
every host uses its host's shm control).  ``plan`` decides (in the master, from
``fork()``'s arguments), ``create_master`` wires the master, ``attach_control`` and
``attach_comm`` a worker (from the configuration the master gave it), ``remove``/``worker_exit``/``reap`` free what
a session leaves."""
import atexit
import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .host import gpus as host_gpus
from .host.guardian import Guardian
from .host.launcher import worker_argv, worker_environment
from .mpi import hosts as mpi_hosts
from .mpi import world as mpi_world
from .mpi.requests import Collectives
from .registry import REGISTRY, contracts, implementation, make_device, name_of
from .selection import select_device
from .shm import segments
from .shm.reaper import reap_stale_sessions
from .stack import CommStack
from ..waiting import Waiter

__all__ = ["Topology", "MasterSpec", "Planes", "plan", "create_master", "attach_control", "attach_comm", "remove",
           "worker_exit", "reap", "open_channel", "attach_channel", "make_device", "select_device",
           "get_n_gpu", "worker_argv", "worker_environment", "REGISTRY", "contracts", "implementation", "name_of"]


@dataclass(frozen=True)
class Topology:
    """What ``plan`` decided: ``name`` ("local" or "mpi"), the device, and for ``mpi`` the
    hosts (ranks per host, ``[(host, pid)]`` of each host's MPI process)."""
    name: str
    device: Any
    hosts: Optional[tuple] = None


@dataclass
class MasterSpec:
    """What the master's wiring needs from the session."""
    topology: Topology
    master_rank: int
    waiter: Waiter                     # the session's waits (liveness, stalls, timeout)
    check: Callable[[], None]          # raises ``launcher.RankGone`` for a lost worker
    worker_settings: dict              # what every worker's configuration carries


@dataclass
class Planes:
    """A master's wired planes and what its workers are told."""
    control: Any
    comm: Any
    launcher: Any
    topology: str
    worker_config: dict = field(default_factory=dict)   # common to every worker
    resources: dict = field(default_factory=dict)       # what the session owns (diagnostics, removal)
    local_workers: Optional[tuple] = None               # ranks the launcher starts (None: all workers)
    rank_config: Optional[Callable[[int], dict]] = None  # rank -> what that worker's configuration adds
    guardian: Any = None        # frees the master's host's shared memory if the master dies (no worker there)


def get_n_gpu():
    """Number of GPUs synkhronos can use on this machine (visible, with JAX's CUDA plugin
    installed; CUDA is not initialised)."""
    return host_gpus.gpu_count()


# ---- choosing -----------------------------------------------------------------------------


def plan(n_parallel, use_gpu, mode, close_session, matmul_precision=None):
    """The topology and device of a new session.  Under ``mpiexec`` the MPI processes other
    than rank 0 become their hosts' agents here and never return.  ``close_session()``
    closes the session (-> whether one was open): run when the master exits or fails."""
    if not mpi_world.launched():
        return Topology("local", select_device(n_parallel, use_gpu, mode, matmul_precision=matmul_precision))
    w = mpi_world.world()
    if w.rank != 0:
        from .mpi.agent import serve_host
        serve_host()                           # never returns: the process exits there
    if w.close_session is None:                # (first: even a refused fork() ends the job cleanly)
        w.close_session = close_session
        atexit.register(mpi_hosts.finish, close_session)
    if use_gpu:
        raise NotImplementedError("GPUs across several machines are not supported yet: use CPU ranks "
                                  "(use_gpu=False) under mpiexec")
    hosts = mpi_hosts.hosts(n_parallel if n_parallel is None else int(n_parallel))
    sizes = hosts[0]
    return Topology("mpi", select_device(sum(sizes), False, mode, local_n=sizes[0],
                                         matmul_precision=matmul_precision), hosts)


# ---- wiring -------------------------------------------------------------------------------


def create_master(spec):
    """The master's planes for ``spec`` (nothing is started yet but shared memory)."""
    if spec.topology.name == "mpi":
        return _mpi_master(spec)
    return _local_master(spec)


def _local_master(spec):
    device, n, rank = spec.topology.device, spec.topology.device.n, spec.master_rank
    if device.placement != "host":             # (may refuse: before anything is created)
        device.plan_comm(rank, spec.check)     # before its config() goes out
    prefix = segments.new_prefix()
    with _removed_on_error(prefix):
        control = implementation("control", "shm")(prefix, n, rank, rank, spec.waiter, create=True)
        host_comm = implementation("comm", "shm")(prefix, rank, n, control, create=True)
        comm = _comm_stack(host_comm, device, rank, n, rank, control)
        guardian = Guardian.start(prefix) if n == 1 else None
    return Planes(control, comm, implementation("launcher", "subprocess")(), "local",
                  {"topology": "local", "prefix": prefix}, {"shm_prefix": prefix}, guardian=guardian)


@contextlib.contextmanager
def _removed_on_error(prefix):
    """The segments of ``prefix`` are removed if what the block makes of them fails (a
    Ctrl-C in ``fork()`` included: the session that would free them does not exist yet)."""
    try:
        yield
    except BaseException:
        segments.remove_all(prefix)
        raise


def _comm_stack(host_comm, device, rank, n, master_rank, control):
    """A rank's comms: for a device that keeps arrays on itself, XLA's collectives (if its
    session uses them), then the host-staged path; then the host's (``shm``, or ``hier``
    across hosts, where XLA's collectives are never used)."""
    if device.placement == "host":
        return CommStack([host_comm])
    impls, front = [], None
    if device.xla:
        front = implementation("comm", "xla")(rank, n, master_rank, control, host_comm)
        impls.append(front)
    impls.append(implementation("comm", "staged")(host_comm, device, device.why_staged, front))
    impls.append(host_comm)
    return CommStack(impls)


def _mpi_master(spec):
    from .mpi.hub import HostView, Hub
    w = mpi_world.world()
    sizes, hosts = spec.topology.hosts
    firsts = [sum(sizes[:m]) for m in range(w.size)]
    host_ranks = {m: range(firsts[m], firsts[m] + sizes[m]) for m in range(w.size)}
    k0 = sizes[0]
    device = spec.topology.device
    if device.placement != "host":             # JAX ranks: their arrays through the hosts (before config())
        device.plan_comm(0, spec.check, several_hosts=True)
    prefix = segments.new_prefix()
    waiter = spec.waiter
    waiter.TICK = mpi_world.POLL               # messages from other hosts do not wake a sleeper:
    waiter.KEEP_HOT = mpi_world.KEEP_HOT       # look for them between yields first, then every tick
    with _removed_on_error(prefix):
        host0 = implementation("control", "shm")(prefix, k0 + 1, 0, 0, waiter, create=True, members=range(k0),
                                                 lead=k0)
    hub = Hub(w, HostView(host0), list(range(1, w.size)))
    waiter.service = hub.service
    launcher = implementation("launcher", "mpi")(implementation("launcher", "subprocess")(), hub, [])
    mpi_hosts.start_agents(sizes, dict(spec.worker_settings, n=device.n, master_rank=0), device.config())
    coll = Collectives(w, lambda: (hub.service(), hub.check()), hub.finished_hosts)
    control = implementation("control", "mpi")(w, host0, hub, host_ranks, waiter, coll)
    hier = implementation("comm", "hier")(prefix, 0, host0, True, 0, sizes, 0, w=w, coll=coll)
    comm = _comm_stack(hier, device, 0, device.n, 0, control)
    hub.hosts = hosts
    pid = os.getpid()

    def rank_config(r):
        return mpi_hosts.worker_config(prefix, k0 + 1, r, range(k0), k0, False, 0, sizes, r, pid, w.mpi_shm)
    guardian = Guardian.start(prefix, w.mpi_shm) if k0 == 1 else None
    return Planes(control, comm, launcher, "mpi", {}, {"shm_prefix": prefix, "hosts": [h for h, _ in hosts]},
                  local_workers=tuple(range(1, k0)), rank_config=rank_config, guardian=guardian)


def attach_control(cfg, rank, waiter):
    """A worker's control plane, from the configuration its master gave it (the first
    thing a worker makes: it replies through it, failures of the rest included)."""
    if cfg["topology"] == "mpi":
        return implementation("control", "shm")(cfg["prefix"], cfg["slots"], cfg["slot"], 0, waiter,
                                                create=False, members=cfg["members"], lead=cfg["lead"],
                                                mirror=cfg["mirror"])
    return implementation("control", "shm")(cfg["prefix"], cfg["n"], rank, cfg["master_rank"], waiter,
                                            create=False)


def attach_comm(cfg, rank, control, device):
    """A worker's comm stack (``device``: the worker's, ``make_device(cfg["device"], n)``)."""
    n, master = cfg["n"], cfg["master_rank"]
    if cfg["topology"] == "mpi":
        host_comm = implementation("comm", "hier")(cfg["prefix"], cfg["slot"], control, False,
                                                   cfg["host_index"], cfg["host_sizes"], cfg["rank"])
    else:
        host_comm = implementation("comm", "shm")(cfg["prefix"], rank, n, control, create=False)
    return _comm_stack(host_comm, device, rank, n, master, control)


# ---- freeing ------------------------------------------------------------------------------


def remove(planes, graceful):
    """Free what the master's session left (its shared memory; across hosts, the other
    hosts' sessions: ``graceful`` when its workers quit cleanly)."""
    segments.remove_all(planes.resources["shm_prefix"])
    if planes.guardian is not None:
        planes.guardian.release()
    if planes.topology == "mpi":
        mpi_hosts.end_agents(graceful)


def worker_exit(cfg):
    """A worker whose master (or host agent) is gone frees the session's shared memory."""
    if cfg["topology"] == "mpi":
        mpi_hosts.remove_job_files(cfg)
    else:
        segments.remove_all(cfg["prefix"])


def reap(topology):
    """Remove what earlier sessions of this user left when all their processes were killed
    (one host; across hosts every host's agent cleans up its own)."""
    return reap_stale_sessions() if topology == "local" else 0


# ---- channels -----------------------------------------------------------------------------


def open_channel(control, ranks, up_bytes, down_bytes):
    """The master's ``channel.Channel`` to the workers ``ranks`` of the command about to be
    sent, for the session's control plane (one host or several)."""
    cls = implementation("channel", control.channel_kind)
    if control.channel_kind == "shm":
        return cls.create(control, ranks, up_bytes, down_bytes)
    return cls(control, ranks, up_bytes, down_bytes)


def attach_channel(control, token, rank):
    """Worker ``rank``'s ``channel.WorkerChannel`` of channel ``token`` (on every host, the
    host's shared-memory channel)."""
    return implementation("channel", "shm").attach(control, token, rank)

"""Implementations of the control and comm planes, and how a session picks them.

A backend module provides ``create(session) -> Planes`` in the master, ``attach(cfg, rank,
waiter) -> (control, comm)`` in a worker (``cfg`` is ``Planes.worker_config`` plus the
session's settings), ``remove(session)`` (free whatever the session left) and ``reap()``
(remove what earlier sessions of this user left when all their processes were killed).

``mpi`` (``backends.mpi``): a session over several hosts, under ``mpiexec``.

``local``: the ranks of one host, POSIX shared memory for both planes.  When the device
keeps arrays on itself (``placement == "device"``: the JAX device), the comm stack puts in
front of the host collectives a host-staged path for device arrays and, where the device
session uses them, XLA's own collectives (NCCL on GPUs): ``device_stack``."""
from dataclasses import dataclass, field

from . import shm
from .shm_comm import ShmComm
from .shm_control import ShmControl, reap_stale_sessions
from ..comm import CommStack


@dataclass
class Planes:
    control: object
    comm: object
    worker_config: dict = field(default_factory=dict)
    resources: dict = field(default_factory=dict)   # for diagnostics: what the session owns
    launcher: object = None          # None: worker processes of this host (SubprocessLauncher)
    local_workers: object = None     # ranks the launcher starts (None: control.workers)
    rank_config: object = None       # rank -> what that worker's configuration adds


class _Local:
    name = "local"

    @staticmethod
    def create(session):
        if session.device.placement != "host":     # (may refuse: before anything is created)
            session.device.plan_comm(session.master_rank, session._check)   # before its config() goes out
        prefix = shm.new_prefix()
        control = ShmControl(prefix, session.n, session.rank, session.master_rank, session.waiter, create=True)
        shm_comm = ShmComm(prefix, session.rank, session.n, control, create=True)
        comm = device_stack(shm_comm, session.device, session.rank, session.n, session.master_rank, control)
        return Planes(control, comm, {"backend": "local", "prefix": prefix}, {"shm_prefix": prefix})

    @staticmethod
    def attach(cfg, rank, waiter):
        control = ShmControl(cfg["prefix"], cfg["n"], rank, cfg["master_rank"], waiter, create=False)
        shm_comm = ShmComm(cfg["prefix"], rank, cfg["n"], control, create=False)
        device = cfg.get("device") or {"kind": "cpu"}
        if device.get("kind", "cpu") != "cpu":
            from ..device import make_device
            device = make_device(device, cfg["n"])     # (what moves arrays; the worker builds its own)
            return control, device_stack(shm_comm, device, rank, cfg["n"], cfg["master_rank"], control)
        return control, CommStack([shm_comm])

    @staticmethod
    def remove(session):
        info = getattr(session, "info", None)
        if info is not None:
            shm.remove_all(info.resources["shm_prefix"])

    @staticmethod
    def worker_exit(cfg):
        """A worker whose master is gone removes the session's shared memory."""
        shm.remove_all(cfg["prefix"])

    @staticmethod
    def reap():
        return reap_stale_sessions()


def device_stack(shm_comm, device, rank, n, master_rank, control):
    """The comm stack of a session: for a device that keeps arrays on itself, XLA's
    collectives (if its session uses them), then the host-staged path, then the host."""
    if getattr(device, "placement", "host") == "host":
        return CommStack([shm_comm])
    from .staged_comm import StagedComm
    impls = []
    front = None
    if getattr(device, "xla", None):
        from .xla_comm import XlaComm
        front = XlaComm(rank, n, master_rank, control, shm_comm)
        impls.append(front)
    impls.append(StagedComm(shm_comm, device, getattr(device, "why_staged", None), front))
    impls.append(shm_comm)
    return CommStack(impls)


local_backend = _Local()
BACKENDS = {"local": local_backend}


def backend_named(name):
    """The backend a worker's configuration names (``mpi`` is imported only when used)."""
    if name == "mpi":
        from .mpi import mpi_backend
        return mpi_backend
    return BACKENDS[name]

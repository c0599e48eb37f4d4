"""Implementations of the control and comm planes, and how a session picks them.

A backend module provides ``create(session) -> Planes`` in the master, ``attach(cfg, rank,
waiter) -> (control, comm)`` in a worker (``cfg`` is ``Planes.worker_config`` plus the
session's settings), ``remove(session)`` (free whatever the session left) and ``reap()``
(remove what earlier sessions of this user left when all their processes were killed).

``local``: the ranks of one host, POSIX shared memory for both planes."""
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


class _Local:
    name = "local"

    @staticmethod
    def create(session):
        prefix = shm.new_prefix()
        control = ShmControl(prefix, session.n, session.rank, session.master_rank, session.waiter, create=True)
        comm = CommStack([ShmComm(prefix, session.rank, session.n, control, create=True)])
        return Planes(control, comm, {"backend": "local", "prefix": prefix}, {"shm_prefix": prefix})

    @staticmethod
    def attach(cfg, rank, waiter):
        control = ShmControl(cfg["prefix"], cfg["n"], rank, cfg["master_rank"], waiter, create=False)
        comm = CommStack([ShmComm(cfg["prefix"], rank, cfg["n"], control, create=False)])
        return control, comm

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


local_backend = _Local()
BACKENDS = {"local": local_backend}

"""The launcher plane: starting the ranks, telling whether each is alive, stopping them.

Implementations (wired by ``synkhronos.backends``): ``subprocess``
(``backends.host.launcher``: worker processes of this host, children of the master) and
``mpi`` (``backends.mpi.launcher``: this host's workers, and the other hosts' ranks as
their agents report them)."""
from typing import Callable, Collection, Iterable, Optional, Protocol, runtime_checkable


class RankGone(Exception):
    """A launcher's report: ``rank`` exited (``returncode``) or has been stopped for
    ``stopped`` seconds, on ``host`` (None: this host).  The session turns it into
    ``WorkerDied`` / ``WorkerStopped``."""

    def __init__(self, rank: int, returncode: Optional[int] = None, stopped: Optional[float] = None,
                 host: Optional[str] = None):
        super().__init__(rank, returncode, stopped)
        self.rank, self.returncode, self.stopped, self.host = rank, returncode, stopped, host


@runtime_checkable
class Launcher(Protocol):
    """Starts and watches the worker processes of a session."""

    host: str           # the host the master runs on

    def start(self, ranks: Iterable[int], argv: Callable[[int], list], env_for: Callable[[int], dict]) -> None:
        """Start one process per rank: ``argv(rank)`` its command line, ``env_for(rank)``
        its environment."""

    def check(self, leaving: Collection[int] = ()) -> None:
        """Raise ``RankGone`` for the first rank found exited or stopped.  A rank in
        ``leaving`` (told to quit) that exited with status 0 did as told: not reported."""

    def info(self) -> list:
        """``[(rank, host, pid)]`` of the ranks this launcher started (and knows of)."""

    def stop(self, graceful: bool = True) -> None:
        """Wait for the ranks to exit (briefly unless ``graceful``), then kill what is left."""

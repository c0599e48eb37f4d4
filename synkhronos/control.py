"""The control plane: how the master's commands reach the ranks and their replies come back.

A command (``messages.Command``) is numbered by a sequence number that only grows; every
reply (``messages.Reply``) carries the number of the command it answers, so a reply left
over from an interrupted command can never be taken for the current one.  Besides commands
and replies the plane gives the ranks of a command three ways to agree:

* ``abort(seq)``: any rank makes every rank leave the waits of command ``seq``;
* ``barrier()``: all ranks meet (raises ``errors.Aborted`` if the command was aborted);
* ``vote(ok)``: all-or-nothing decisions.  Every rank votes; all decide "commit" only if
  every rank voted yes, so state changed on one rank is changed on all or on none (signals
  are held from a rank's vote to the end of the command: an interrupt cannot split it).

and it delivers a call's inputs: ``alloc`` gives the master buffers that ranks can read
(``view``), and ``forget`` drops the ones the master released.  Every wait goes through
the plane's ``waiter`` (``waiting.Waiter``): liveness, stall warnings, timeout.

Implementations (wired by ``synkhronos.backends``): ``shm`` (``backends.shm.control``: the
ranks of one host, POSIX shared memory) and ``mpi`` (``backends.mpi.control``: a session
over several hosts, shared memory inside each and MPI between them)."""
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol, Sequence, runtime_checkable

from .messages import Command, Reply
from .waiting import Waiter


@runtime_checkable
class Buffer(Protocol):
    """Memory the master fills and ranks read: ``handle`` names it for the ranks."""

    handle: Any

    def array(self, dtype, shape) -> Any:
        """A numpy view of the buffer (no copy)."""

    def release(self) -> None:
        """Free the buffer (ranks drop their mappings when the master says ``forget``)."""


@runtime_checkable
class Control(Protocol):
    """A control plane seen from one rank: what every rank of a command does."""

    rank: int
    n: int
    master_rank: int
    waiter: Waiter
    seq: int                  # the command this rank is in (or was in last)
    channel_kind: str         # which channel implementation serves this plane (``backends``)

    def begin(self, seq: int) -> None:
        """This rank starts command ``seq`` (barrier and vote numbering restart)."""

    def abort(self, seq: Optional[int] = None) -> None:
        """Make every rank leave the waits of command ``seq`` (default: the current one)."""

    def aborted(self) -> bool:
        """Whether the current command was aborted."""

    def barrier(self, check_after: bool = True) -> None:
        """All ranks meet.  Raises ``Aborted`` when the command was aborted (also when every
        rank had arrived, unless ``check_after`` is False)."""

    def vote(self, ok: bool, on_commit: Optional[Callable[[], Any]] = None,
             meanwhile: Optional[Callable[[], Any]] = None) -> bool:
        """All-or-nothing: returns True (commit) only if every rank voted ``ok``; then runs
        ``on_commit`` (on every rank alike).  ``meanwhile``: work a rank may do while the
        decision is awaited (used only if it commits)."""

    def view(self, handle, dtype, shape) -> Any:
        """A local numpy view of the buffer ``handle`` (attached on first use)."""

    def array(self, ref) -> Any:
        """The local array of a ``plans.ArrayRef`` (an empty array for a None handle)."""

    def forget(self, handles: Iterable) -> None:
        """Drop the mappings of buffers the master released."""

    def sleep(self, tick: float) -> None:
        """Block until this rank is woken (``wake``) or ``tick`` seconds pass."""

    def wake(self, ranks: Iterable[int]) -> None:
        """Wake ``ranks`` (slots of this plane) from ``sleep``: a hint, never a message."""

    def flight_area(self, slot: int) -> Optional[tuple]:
        """The flight recorder's area of ``slot`` (``synkhronos.flight``): an int64 and a
        float64 view of the same words, which the master can read without the rank's help;
        None where the plane keeps none."""

    def close(self) -> None:
        """Free what this rank holds of the plane (the master: the whole session's)."""


@runtime_checkable
class MasterControl(Control, Protocol):
    """The master's control plane: it sends the commands and collects the replies."""

    workers: tuple            # the ranks commands go to and replies come from

    def send(self, seq: int, command: Command, needs=()) -> None:
        """Hand command ``seq`` to every worker and wake them.  ``needs`` (``plans.Need``s,
        or a function that makes them: only a plane that uses them pays for them): the
        master's data the command's ranks read (a plane whose ranks cannot read the
        master's buffers in place ships it to them)."""

    def committed(self) -> int:
        """The sequence number of the last command the workers can see."""

    def collect(self, seq: int, ranks: Sequence[int], what: str = "command") -> Iterator[tuple[int, Reply]]:
        """Wait for the replies of ``ranks`` to command ``seq``; yields ``(rank, reply)`` as
        each one is read (a caller interrupted midway keeps what it got)."""

    def peek(self, seq: int, rank: int) -> Optional[Reply]:
        """Rank ``rank``'s reply to command ``seq`` if it is there already, else None."""

    def alloc(self, nbytes: int, tag: str = "d", kept: bool = True) -> Buffer:
        """A ``Buffer`` of at least ``nbytes`` that every rank can ``view``; ``kept``: its
        contents outlive the session (a user's ``synk.Data``; the session's own staging
        is not, and its memory goes back when the session ends, whoever still maps it)."""

    def flights(self, wait: float = 0.0, ranks: Optional[dict] = None, host: str = "") -> list:
        """Every rank's ``flight.RankFlight`` (other hosts' asked for and awaited ``wait``
        seconds; 0: the last ones received, with no message sent)."""


@runtime_checkable
class WorkerControl(Control, Protocol):
    """A worker's control plane: it receives the commands and replies."""

    def receive(self) -> tuple[int, Command]:
        """Wait for the next command; returns ``(seq, command)``."""

    def reply(self, seq: int, reply: Reply) -> None:
        """Answer command ``seq`` (and wake the master)."""

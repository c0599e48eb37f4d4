"""Channels: asynchronous point-to-point messages between the master and each worker of ONE
command (e.g. a parameter server's pushes and answers), while the command runs.

The control plane runs commands in lockstep; some exchanges do not fit that shape (a
server answers each worker as its message arrives, for as long as a run lasts).  Such a
run is one long command, and a channel carries its messages: per worker an *up* area
(worker -> master) and a *down* area (master -> worker), each with ``N_META`` int64 of
metadata.  A run starts with the master's answer to each worker (``answer(rank, meta,
consumed=False)``; across hosts that first answer opens the channel on the worker's host),
so a worker's first call is ``wait_answer``; then it sends a message and waits for the
answer, in turn.  A worker sends only once its previous message was answered, so neither
side ever writes an area the other may be reading.

The master opens a channel with ``synkhronos.backends.open_channel(control, ranks,
up_bytes, down_bytes)`` (a ``Channel``); each worker attaches with
``synkhronos.backends.attach_channel(control, token, rank)`` (a ``WorkerChannel``).
Implementations: ``shm`` (``backends.shm.channel``: one host) and ``mpi``
(``backends.mpi.channel``: across hosts, each host's agent relays its workers)."""
import struct
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np

STARTING, RUNNING, FINISHED, FAILED = 0, 1, 2, 3      # a worker's state, as it reports it
N_META = 4                                          # int64 of metadata per message
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def float_bits(x):
    """A float64 as an int64 (to carry it in a message's metadata)."""
    return _I64.unpack(_F64.pack(float(x)))[0]


def bits_float(i):
    """Inverse of ``float_bits``."""
    return _F64.unpack(_I64.pack(int(i)))[0]


@runtime_checkable
class Channel(Protocol):
    """The master's end of a channel to the workers ``ranks`` of one command."""

    token: str                # names the channel for the workers (sent with the command)
    ranks: tuple

    def pending(self) -> list:
        """The workers whose latest message the master has not consumed yet."""

    def message(self, rank: int) -> tuple:
        """The metadata of ``rank``'s pending message (its up area holds the data)."""

    def up(self, rank: int, dtype=np.uint8, count: Optional[int] = None) -> Any:
        """The up area of ``rank`` as an array of ``dtype`` (``count`` elements, default:
        as many as fit)."""

    def down(self, rank: int, dtype=np.uint8, count: Optional[int] = None) -> Any:
        """The down area of ``rank`` (the master writes its answer there)."""

    def answer(self, rank: int, meta=(), consumed: bool = True) -> None:
        """Publish the answer written into ``rank``'s down area (its pending message, if any,
        is consumed first) and wake the worker."""

    def status(self, rank: int) -> str:
        """``"alive"``, ``"starting"``, ``"finished"``, ``"failed"``, ``"dead"`` or
        ``"stopped"`` (SIGSTOP, a debugger)."""

    def wait_any(self, timeout: float) -> bool:
        """Return once a worker has a pending message (True), or after ``timeout`` seconds."""

    def stop(self) -> None:
        """Tell every worker to leave its loop (its ``wait_answer`` returns None)."""

    def close(self) -> None:
        """Free the channel (views handed out stay valid until dropped)."""


@runtime_checkable
class WorkerChannel(Protocol):
    """A worker's end of a channel."""

    def set_state(self, state: int) -> None:
        """Report ``STARTING``/``RUNNING``/``FINISHED``/``FAILED`` to the master."""

    def up(self, rank: int, dtype=np.uint8, count: Optional[int] = None) -> Any:
        """This worker's up area (``rank``: its own rank)."""

    def down(self, rank: int, dtype=np.uint8, count: Optional[int] = None) -> Any:
        """This worker's down area."""

    def send(self, meta=()) -> None:
        """Publish the message written into the up area (``meta``: up to ``N_META`` ints)
        and wake the master.  Only after the previous one was answered."""

    def wait_answer(self, what: str = "an answer of the master") -> Optional[tuple]:
        """The metadata of the master's next answer (the down area holds its data), or None
        once the master stopped the channel.  Raises ``Aborted`` when the command was
        aborted."""

    def close(self) -> None:
        """Unmap the channel."""

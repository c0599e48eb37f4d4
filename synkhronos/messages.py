"""The records the master and its workers exchange through the control plane.

A ``Command`` is what the master asks every worker to run; a ``Reply`` is each worker's
answer.  Control planes carry them as plain tuples on the wire (they pickle faster) and
hand them to the runtime as these records."""
from typing import Any, NamedTuple, Optional


class Command(NamedTuple):
    """Run ``name`` (a registered worker command, ``commands.handler``) with ``args``;
    first drop the buffers in ``forget`` (the master released them) and settle what the
    previous command left pending (``settle``: ``(seq, commit)`` or None)."""
    name: str
    args: Any
    forget: tuple = ()
    settle: Optional[tuple] = None


class Reply(NamedTuple):
    """A worker's answer: ``status`` is "ok" (``value`` is the result), "err" (``value`` is
    the formatted traceback) or "aborted" (another rank failed); ``fingerprint`` in debug
    mode (``synkhronos.debug``)."""
    status: str
    value: Any = None
    fingerprint: Any = None

    @classmethod
    def from_wire(cls, t):
        return t if isinstance(t, cls) else cls(*t)

    def to_wire(self):
        return tuple(self) if self.fingerprint is not None else (self.status, self.value)


OK = Reply("ok", None)          # the commonest reply (control planes may send it without a message)

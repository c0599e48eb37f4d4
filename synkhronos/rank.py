"""What one process holds to act as a rank, master or worker: its device, control and comm
planes, and the shared variables and functions every rank holds in the same order.  By
convention a ``Rank`` is called ``me`` (the first argument of every worker command; the
master's is ``session.me``).

``current()`` is the rank this process is acting as while it runs its share of a command
(always, in a worker; in the master only inside a command), else None: code that runs
inside compiled graphs (collective ops) uses it to reach the comm plane."""
import os

from . import flight, shards, timeline
from .signals import deferred

_current = None


def current():
    """The ``Rank`` this process is acting as right now, or None (plain PyTensor use)."""
    return _current


def run_share(rank, fn):
    """Run ``fn()`` (this rank's share of a command) acting as ``rank``.  Signals held by a
    commit inside it stay held until the caller's ``signals.release()`` (the end of the
    command: a committed command is finished on every rank before an interrupt lands)."""
    global _current
    saved, _current = _current, rank
    try:
        return fn()
    finally:
        _current = saved


def become(rank):
    """Act as ``rank`` from now on (a worker process)."""
    global _current
    _current = rank
class Rank:
    def __init__(self, rank, n, master_rank, device, control, comm):
        self.rank, self.n, self.master_rank = rank, n, master_rank
        self.device, self.control, self.comm = device, control, comm
        self.shareds = []      # registry index -> shared variable (same order on every rank)
        self.replicas = []     # function id -> Replica
        self.pending = None    # (seq, {var: new value}) of a command's updates, until settled
        self.ahead = None      # (seq, {var: value before}) of values set before the command settles
        self.call_cache = {}   # function id -> (wire plan, plan, its input views): a worker's last call
        self.seq = 0           # the command this rank is running (or ran last)
        self.extras = {}       # state that extensions keep on this rank, by name
        # the flight recorder of this rank: the worker loop, the waits and the comm stack write to it
        self.flight = flight.recorder(control, control.rank, os.getpid())
        if timeline.current() is not None:     # (synk.fork(timeline=...): spans kept as well)
            self.flight = timeline.Recording(self.flight, timeline.current())
        control.waiter.flight = self.flight
        comm.flight = self.flight

    is_master = property(lambda self: self.rank == self.master_rank)

    def forget(self, handles):
        """The master released these buffers: drop their mappings and any view of them."""
        if handles:
            self.control.forget(handles)
            self.call_cache.clear()

    def view(self, ref):
        """The local array of an ``ArrayRef``."""
        return self.control.array(ref)

    def inputs(self, refs, n_scatter, rows):
        """This rank's rows of a call's scattered inputs (``refs[:n_scatter]``, selected by
        the ``plans.Rows`` ``rows``) and its whole broadcast inputs."""
        index = None if rows.index is None else self.view(rows.index)
        arrays = [self.view(ref) for ref in refs]
        scat = [shards.take_rows(a, rows, self.rank, mb, index) for a, mb in zip(arrays[:n_scatter], rows.minibatch)]
        return scat, arrays[n_scatter:]

    def hold(self, seq, values):
        """Keep ``values`` (``{shared variable: new value}``: this rank's share of command
        ``seq``'s updates) until the master says whether every rank succeeded."""
        if self.pending is not None and self.pending[0] == seq:
            self.pending[1].update(values)
        else:
            self.pending = (seq, dict(values))

    def pending_value(self, var):
        """The value ``var`` will have once the command in progress is committed."""
        if self.pending is not None and self.pending[0] == self.seq and var in self.pending[1]:
            return self.pending[1][var]
        return self.device.get(var)

    def set_ahead(self, var, value):
        """Set ``var`` to ``value`` now, within command ``seq``, for what the command does next
        (a chained training step's update rule reads the all-reduced gradient), and hold it as
        one of its updates: unless the command is committed, ``settle``/``drop`` put the value
        before it back (all or nothing, on every rank)."""
        if self.ahead is None or self.ahead[0] != self.seq:
            self.ahead = (self.seq, {})
        self.ahead[1].setdefault(var, self.device.get(var))
        self.device.set(var, value)
        self.hold(self.seq, {var: value})

    def settle(self, settle):
        """Apply or drop what command ``settle[0]`` left pending (``settle[1]``: commit)."""
        pending, self.pending = self.pending, None
        committed = settle is not None and settle[1]
        if committed and pending is not None and pending[0] == settle[0]:
            for var, value in pending[1].items():
                self.device.set(var, value)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and not (committed and settle[0] == ahead[0]):
            self._put_back(ahead)
        self.comm.settle(committed)

    def drop(self):
        """The command in progress failed or was interrupted here: its pending values are
        dropped, the values it set ahead put back."""
        ahead, self.pending, self.ahead = self.ahead, None, None
        if ahead is not None:
            self._put_back(ahead)
        self.comm.settle(False)

    def _put_back(self, ahead):
        with deferred():                  # (all of them: an interrupt lands after)
            for var, value in ahead[1].items():
                self.device.set(var, value)

"""Asynchronous training with the master as parameter server (Inspur parallel Caffe,
Downpour SGD): ``ParameterServer`` and what a run returns, ``PSResult``.  The master's
serving loop is ``ps_server``, a worker's loop ``ps_worker``; they exchange through a
channel (shared memory inside a host; across hosts each host's agent relays its
workers' messages over MPI)."""
from dataclasses import dataclass, field

import numpy as np

import synkhronos as synk
from synkhronos.backends import open_channel
from synkhronos.data import array_ref
from synkhronos.function import replica_of
from synkhronos.plans import Need, Rows
from synkhronos.session import get_session

from .common import as_list, before_distribute, shared_id
from .ps_server import Server
from .ps_worker import COMMAND


@dataclass
class PSResult:
    """What ``ParameterServer.run`` did.

    ``applied``: gradients applied (the server's updates); ``dropped``: gradients staler
    than ``max_staleness`` (answered with fresh weights, not applied); ``version``: the
    server's update count after the run (across runs); ``seconds``: wall time of the run;
    ``per_rank``: rank -> ``{"sent", "applied", "dropped", "max_staleness",
    "mean_staleness"}``; ``staleness``: every applied gradient's staleness (updates made
    by others between the weights it was computed on and its own); ``dead`` / ``slow``:
    ``(rank, seconds into the run, what)`` of the workers reported; ``events``:
    ``(seconds, version, rank, staleness, loss, applied)`` per gradient received."""
    applied: int = 0
    dropped: int = 0
    version: int = 0
    seconds: float = 0.0
    per_rank: dict = field(default_factory=dict)
    staleness: list = field(default_factory=list)
    dead: list = field(default_factory=list)
    slow: list = field(default_factory=list)
    events: list = field(default_factory=list)
    workers: dict = field(default_factory=dict)

    @property
    def max_staleness(self):
        return max(self.staleness) if self.staleness else 0


class ParameterServer:
    """Asynchronous training with the master as parameter server (Inspur parallel Caffe,
    Downpour SGD).  Build before ``synk.distribute()``::

        ps = ParameterServer(loss, params, [x, y], updates.sgd, learning_rate=0.05)
        synk.distribute()
        result = ps.run(X_data, y_data, steps=1000, batch_size=32)

    ``run`` is one long command.  Each worker (every rank but the master) loops: take the
    newest weights, compute the gradient of ``loss`` on ``batch_size`` rows of its own
    shard of the data (rows split over the workers, shuffled each pass, seeded by
    ``seed`` and the rank), send it, wait for the answer.  The master serves: it applies
    each gradient as it arrives with the update rule (its state lives in the master) and
    answers with the current weights, round-robin over the workers with a message.  A
    gradient computed on weights more than ``max_staleness`` updates old is dropped (the
    worker gets fresh weights), so every applied gradient's staleness is within the bound.
    Workers never wait for each other: a slow worker only delays itself (and is reported
    once it has sent nothing for ``slow_after`` seconds); a dead one is reported and
    skipped, the run goes on with the others, and ``run`` then raises ``WorkerDied`` (the
    session is closed: it cannot run lockstep commands without that rank), with the run's
    ``PSResult`` as its ``ps_result``.  A worker whose computation raises ends the run at
    once (most likely every worker would): ``run`` gives every rank the server's weights,
    then raises ``WorkerError`` naming it (with ``ps_result``); the session goes on.

    The master only serves (it computes no gradients), so n ranks give n - 1 computing
    workers.  On one host master and workers exchange through shared memory; under
    ``mpiexec`` (several hosts) the workers of another host exchange through their host's
    agent, which relays each gradient to the master and each answer back over MPI (once
    per message, no pickling), with the same guarantees: staleness within the bound, a
    slow, dead or frozen worker on any host reported (``WorkerDied`` / ``WorkerStopped``
    naming rank and host) without stalling the others."""

    def __init__(self, loss, params, inputs, update_rule, *args, max_staleness=None, name="ps", **kwargs):
        session = before_distribute("ParameterServer")
        self.params = as_list(params)
        self.inputs = as_list(inputs)
        grad_updates, param_updates, grad_shared = update_rule(loss, self.params, *args, **kwargs)
        if isinstance(grad_shared, (list, tuple)):
            raise TypeError("ParameterServer needs a rule with one flat gradient vector (updates.sgd, "
                            "adam, ...), not sgd_nonflat")
        flat = [e for v, e in grad_updates if v is grad_shared]
        if len(grad_updates) != 1 or not flat:
            raise TypeError("ParameterServer: the rule's gradient function may only write the flat "
                            "gradient (no other updates such as batch-norm statistics)")
        self.grad_shared = grad_shared
        self.dtype = np.dtype(grad_shared.type.dtype)
        self.size = int(grad_shared.get_value(borrow=True).size)
        self.grad_function = synk.function(self.inputs, outputs=[loss, flat[0]], name=f"{name}_grad")
        self.update_function = synk.function([], updates=param_updates, name=f"{name}_update")
        self.n_workers = session.n - 1
        self.max_staleness = max(1, 2 * self.n_workers) if max_staleness is None else int(max_staleness)
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.version = 0
        self.last_result = None
        self._warm = False

    def _check(self, session, steps, max_seconds, batch_size, datas):
        if session.n < 2:
            raise ValueError("ParameterServer.run needs at least one worker besides the master: fork(2) or more")
        if steps is None and max_seconds is None:
            raise ValueError("give steps (gradients to apply) or max_seconds")
        if steps is not None and (isinstance(steps, bool) or int(steps) < 1):
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if len(datas) != len(self.inputs):
            raise TypeError(f"run takes {len(self.inputs)} data inputs, got {len(datas)}")
        lengths = {len(d) for d in datas}
        if len(lengths) != 1:
            raise ValueError(f"the data inputs have different lengths {sorted(lengths)}")
        n_rows = lengths.pop()
        shard = n_rows // self.n_workers
        if shard < int(batch_size):
            raise ValueError(f"each of the {self.n_workers} workers gets {shard} rows of the data, fewer than "
                             f"batch_size={batch_size}")
        return n_rows

    def run(self, *data, steps=None, batch_size=32, max_seconds=None, seed=0, slow_after=10.0, sync=True,
            verbose=True):
        """Train until ``steps`` gradients are applied (or ``max_seconds`` pass); returns a
        ``PSResult``.  ``data``: one ``synk.Data`` (or array) per input, rows along axis 0.
        With ``sync`` the master's final weights are broadcast to every rank afterwards."""
        session = get_session(True)
        datas = [d if isinstance(d, synk.Data) else synk.data(np.asarray(d), var=v)
                 for d, v in zip(data, self.inputs)]
        n_rows = self._check(session, steps, max_seconds, batch_size, datas)
        for d, v in zip(datas, self.inputs):
            if d.dtype != np.dtype(v.type.dtype) or d.ndim != v.type.ndim:
                raise TypeError(f"data for {v}: dtype {d.dtype}, ndim {d.ndim}; expected {v.type.dtype}, "
                                f"ndim {v.type.ndim}")
        if not self._warm:              # compile in the master, load in the workers (a normal call)
            self.grad_function(*datas, batch=slice(0, min(n_rows, 2 * session.n)))
            replica_of(self.update_function).f()                       # compiled; result dropped
            self._warm = True
        nbytes = self.size * self.dtype.itemsize
        with session.api(True):
            me = session.me
            workers = tuple(me.control.workers)
            ch = open_channel(me.control, workers, nbytes, nbytes)
            try:
                spec = dict(channel=ch.token, workers=workers, nbytes=nbytes, dtype=self.dtype.str,
                            grad_fid=replica_of(self.grad_function).fid,
                            params=[shared_id(session, p, "ParameterServer") for p in self.params],
                            data=[array_ref(d) for d in datas], rows=n_rows, batch=int(batch_size),
                            seed=int(seed))
                result = PSResult(version=self.version)
                self.last_result = result
                server = Server(self, session, ch, workers, result, steps, max_seconds, slow_after, verbose)
                # worker j reads rows [j * rows // w, (j + 1) * rows // w) of every input (the
                # master none): what a session across hosts ships to each host with the command
                w = len(workers)
                rows = Rows("range", (0,) + tuple((j * n_rows) // w for j in range(w + 1)))
                needs = tuple(Need(array_ref(d), rows) for d in datas)
                try:
                    _, replies = session.execute(COMMAND, (spec,), server.serve,
                                                 what="parameter server run", needs=needs)
                except synk.RankLost as e:
                    e.ps_result = result
                    raise
                except synk.WorkerError as e:       # a worker raised: the run ends at once
                    failed = e
                else:
                    failed = None
                    for r, rep in replies.items():
                        if rep is not None:
                            result.workers[r] = rep
            finally:
                ch.close()
        self.version = result.version
        if sync or failed is not None:      # (after a failure too: no rank keeps other weights)
            synk.broadcast(self.params)
        if failed is not None:
            failed.ps_result = result
            raise failed
        return result

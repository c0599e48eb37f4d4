"""Training that goes on when a worker is lost.

A loop run by ``run(setup, train, state)`` survives ``WorkerDied``, ``WorkerStopped`` and
``StallTimeout`` (a rank lost: killed, frozen, out of memory): the session is closed, a new
one is forked with the ranks that are left (``replace=True``: as many as before, where the
lost process can simply be started again, as on one machine), ``setup`` builds the functions
again, every shared variable and the loop's counters come back from the last commit, and
``train`` is called again, from there.

.. code-block:: python

    state = elastic.State(step=0)

    def setup(n):                       # after each synk.fork(): build, distribute
        step = train.make_train_function(loss, params, [x, y], updates.adam)
        synk.distribute()
        return step

    def loop(step, state):
        while state.step < 1000:
            rows = batches[state.step]              # the global batch: the same for any n
            step(X[rows], Y[rows])
            state.step += 1
            if state.step % 10 == 0:
                state.commit()                      # every rank's variables + the counters

    elastic.run(setup, loop, state, n_parallel=4)

The rule for batch size and learning rate: the loop keeps its *global* batch and its
learning rate, so fewer ranks each take more rows of the same batch and the step computes
the same thing (data-parallel sums; to rounding).  A run that loses a worker ends where the
undisturbed run ends; it only takes longer: the steps since the last commit again, and the
restart (``state.restarts`` records each: ranks lost, ranks before and after, seconds from
the failure to training again, steps redone).  Per-rank state follows ``checkpoint``'s rule
at another world size (the mean of the saved ranks).

Commits are kept in memory (``checkpoint.snapshot``: every rank's variables gathered to the
master); ``checkpoint=PATH`` also writes each one to disk (``synk.save``), and a run started
with such a file present resumes from it: the way on when a whole machine is lost under
``mpiexec`` (MPICH ends the job; the script started again on the machines left goes on)."""
import os
import sys
import time

from . import checkpoint as ckpt
from .errors import RankLost


class State:
    """The loop's counters (JSON values, as attributes) and the last commit of them with every
    rank's shared variables.  ``restarts``: one dict per recovery."""

    def __init__(self, **counters):
        self.__dict__["_names"] = list(counters)
        self.__dict__["_committed"] = None
        self.__dict__["_path"] = None
        self.__dict__["restarts"] = []
        for k, v in counters.items():
            self.__dict__[k] = v

    def __setattr__(self, name, value):
        if name not in self._names:
            self._names.append(name)
        self.__dict__[name] = value

    def counters(self):
        return {k: self.__dict__[k] for k in self._names}

    def commit(self):
        """Keep every rank's shared variables and the counters as they are now: a lost
        worker brings the run back here."""
        manifest, arrays = ckpt.snapshot(self.counters())
        self.__dict__["_committed"] = (manifest, arrays)
        if self._path is not None:
            ckpt.save(self._path, self.counters())

    def save_to(self, path):
        """Write every commit to ``path`` too (``synk.save``); a commit found there is the
        starting point (a run that resumes)."""
        self.__dict__["_path"] = os.fspath(path) if path is not None else None
        if self._path is not None and os.path.exists(self._path):
            self.__dict__["_committed"] = ckpt.read(self._path)

    def committed(self):
        """The counters of the last commit (None before the first)."""
        return None if self._committed is None else self._committed[0]["state"]

    def restore(self):
        """Every rank's variables and the counters back to the last commit."""
        counters = ckpt.restore(*self._committed, where="the last commit")
        for k, v in counters.items():
            setattr(self, k, v)


def run(setup, train, state, n_parallel=None, replace=False, min_ranks=1, max_restarts=10, checkpoint=None,
        **fork_kwargs):
    """``train(setup(n), state)`` in a session of ``n_parallel`` ranks, again from the last
    ``state.commit()`` whenever a rank is lost (see the module's docstring); returns what
    ``train`` returns.  ``setup(n)`` builds the functions and calls ``synk.distribute()``
    after every ``synk.fork()``.  Raises the loss when fewer than ``min_ranks`` would be left
    or after ``max_restarts`` recoveries.  Other exceptions end the run as they are."""
    from . import session as sessions
    if not isinstance(state, State):
        raise TypeError(f"elastic.run needs an elastic.State, got {type(state).__name__}")
    state.save_to(checkpoint)
    n_ask, failed = n_parallel, None
    while True:
        n = sessions.fork(n_ask, **fork_kwargs)
        try:
            model = setup(n)
            if state.committed() is not None:
                state.restore()
            else:
                state.commit()                       # the starting point
            if failed is not None:
                failed["seconds_to_resume"] = time.perf_counter() - failed.pop("t")
                state.restarts.append(failed)
                print(f"synkhronos.elastic: training again at {n} rank(s) "
                      f"{failed['seconds_to_resume']:.1f} s after losing rank(s) {failed['lost']}; "
                      f"from the commit at {state.counters()}", file=sys.stderr, flush=True)
                failed = None
            return train(model, state)
        except RankLost as e:
            lost = list(getattr(e, "ranks", ()) or ())
            left = n - max(1, len(lost))
            n_next = n if replace else left
            if len(state.restarts) >= max_restarts or n_next < min_ranks or state.committed() is None:
                raise
            failed = {"lost": lost, "ranks_before": n, "ranks_after": n_next, "t": time.perf_counter(),
                      "error": f"{type(e).__name__}: {e}", "at": state.counters(), "committed": state.committed()}
            print(f"synkhronos.elastic: {type(e).__name__}: {e}; continuing with {n_next} rank(s) from the "
                  f"last commit", file=sys.stderr, flush=True)
            n_ask = n_next
        finally:
            sessions.close()

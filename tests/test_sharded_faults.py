"""Sharded updates (``shard_updates=True``) when a rank is lost in the middle of a step:
its in-graph reduce-scatter and all-gather wait on every rank, so a frozen or killed rank
must end the step with an exception naming it, never a hang.  (Its own module: each case
forks its own session, which the module-scoped sessions of test_sharded_updates would
block.)"""
import signal
import threading
import time

import pytest

import synkhronos as synk
import synk_testutil as tu
from test_sharded_updates import BATCH, build_steps
from test_updates import make_data


@pytest.mark.parametrize("fault", ["frozen", "killed"])
def test_rank_lost_during_a_step(fault):
    """Rank 2 of 3 frozen (SIGSTOP) before the step, or killed while the step waits on it in
    the reduce-scatter: the step raises WorkerStopped / WorkerDied naming rank 2 within
    seconds, never hangs, and the session closes (the module checks nothing is left)."""
    X, Y = make_data(BATCH, seed=5)
    tu.fork(3)
    try:
        step = build_steps(["adam"], "_fault")["adam"]
        synk.distribute()
        step(X, Y)
        tu.signal_rank(2, signal.SIGSTOP)
        if fault == "killed":
            threading.Timer(0.3, tu.kill_rank, (2, False)).start()
        t0 = time.monotonic()
        with pytest.raises((synk.WorkerStopped, synk.WorkerDied)) as ei:
            step(X, Y)
        assert time.monotonic() - t0 < 10
        assert isinstance(ei.value, synk.WorkerStopped if fault == "frozen" else synk.WorkerDied)
        assert ei.value.rank == 2 and "rank 2" in str(ei.value)
    finally:
        synk.close()

"""``synk.fork(timeline=path)``: a Chrome/Perfetto trace of every rank, written at close:
each rank a named process (rank, host, pid), every command a span named as the master
logged it, collectives with their bytes, waits with the ranks waited on, the first call's
compile; the file private.  Off by default: nothing written."""
import json
import os
import signal
import stat
import threading

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu


def test_trace_of_every_rank(tmp_path, assert_clean):
    path = tmp_path / "run.json"
    n = tu.fork(3, timeline=str(path))
    expect_via = "staged" if tu.BACKEND == "JAX" else "shm"     # (JAX CPU ranks: through the host)
    try:
        x = T.matrix("x")
        w = pytensor.shared(np.ones(3), name="w")
        f = synk.function([x], (x.dot(w).sum(), "sum"), updates=[(w, w + T.mean(x, axis=0))], name="f")
        synk.distribute()
        for _ in range(4):
            f(np.ones((9, 3)))
        synk.all_reduce(w, "avg")
        assert not path.exists()                       # written when the session closes
    finally:
        synk.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(n)) and all(f"rank {r} (" in names[r] and "pid" in names[r] for r in names)
    spans = [e for e in events if e["ph"] == "X"]
    for r in range(n):
        mine = [e for e in spans if e["pid"] == r]
        assert sum(e["name"] == "call of function f" for e in mine) == 4, mine
        assert any(e["name"] == "all_reduce" and e["cat"] == "command" for e in mine)
        assert any(e["cat"] == "collective" and e["args"]["bytes"] > 0 for e in mine), mine
        # each collective names the implementation that served it
        assert {e["args"]["via"] for e in mine if e["cat"] == "collective"} == {expect_via}, mine
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    assert any(e["cat"] == "compile" and e["pid"] == 0 for e in spans)
    assert any(e["cat"] == "wait" for e in spans)
    assert_clean()


def test_a_slow_last_answer_keeps_every_rank(tmp_path, assert_clean):
    """At close, a worker exits as soon as it has answered; a rank that answers later (here
    stopped for half a second, as on a busy machine) must not turn that exit into a lost
    rank: every rank's events reach the trace (a busy CI machine once wrote the master's
    only)."""
    path = tmp_path / "run.json"
    n = tu.fork(3, timeline=str(path))
    try:
        x = T.matrix("x")
        f = synk.function([x], (x.sum(), "sum"), name="f")
        synk.distribute()
        f(np.ones((6, 2)))
        slow = tu.pid_of(n - 1)
        os.kill(slow, signal.SIGSTOP)
        threading.Timer(0.5, os.kill, (slow, signal.SIGCONT)).start()
    finally:
        synk.close()
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(n))
    assert all(sum(e["name"] == "call of function f" and e["pid"] == r for e in events) == 1 for r in range(n))
    assert_clean()


def test_off_by_default(tmp_path, monkeypatch, assert_clean):
    monkeypatch.delenv("SYNK_TIMELINE", raising=False)
    monkeypatch.chdir(tmp_path)
    tu.fork(2)
    try:
        x = T.matrix("x")
        f = synk.function([x], x.sum())
        synk.distribute()
        f(np.ones((4, 2)))
    finally:
        synk.close()
    assert os.listdir(tmp_path) == []
    assert_clean()


def test_a_long_run_keeps_the_last_events(tmp_path, monkeypatch, assert_clean):
    """``SYNK_TIMELINE_EVENTS`` bounds each rank's events: the last ones are kept (the last
    call is in the trace, the first calls are not) and each rank's name says how many were
    dropped; a bad value is refused before any process starts."""
    path = tmp_path / "run.json"
    monkeypatch.setenv("SYNK_TIMELINE_EVENTS", "abc")
    with pytest.raises(ValueError, match="SYNK_TIMELINE_EVENTS must be a positive number"):
        tu.fork(2, timeline=str(path))
    assert not tu.is_open()
    monkeypatch.setenv("SYNK_TIMELINE_EVENTS", "40")
    n = tu.fork(2, timeline=str(path))
    try:
        x = T.matrix("x")
        fs = [synk.function([x], (x.sum() * k, "sum"), name=f"f{k}") for k in range(3)]
        synk.distribute()
        for _ in range(60):
            fs[0](np.ones((4, 2)))
        fs[1](np.ones((4, 2)))
        fs[2](np.ones((4, 2)))
    finally:
        synk.close()
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    for r in range(n):
        mine = [e for e in spans if e["pid"] == r]
        assert 0 < len(mine) <= 40, len(mine)
        assert "events dropped (SYNK_TIMELINE_EVENTS)" in names[r], names[r]
        assert any(e["name"] == "call of function f2" for e in mine)
        assert not any(e["name"] == "distribute" for e in mine)
    assert_clean()

"""A closed session gives its shared memory back at once, in every process, even while
objects that outlive it still refer to its segments (an exception's traceback holds the
frames that held views); what the user got back stays valid.

Found by the chaos soak across hosts: the master kept ~0.5-0.9 GB of removed segments
mapped (its old sessions' buffers, reachable from the faults' exceptions until the garbage
collector ran), and a later session ran out of room in its host's /dev/shm."""
import numpy as np
import pytensor as theano
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu

MB = 1 << 20


def _session_with_results():
    """A session that moved 8 MB through every plane, a failed call's exception, and the
    results the user got back (with copies to compare)."""
    tu.fork(2)
    v = theano.shared(np.ones(2 * MB, np.float32), name="v_close")
    x = T.vector("x", dtype="float32")
    f = synk.function([x], [(T.sum(x), "sum"), (x * 2, "gather"), (T.sum(v), "avg")])
    synk.distribute()
    d = synk.data(np.arange(2 * MB, dtype=np.float32))
    results = list(f(d))
    results += list(f(np.arange(2 * MB, dtype=np.float32)))      # (staged by synkhronos)
    synk.scatter(v, np.full(4 * MB, 3, np.float32))               # (staged by synkhronos)
    results.append(synk.gather(v, nd_up=0))
    synk.all_reduce(v, "sum")
    results.append(v.get_value())
    results.append(synk.get_value(1, v))
    try:
        f(np.arange(3, dtype=np.float32), batch="not rows")
    except Exception as e:           # noqa: BLE001  (any exception: its traceback is the point)
        err = e
    else:
        pytest.fail("a bad batch was accepted")
    return d, results, [np.array(r, copy=True) for r in results], err


def test_memory_goes_back_while_a_traceback_holds_the_session():
    d, results, copies, err = _session_with_results()
    prefix = tu.prefix()
    held_before = tu.resident_shm(prefix)
    assert held_before >= 24 * MB           # (the check below measures something)
    synk.close()
    assert err.__traceback__ is not None    # still held here
    data_bytes = 8 * MB                     # the Data: the user still holds it
    assert tu.resident_shm(prefix) <= data_bytes + MB, (tu.resident_shm(prefix), held_before)
    for r, c in zip(results, copies):       # what came back is the user's, unchanged
        np.testing.assert_array_equal(np.asarray(r), c)
    np.testing.assert_array_equal(np.asarray(d[:5]), np.arange(5, dtype=np.float32))



class _Seen:
    """A segment observer (what a GPU rank page-locks shared memory through): the segments
    it was told of, mapped (name -> size) and released (in order)."""

    def __init__(self):
        self.maps, self.releases = {}, []

    def mapped(self, seg):
        self.maps[seg.name] = seg.size

    def released(self, seg):
        assert seg.name in self.maps, seg.name          # told of it when it was mapped
        self.releases.append(seg.name)


def test_segment_observers_see_every_mapping_and_release():
    """The master's segment observers are told of every segment it maps, with its size, and
    of those whose memory the close gives back, before it is (a GPU rank unlocks there the
    pages it locked; a segment that goes earlier is unlocked by the observer's own
    finalizer); an observer added later is told of those mapped already."""
    from synkhronos.backends.shm import segments
    early, late = _Seen(), _Seen()
    segments.observe(early)
    try:
        d, results, copies, err = _session_with_results()
        prefix = tu.prefix().lstrip("/")
        ours = {k: v for k, v in early.maps.items() if k.lstrip("/").startswith(prefix)}
        assert sum(size >= 8 * MB for size in ours.values()) >= 2, ours      # the Data, the slots
        segments.observe(late)                           # told at once of those mapped now
        assert sum(size >= 8 * MB for k, size in late.maps.items() if k in ours) >= 2, late.maps
        synk.close()
        released = {k for k in early.releases if k.lstrip("/").startswith(prefix)}
        big = {k for k in set(late.maps) & set(ours) if late.maps[k] >= 8 * MB}     # slots, staging, Data
        assert len(big & released) >= 2, (sorted(big), sorted(released))
    finally:
        segments.unobserve(early)
        segments.unobserve(late)

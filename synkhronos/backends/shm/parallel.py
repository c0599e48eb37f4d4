"""A rank's share of a large collective over several threads (numpy's loops release the GIL):
copies and reductions of many megabytes run at the memory bandwidth of the rank's cores
instead of one core's (a 64 MB float32 sum: 17 ms on one core of a 16-core H100 host,
4.3 ms on eight).  A rank uses its share of the cores it may run on
(``threads_for``); ``SYNK_REDUCE_THREADS`` sets it."""
import os
import threading

from ...signals import deferred

MIN_PIECE_BYTES = 2 << 20        # no thread gets less than this
_ALIGN = 64                      # piece boundaries on cache lines


def threads_for(n_local):
    """Threads a rank uses for its share of a large collective: ``SYNK_REDUCE_THREADS``, or
    the cores this process may run on shared by the host's ``n_local`` ranks."""
    env = os.environ.get("SYNK_REDUCE_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"SYNK_REDUCE_THREADS={env!r} must be a whole number of threads") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, n_local))


def split_run(fn, a, b, itemsize, threads):
    """``fn(lo, hi)`` over the items [a, b), in up to ``threads`` pieces at once (the calling
    thread takes the first), each at least ``MIN_PIECE_BYTES``; one call when small.  Not
    interruptible: an interrupt lands once every piece is done (none still writes)."""
    k = min(threads, ((b - a) * itemsize) // MIN_PIECE_BYTES)
    if k <= 1:
        fn(a, b)
        return
    q = max(1, _ALIGN // max(1, itemsize))
    span = b - a
    cuts = [a + min(span, ((span * i // k) // q) * q) for i in range(k)] + [b]
    pieces = [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:]) if hi > lo]
    pool = _Pool.get(k - 1)
    with deferred():
        jobs = [pool.submit(fn, lo, hi) for lo, hi in pieces[1:]]
        err = None
        try:
            fn(*pieces[0])
        except BaseException as e:       # noqa: BLE001 - raised once every piece is done
            err = e
        for job in jobs:
            e = job.wait()
            err = err or e
    if err is not None:
        raise err


class _Job:
    __slots__ = ("fn", "args", "done", "error")

    def __init__(self, fn, args):
        self.fn, self.args, self.done, self.error = fn, args, threading.Event(), None

    def wait(self):
        self.done.wait()
        return self.error


class _Pool:
    """Daemon threads of this process (made again after a fork: a child has none)."""

    _lock = threading.Lock()
    _pool = None

    def __init__(self):
        import queue
        self.pid, self.queue, self.threads = os.getpid(), queue.SimpleQueue(), 0

    @classmethod
    def get(cls, n):
        with cls._lock:
            p = cls._pool
            if p is None or p.pid != os.getpid():
                p = cls._pool = cls()
            while p.threads < n:
                threading.Thread(target=p._run, name=f"synk-copy-{p.threads}", daemon=True).start()
                p.threads += 1
            return p

    def submit(self, fn, *args):
        job = _Job(fn, args)
        self.queue.put(job)
        return job

    def _run(self):
        while True:
            job = self.queue.get()
            try:
                job.fn(*job.args)
            except BaseException as e:     # noqa: BLE001 - handed to the waiting caller
                job.error = e
            job.done.set()

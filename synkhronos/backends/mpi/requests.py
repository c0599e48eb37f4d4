"""A host's requests to its MPI process: one MPI operation on a host buffer, run by every
host's MPI process in the same order, answered through a small shared segment."""
import pickle

import numpy as np

from ..shm import segments as shm


class Requests:
    """A host's requests to its MPI process, and the host buffers they work on.

    The first rank of the host writes a request (one MPI operation on a host buffer) and
    waits; the host's MPI process runs it with the other hosts (the same operations in the
    same order everywhere) and answers.  The master runs its own host's requests itself."""

    _AREA = 1 << 18            # request, then two answer areas used in turn (by token parity:
                               # a rank may still read one while the next is being written)

    def __init__(self, prefix, create):
        self.seg = shm.Segment(prefix + "_req", 3 * self._AREA, create=create)
        self.head = np.ndarray((4,), np.int64, self.seg.mm)           # request: length, token

    def write(self, token, req):
        data = pickle.dumps(req, protocol=5)
        self.seg.mm[64:64 + len(data)] = data
        self.head[0] = len(data)
        self.head[1] = token

    def pending(self, done):
        """(token, request) of a request newer than ``done``, else None."""
        token = int(self.head[1])
        if token <= done:
            return None
        return token, pickle.loads(self.seg.mm[64:64 + int(self.head[0])])

    def _area(self, token):
        off = self._AREA * (1 + token % 2)
        return off, np.ndarray((4,), np.int64, self.seg.mm, offset=off)

    def answer(self, token, obj):
        data = pickle.dumps(obj, protocol=5)
        off, head = self._area(token)
        if len(data) > self._AREA - 64:
            raise ValueError("an answer between hosts is too large")
        self.seg.mm[off + 64:off + 64 + len(data)] = data
        head[0] = len(data)
        head[1] = token

    def answered(self, token):
        return int(self._area(token)[1][1]) == token

    def answer_obj(self, token):
        off, head = self._area(token)
        return pickle.loads(self.seg.mm[off + 64:off + 64 + int(head[0])])

    def close(self):
        self.seg = None


def run_request(w, req, buffers):
    """Run one request of a host between hosts (every host's MPI process, in order).
    ``buffers``: name -> Segment cache of the host's buffers."""
    kind = req[0]
    MPI = w.MPI
    if kind == "allgather":
        return w.comm.allgather(req[1])

    def arr(name, dtype, count):
        seg = buffers.get(name)
        if seg is None:
            # host buffers are named PREFIX_h{kind}{key}x{n}: a new n replaced the old buffer
            stem = name[:name.rindex("x")]
            for old in [b for b in buffers if b[:b.rindex("x")] == stem]:
                del buffers[old]                 # unmap it: its memory goes back
            seg = buffers[name] = shm.Segment(name)
        return seg.array(np.dtype(dtype), (count,))
    if kind == "allreduce":
        _, name, dtype, count, op = req
        op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
        w.comm.Allreduce(MPI.IN_PLACE, arr(name, dtype, count), op=op)
    elif kind == "bcast":
        _, name, dtype, count = req
        w.comm.Bcast(arr(name, dtype, count), root=0)
    elif kind == "allgatherv":
        _, name, dtype, counts, out_name = req
        out = arr(out_name, dtype, max(1, sum(counts)))
        displ = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
        w.comm.Allgatherv(arr(name, dtype, max(1, counts[w.rank]))[:counts[w.rank]],
                          [out, (list(counts), displ)])
    else:
        raise ValueError(f"unknown request {kind!r}")
    return None

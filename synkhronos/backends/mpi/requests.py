"""A host's requests to its MPI process: one MPI operation on a host buffer, run by every
host's MPI process in the same order, answered through a small shared segment.

The operations never block (``Pending``: MPI's nonblocking collectives, tested while the
process goes on watching its ranks and messages): a rank lost on another host, or the end
of the session, must reach a process that waits for one, and a process blocked inside MPI
hears nothing.  Each session runs them on a communicator of its own, so that an
operation a lost session left unfinished can never be matched with a later session's."""
import pickle
import time
import zlib

import numpy as np

from .world import OP_HOT, OP_TIGHT
from ..shm import segments as shm
from ... import signals


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


_BLOCK = 2048                   # bytes each host sends of an allgather's object in the first step
_DISAGREE = 1 << 62             # the words of a host that gives no signature (see Pending)


def _size(req):
    """The number of elements of an operation as one host sees it (the hosts must agree)."""
    return sum(req[3]) if req[0] == "allgatherv" else int(req[3])


class Pending:
    """One host's MPI operation between hosts, started without blocking (every host's MPI
    process starts the same operations in the same order, on the session's own
    communicator); ``test()`` drives it and tells when it is done, ``result`` is then its
    answer (a list for ``allgather``, else None).  A caller that gives up on it (a lost
    rank, the session's end) hands it to ``abandon``: MPI may still use its buffers.

    ``("agreed", signature, detail, request)`` first checks that every host gave the same
    signature (not None) and the same size of ``request``: one all-reduce (max) of four
    integers, a hash of the signature and the size, each with its negation.  If they agree
    it runs ``request`` at once (a collective's shapes: the hosts agree and exchange the
    data in one request, with no turn through the ranks in between; the size is compared as
    such, so that no hash collision can start an MPI operation of unequal sizes), else it
    gathers every host's ``detail`` (for the error message).  Its result is ``(details by
    host or None, whether the request ran, the request's result)``, the same on every host."""

    def __init__(self, comm, MPI, req, buffers, on_agreed=None):
        self.comm, self.MPI = comm, MPI
        self.on_agreed = on_agreed      # called as the hosts are found agreeing, before the data moves
        self.result = None
        self.keep = []                  # buffers MPI uses until the operation completes
        self.buffers, self.segments = buffers, []    # the host buffers it works on
        self.then = None                # ("agreed"): the request run once the hosts agree
        self.agreed = None              # ... and whether they did, once known
        self.done = False
        self.started = time.perf_counter()
        if req[0] == "agreed":
            _, signature, self.detail, self.then = req
            req = ("agree", signature, _size(self.then))
        self._start(req)

    def _host_array(self, name, dtype, count):
        seg = _host_segment(self.buffers, name)
        self.segments.append(seg)
        return seg.array(np.dtype(dtype), (count,))

    def _start(self, req):
        comm, MPI = self.comm, self.MPI
        self.kind = req[0]
        if self.kind == "allgather":    # Python objects: a block of each, then what did not fit
            data = pickle.dumps(req[1], protocol=5)
            block = np.zeros(_BLOCK, np.uint8)
            block[:8].view(np.int64)[0] = len(data)
            head = data[:_BLOCK - 8]
            block[8:8 + len(head)] = np.frombuffer(head, np.uint8)
            self.data, self.blocks = data, np.empty(comm.Get_size() * _BLOCK, np.uint8)
            self.keep = [block, self.blocks]
            self.req = comm.Iallgather([block, MPI.BYTE], [self.blocks, MPI.BYTE])
            self.phase = 1
            return
        self.phase = 2
        if self.kind == "agree":
            _, signature, size = req
            if signature is None:       # (words no agreeing hosts reach: max(h) + max(-h) > 0)
                words = [_DISAGREE] * 4
            else:
                b = pickle.dumps(signature, protocol=5)
                h = (zlib.crc32(b) << 29) ^ zlib.adler32(b)
                words = [h, -h, size, -size]
            buf = np.array(words, np.int64)
            self.req = comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
            self.keep = [buf]
        elif self.kind == "allreduce":
            _, name, dtype, count, op = req
            op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
            buf = self._host_array(name, dtype, count)
            self.req = comm.Iallreduce(MPI.IN_PLACE, buf, op=op)
            self.keep = [buf]
        elif self.kind == "bcast":
            _, name, dtype, count, root = req          # (root: the index of the root's host)
            buf = self._host_array(name, dtype, count)
            self.req = comm.Ibcast(buf, root=root)
            self.keep = [buf]
        elif self.kind == "allgatherv":
            _, name, dtype, counts, out_name = req
            me = comm.Get_rank()
            out = self._host_array(out_name, dtype, max(1, sum(counts)))
            displ = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
            buf = self._host_array(name, dtype, max(1, counts[me]))[:counts[me]]
            self.req = comm.Iallgatherv(buf, [out, (list(counts), displ)])
            self.keep = [buf, out]
        else:
            raise ValueError(f"unknown request {self.kind!r}")

    def test(self):
        """Whether the operation is complete (progresses it)."""
        if self.done:
            return True
        if not self._step():
            return False
        if self.kind == "agree":        # ("agreed"): the hosts' words are here
            words = self.keep[0]
            with signals.deferred():    # (an interrupt finds the next operation started and known)
                self.agreed = int(words[0]) + int(words[1]) == 0 and int(words[2]) + int(words[3]) == 0
                if self.agreed and self.on_agreed is not None:
                    self.on_agreed()
                self._start(self.then if self.agreed else ("allgather", self.detail))
            return self.test()
        if self.agreed is not None:
            self.result = (None, True, self.result) if self.agreed else (self.result, False, None)
        self.done = True
        return True

    def young(self):
        """Whether the operation started less than ``OP_HOT`` seconds ago (its processes then
        look for its end between yields, not sleeps)."""
        return time.perf_counter() - self.started < OP_HOT

    def look(self):
        """``test()`` again and again, without a break, for up to ``OP_TIGHT`` seconds while
        the operation is young (else once): MPI moves an operation's data only while it is
        tested, and a small one completes within a few tests (a process that does a round of
        other work between tests makes each step of it wait for that round; an operation
        that a stuck peer holds up keeps no core busy once it is old).  Whether it is complete."""
        end = time.perf_counter() + (OP_TIGHT if self.young() else 0.0)
        while not self.test():
            if time.perf_counter() >= end:
                return False
        return True

    def _step(self):
        if not self.req.Test():
            return False
        if self.phase == 1:             # every block is here: the objects, if they fitted
            blocks = self.blocks.reshape(-1, _BLOCK)
            self.sizes_list = [int(b[:8].view(np.int64)[0]) for b in blocks]
            rest = [max(0, n - (_BLOCK - 8)) for n in self.sizes_list]
            if not any(rest):
                self.result = [pickle.loads(b[8:8 + n].tobytes()) for b, n in zip(blocks, self.sizes_list)]
                return True
            self.displs = [int(x) for x in np.concatenate([[0], np.cumsum(rest)[:-1]])]
            self.recv = bytearray(max(1, sum(rest)))
            tail = self.data[_BLOCK - 8:]
            with signals.deferred():    # (likewise)
                self.keep += [tail, self.recv]
                self.req = self.comm.Iallgatherv([tail, self.MPI.BYTE], [self.recv, (rest, self.displs),
                                                                         self.MPI.BYTE])
                self.rest, self.phase = rest, 2
            return self._step()
        if self.kind == "allgather":
            view, blocks = memoryview(self.recv), self.blocks.reshape(-1, _BLOCK)
            self.result = [pickle.loads(b[8:8 + min(n, _BLOCK - 8)].tobytes() + view[d:d + r])
                           for b, n, d, r in zip(blocks, self.sizes_list, self.displs, self.rest)]
        return True


class Collectives:
    """The communicator of a session's MPI operations between hosts, renewed on every MPI
    process (``renew``) after a command that was aborted: an aborted command may leave an
    operation started on one host and not on another, and MPI matches collective operations
    by their order alone, so the old communicator is given up with whatever is pending on it."""

    def __init__(self, w, idle, finished=None):
        self.w, self.idle = w, idle
        self.finished = finished        # (the master) seq -> the hosts that finished that command
        self.comm = w.session_comm(idle)
        self.abandoned = False          # an operation on the current communicator was given up
        self.generation = 0

    def renew(self):
        self.comm = self.w.session_comm(self.idle)
        self.abandoned = False
        self.generation += 1

    def free(self):
        if self.comm is not None and not self.abandoned:
            self.comm.Free()
        self.comm = None


_abandoned = []                 # operations given up on, with their buffers (MPI may still use them)


def abandon(pending):
    """Give up on an operation that may never complete (another host's process is gone or
    stuck): it is never waited for, its buffers stay mapped (MPI may still write to them)
    but their memory is given back, and the host buffers it used are not used again (their
    owner makes new ones after a collective that failed: ``HierComm``)."""
    _abandoned[:] = [p for p in _abandoned if not p.req.Test()]
    if not pending.req.Test():
        _abandoned.append(pending)
    for seg in pending.segments:
        seg.release()
        if pending.buffers.get(seg.name) is seg:
            del pending.buffers[seg.name]


def _place(name):
    """What a buffer's newer versions share with ``name``: a host buffer
    (PREFIX_h{kind}{key}x{n}) replaces the one of a smaller n; a rank's two value buffers of
    a key (PREFIX_v0k{key}r{rank}g{gen}) alternate, a new generation replacing the one of
    its parity only (both stay mapped)."""
    head = name.rstrip("0123456789")
    return head if head.endswith("x") else (head, int(name[len(head):]) % 2)


def _host_segment(buffers, name):
    """A buffer of the host (or one of its ranks' value buffers) by name (``buffers``:
    name -> Segment, this process's mappings)."""
    seg = buffers.get(name)
    if seg is None:
        place = _place(name)
        for old in [b for b in buffers if _place(b) == place]:
            del buffers[old]                 # unmap it: its memory goes back
        seg = buffers[name] = shm.Segment(name)
    return seg

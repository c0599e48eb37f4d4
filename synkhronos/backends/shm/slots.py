"""The shared-memory areas of the ``shm`` collectives.

``Slots``: per key (a shared variable's registry index) and rank, a segment holding that
rank's value, published with its shape in a table every rank reads; two value buffers per
key so that the one a collective last returned (and the caller may keep) is never written
before a vote.  ``Eager``: a small area per rank where small all-reduces meet once (values,
header and token in one row)."""
import hashlib
import math
import struct

import numpy as np

from . import segments as shm

MAXD = 16
SLOT, RESULT, SHAPE = 0, 1, 2       # table planes: values, results, shape exchange
_ALIGN = 64
_EAGER_BYTES = 1 << 17              # eager area per rank (and parity): values (docs/architecture.rst:
                                    # one meeting beat the slots up to 128 KB at 2 ranks, not at 256 KB)
_EAGER_WORDS = 256                  # eager area per rank (and parity): token and header (int64)
_TOKEN = struct.Struct("<q")
_DIGEST = np.array([-1], np.int64).tobytes()     # a header's second word when it is a digest
_NO_PLAN = object()


class Slots:
    """One rank's slots plus the table through which ranks publish their slots' shapes.

    A key has two value buffers.  The one whose view a collective last returned is *lent*:
    the caller may keep it as its value, so nothing writes into it before a vote has
    decided (the write is then the commit); staging for a collective uses the other."""

    def __init__(self, prefix, rank, n, n_keys, create):
        self.prefix, self.rank, self.n = prefix, rank, n
        rows = max(1, n_keys)
        self.table_seg = shm.Segment(f"{prefix}_slots", 3 * rows * n * (2 + MAXD) * 8, create=create)
        self.table = self.table_seg.array(np.int64, (3, rows, n, 2 + MAXD))
        self.bufs = {}    # (plane, key) -> [(gen, Segment, address) or None, same]
        self.cur = {}     # (plane, key) -> index of the buffer published now
        self.lent = {}    # key -> index of the value buffer last returned
        self.undo = {}    # key -> its ``lent`` before the command in progress lent it tentatively
        self.gen = {}     # (plane, key) -> last generation number used in a name
        self.peers = {}   # (plane, key, rank) -> {gen % 2: (gen, Segment)}
        self.views = {}   # (plane, key, rank, gen) -> (shape, dtype, array): the last view made
        self.retired = set()   # (plane, key, i): buffers replaced at their next use (see ``retire``)

    def _buffer(self, plane, key, i, nbytes):
        bufs = self.bufs.setdefault((plane, key), [None, None])
        cur = bufs[i]
        if cur is not None and cur[1].size >= nbytes and (plane, key, i) not in self.retired:
            return cur
        self.retired.discard((plane, key, i))
        gen = self.gen.get((plane, key), 0) + 1
        gen += (gen - i) % 2             # buffer i has generations of parity i (see ``view``)
        self.gen[(plane, key)] = gen
        size = max(64, int(nbytes * (1.25 if cur else 1.0)))
        shm.check_space(size)
        seg = shm.Segment(f"{self.prefix}_v{plane}k{key}r{self.rank}g{gen}", size, create=True)
        if cur is not None:
            cur[1].unlink()
            self.views.pop((plane, key, self.rank, cur[0]), None)     # (its memory goes with it)
        bufs[i] = entry = (gen, seg, seg.address())
        return entry

    def announce(self, plane, key, gen, shape):
        if len(shape) > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {len(shape)}")
        row = self.table[plane, key, self.rank]
        row[2:2 + len(shape)] = shape
        row[1] = len(shape)
        row[0] = gen

    def holds(self, key, arr):
        """Whether ``arr`` is exactly the lent value buffer of ``key`` (no copy-in needed)."""
        i = self.lent.get(key)
        if i is None or not isinstance(arr, np.ndarray):
            return False
        entry = self.bufs[(SLOT, key)][i]
        return (arr.flags.c_contiguous and arr.__array_interface__["data"][0] == entry[2]
                and arr.nbytes <= entry[1].size)

    def publish_held(self, key, shape):
        i = self.lent[key]
        self.cur[(SLOT, key)] = i
        self.announce(SLOT, key, self.bufs[(SLOT, key)][i][0], shape)

    def stage(self, key, dtype, shape, reuse_lent=False):
        """A value buffer of ``key`` shaped ``shape``, published: the one not lent (unless
        ``reuse_lent``: for a write that happens only once a vote decided)."""
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {len(shape)}")
        lent = self.lent.get(key)
        i = 0 if lent is None else (lent if reuse_lent else 1 - lent)
        gen, seg, _ = self._buffer(SLOT, key, i, math.prod(shape) * dtype.itemsize)
        self.cur[(SLOT, key)] = i
        self.announce(SLOT, key, gen, shape)
        return seg.array(dtype, shape)

    def lend(self, key, tentative=False):
        """The value buffer published now is returned to a caller (call once committed).
        ``tentative`` (a ``scratch`` result): the caller keeps it only if its command is
        committed; ``settle`` says which."""
        if tentative:
            self.undo.setdefault(key, self.lent.get(key))
        self.lent[key] = self.cur[(SLOT, key)]

    def settle(self, committed):
        """The command of the tentative lends ended: kept (``committed``) or dropped, when
        the buffer lent before is again the one its caller keeps (staging must not write it:
        an interrupted training step's gradient is put back to it)."""
        if self.undo:
            if not committed:
                for key, i in self.undo.items():
                    if i is None:
                        self.lent.pop(key, None)
                    else:
                        self.lent[key] = i
            self.undo.clear()

    def ensure(self, key, dtype, shape, plane):
        """This rank's buffer of ``key`` on a result or shape plane, published."""
        shape = tuple(int(s) for s in shape)
        gen, seg, _ = self._buffer(plane, key, 0, math.prod(shape) * dtype.itemsize)
        self.cur[(plane, key)] = 0
        self.announce(plane, key, gen, shape)
        return seg.array(dtype, shape)

    def publish(self, key, arr, apart=False):
        """Publish ``arr`` as this rank's value of ``key`` (copied into a staging buffer
        unless it is the lent one, or ``apart``: always, for a collective that then writes
        the staging buffer in place); returns where it lies."""
        arr = np.asarray(arr)
        if not apart and self.holds(key, arr):
            self.publish_held(key, arr.shape)
            return arr
        view = self.stage(key, arr.dtype, arr.shape)
        if arr.size and np.may_share_memory(view, arr):
            arr = np.array(arr, copy=True)
        np.copyto(view, arr)
        return view

    def reverts(self, key):
        """Whether the value buffer not lent may become the caller's again (lent
        tentatively in this command: ``settle`` gives the other one back)."""
        return key in self.undo

    def name(self, key):
        """The name of the value buffer of ``key`` published now (another process maps it)."""
        return self.bufs[(SLOT, key)][self.cur[(SLOT, key)]][1].name

    def retire(self, key):
        """The value buffer of ``key`` published now (not lent) is not used again: an
        operation given up on may still write to it.  Its next use makes a new one (and
        only then removes its name: the host's MPI process, which may still be about to map
        it for that operation, gives it up before this rank's next command)."""
        i = self.cur[(SLOT, key)]
        if i != self.lent.get(key):
            self.retired.add((SLOT, key, i))

    def shape(self, key, rank, plane=SLOT):
        row = self.table[plane, key, rank].tolist()
        return tuple(row[2:2 + row[1]])

    def view(self, key, rank, dtype, plane=SLOT):
        """The buffer of ``rank`` for ``key`` as published in the table (the same array
        object as last time when nothing changed: the per-call path makes no new views)."""
        row = self.table[plane, key, rank].tolist()
        shape = tuple(row[2:2 + row[1]])
        if rank == self.rank:
            gen, seg, _ = self.bufs[(plane, key)][self.cur[(plane, key)]]
        else:
            gen = row[0]
            # a rank keeps two value buffers and alternates between them: both stay mapped
            # here; a new generation of one (parity = which) means its owner replaced it
            mine = self.peers.setdefault((plane, key, rank), {})
            cur = mine.get(gen % 2)
            if cur is None or cur[0] != gen:
                if cur is not None:
                    self.views.pop((plane, key, rank, cur[0]), None)
                cur = mine[gen % 2] = (gen, shm.Segment(f"{self.prefix}_v{plane}k{key}r{rank}g{gen}"))
            seg = cur[1]
        made = self.views.get((plane, key, rank, gen))
        if made is not None and made[0] == shape and made[1] is dtype:
            return made[2]
        arr = seg.array(dtype, shape)
        self.views[(plane, key, rank, gen)] = (shape, dtype, arr)
        return arr


class EagerPlan:
    """How a list of values lies in the eager area: ``header`` (bytes every rank writes),
    ``size`` (bytes of values) and ``views[parity][value][rank]`` (views shaped as the
    values)."""

    __slots__ = ("header", "size", "views")

    def __init__(self, header, size, views):
        self.header, self.size, self.views = header, size, views


class Eager:
    """Small collectives in one meeting.

    Each rank writes its values, then their dtypes and shapes (the header), then the
    meeting's token into its row of an area every rank maps; all ranks meet once; then each
    rank checks that the headers agree and computes the whole result from every row itself
    (for a few KB, cheaper than two more meetings).  Rows whose token is the meeting's are
    complete: a rank may compute before a vote has decided.  Two areas serve alternately,
    chosen by the parity of the meeting's token: a rank writes an area again only after
    passing a later meeting, which every rank reaches only once done reading it, so no
    closing meeting ("fence") is needed."""

    def __init__(self, prefix, rank, n, create):
        self.row = row = _EAGER_WORDS * 8 + _EAGER_BYTES
        self.seg = shm.Segment(f"{prefix}_eager", 2 * n * row, create=create)
        self.mm = self.seg.mm
        self.data = [self.seg.array(np.uint8, (n, row), offset=p * n * row)[:, _EAGER_WORDS * 8:] for p in (0, 1)]
        self.n = n
        self.others = [[self._hdr(p, r) for r in range(n) if r != rank] for p in (0, 1)]   # their rows
        self.plans = {}     # (dtype, shape) per value -> EagerPlan or _NO_PLAN
        self.headers = {}   # (dtype, shape) per value -> header

    def _hdr(self, parity, rank):
        """Where rank ``rank``'s header in area ``parity`` starts (a byte offset)."""
        return (parity * self.n + rank) * self.row

    def header(self, arrs):
        """What every rank compares after a meeting on these rows: the dtypes and shapes of
        ``arrs`` (as int64 words), or a digest of them where they do not fit a row's header
        (never equal to a full header)."""
        sig = self._sig(arrs)
        header = self.headers.get(sig)
        if header is None:
            words = [0, len(sig)]
            for dtype, shape in sig:
                words += [dtype.num, len(shape), *shape]
            words[0] = len(words)
            header = np.array(words, np.int64).tobytes()
            if len(words) >= _EAGER_WORDS:
                header = np.array([4, -1], np.int64).tobytes() + hashlib.blake2b(header, digest_size=16).digest()
            header = self.headers[sig] = header
        return header

    @staticmethod
    def _sig(arrs):
        return ((arrs[0].dtype, arrs[0].shape),) if len(arrs) == 1 else tuple((a.dtype, a.shape) for a in arrs)

    def plan(self, arrs, scale=1):
        """The ``EagerPlan`` of values ``arrs``, or None when they do not fit (their size
        times ``scale``: a reduction costs every rank n-1 passes over them)."""
        sig = self._sig(arrs)
        plan = self.plans.get(sig)
        if plan is None:
            header = self.header(arrs)
            layout, off = [], 0
            for dtype, shape in sig:
                nbytes = math.prod(shape) * dtype.itemsize
                layout.append((off, nbytes, dtype))
                off += -(-nbytes // _ALIGN) * _ALIGN
            if header[8:16] == _DIGEST or off > _EAGER_BYTES or any(len(shape) > MAXD for _, shape in sig):
                plan = _NO_PLAN
            else:
                views = [[[self.data[p][r, o:o + nb].view(dt).reshape(shape) for r in range(self.n)]
                          for (o, nb, dt), (_, shape) in zip(layout, sig)] for p in (0, 1)]
                plan = EagerPlan(header, off, views)
            self.plans[sig] = plan
        return plan if plan is not _NO_PLAN and plan.size * scale <= _EAGER_BYTES else None

    def post(self, parity, rank, arrs, plan, token):
        """Write this rank's values, header and token; returns every rank's views of each
        value (per value, a list by rank, shaped as the value)."""
        views = plan.views[parity]
        for a, vs in zip(arrs, views):
            np.copyto(vs[rank], a)
        self.sign(parity, rank, plan.header, token)
        return views

    def sign(self, parity, rank, header, token):
        """Write this rank's ``header`` and then the meeting's token (the row is complete):
        alone, for a collective whose values go another way (slots, a device), which meets
        here all the same so that ranks that chose different ways meet and see why."""
        at = self._hdr(parity, rank)
        mm = self.mm
        mm[at + 8:at + 8 + len(header)] = header
        _TOKEN.pack_into(mm, at, token)        # last: the row is complete

    def posted(self, parity, token):
        """Whether every rank's row in area ``parity`` is complete for meeting ``token``
        (this rank's is: it wrote it first)."""
        mm = self.mm
        for at in self.others[parity]:
            if _TOKEN.unpack_from(mm, at)[0] != token:
                return False
        return True

    def late(self, parity, token):
        """The ranks whose rows are not complete for meeting ``token``."""
        return [r for r in range(self.n) if _TOKEN.unpack_from(self.mm, self._hdr(parity, r))[0] != token]

    def agree(self, parity, header):
        """Whether every rank posted this ``header`` (the same dtypes and shapes)."""
        mm = self.mm
        size = len(header) + 8
        for at in self.others[parity]:
            if mm[at + 8:at + size] != header:
                return False
        return True

    def shapes(self, parity, i):
        """Every rank's shape of value ``i`` (for messages; None where a rank's header
        holds a digest or fewer values)."""
        out = []
        for r in range(self.n):
            at = self._hdr(parity, r) + 8
            w = np.frombuffer(self.mm, np.int64, _EAGER_WORDS - 1, at).tolist()
            if not 0 <= i < w[1]:
                out.append(None)
                continue
            pos = 2
            for _ in range(i):
                pos += 2 + w[pos + 1]
            out.append(tuple(w[pos + 2:pos + 2 + w[pos + 1]]))
        return out

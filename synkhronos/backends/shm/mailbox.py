"""The messages of the ``shm`` control plane: one mailbox segment per rank, which only its
owner writes (and regrows under a new name), read in place by the others.

A message is pickled (protocol 5) with its numpy buffers out of band, right after a
header that names the command it belongs to, so a reader can tell a stale message."""
import pickle
import struct

from . import segments as shm

_ALIGN = 64
HEADER = struct.Struct("<qQQ")       # seq, pickle length, number of out-of-band buffers
_BUF = struct.Struct("<QQ")        # offset, length


def _align(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


class Mailbox:
    """One rank's outgoing message area: a segment it owns and regrows as needed."""

    def __init__(self, prefix, rank, gen):
        self.prefix, self.rank, self.gen = prefix, rank, gen    # gen: 1-element view into ctrl
        self.seg = None

    def write(self, seq, obj):
        bufs = []
        header = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        if not bufs:                     # (most messages: no arrays out of band)
            end = HEADER.size + len(header)
            if self.seg is None or self.seg.size < end:
                self._grow(end)
            mm = self.seg.mm
            mm[HEADER.size:end] = header
            HEADER.pack_into(mm, 0, seq, len(header), 0)
            return
        raws = [b.raw() for b in bufs]
        off = _align(HEADER.size + _BUF.size * len(raws) + len(header))
        offsets = []
        for r in raws:
            offsets.append(off)
            off = _align(off + r.nbytes)
        if self.seg is None or self.seg.size < off:
            self._grow(off)
        mm = self.seg.mm
        pos = HEADER.size
        for o, r in zip(offsets, raws):
            _BUF.pack_into(mm, pos, o, r.nbytes)
            pos += _BUF.size
        mm[pos:pos + len(header)] = header
        for o, r in zip(offsets, raws):
            mm[o:o + r.nbytes] = r
        HEADER.pack_into(mm, 0, seq, len(header), len(raws))

    def _grow(self, needed):
        gen = int(self.gen[0]) + 1
        size = max(1 << 16, int(needed * 1.5))
        size = (size + shm.PAGE - 1) // shm.PAGE * shm.PAGE
        shm.check_space(size)
        new = shm.Segment(f"{self.prefix}_m{self.rank}_{gen}", size, create=True)
        old, self.seg = self.seg, new
        self.gen[0] = gen
        if old is not None:
            old.unlink()

    def close(self):
        if self.seg is not None:
            self.seg.unlink()
            self.seg = None


class MailboxReader:
    """Reads another rank's mailbox, re-attaching when its owner regrew it."""

    def __init__(self, prefix, rank, gen):
        self.prefix, self.rank, self.gen = prefix, rank, gen
        self.seg, self.seen = None, 0

    def read(self, seq):
        gen = int(self.gen[0])
        if gen != self.seen:
            self.seg = shm.Segment(f"{self.prefix}_m{self.rank}_{gen}")
            self.seen = gen
        mm = self.seg.mm
        got, hlen, nbuf = HEADER.unpack_from(mm, 0)
        if got != seq:
            raise RuntimeError(f"synkhronos: rank {self.rank}'s message is for command {got}, "
                               f"expected {seq}")
        if not nbuf:
            return pickle.loads(mm[HEADER.size:HEADER.size + hlen])
        pos = HEADER.size
        views = []
        mv = memoryview(mm)
        for _ in range(nbuf):
            o, ln = _BUF.unpack_from(mm, pos)
            pos += _BUF.size
            views.append(mv[o:o + ln])
        header = mm[pos:pos + hlen]
        return pickle.loads(header, buffers=views)

"""The ``shm`` control plane: commands, replies, barriers and votes among the ranks of one
host, through POSIX shared memory.

State lives in one shared "ctrl" array of int64; semaphores are only wake-up hints.  A
waiter always checks the state before it sleeps and after it wakes, so a lost, late or
extra post can delay nobody and fool nobody:

* the master writes a command into its mailbox (``mailbox``: pickle protocol 5, numpy
  buffers out of band), then publishes its sequence number (``CMD_SEQ``), then wakes the
  workers;
* a worker writes its reply into its own mailbox, then publishes the number of the command
  it answers (``REPLY_SEQ[rank]``), then wakes the master;
* barriers and votes are numbered ``seq * STEPS + step`` (``step`` counts the barriers and
  votes of one command, ``STEPS`` of them at most: ``step_token``), so that no arrival or
  vote of an earlier command can be taken for one of a later command;
* ``ABORT_SEQ = seq`` aborts command ``seq``; a vote commits once every rank has arrived
  with "yes" (``VOTE[rank]``).

Per-rank fields are read and written by ``get_field``/``set_field`` (the ``mpi`` plane's
host agents and the channels use them too); ``sleep``/``wake`` are the semaphores."""
import dataclasses
import os
import pickle
import time

import numpy as np
import posix_ipc

from . import segments as shm
from .mailbox import Mailbox, MailboxReader
from ..host.procfs import process_state
from ... import flight, signals
from ...errors import Aborted
from ...messages import OK, Command, Reply

CMD_SEQ, ABORT_SEQ, MASTER_PID = 0, 1, 2
BASE, STRIDE = 8, 8                # per-rank fields, one cache line per rank
GEN, REPLY_SEQ, ARRIVE, VOTE, HOST_ARRIVE, REPLY_OK, DONE = 0, 1, 2, 3, 4, 5, 6
STEPS = 1 << 24                    # barriers and votes per command at most (a scan of collectives)


def step_token(seq, step):
    """The token of meeting ``step`` of command ``seq``: tokens only grow, from command to
    command too; a command with more meetings than ``STEPS`` fails (on every rank alike)
    rather than let its tokens run into the next command's."""
    if step >= STEPS:
        raise RuntimeError(f"a command of synkhronos met {step} times (barriers, votes, collectives "
                           f"inside its graph); at most {STEPS - 1} per call")
    return seq * STEPS + step


def ctrl_size(n):
    return BASE + STRIDE * n


class ShmBuffer:
    __slots__ = ("seg",)

    def __init__(self, seg):
        self.seg = seg

    handle = property(lambda self: self.seg.name)

    def array(self, dtype, shape):
        return self.seg.array(dtype, shape)

    def release(self):
        self.seg.unlink()


def mirror_name(prefix, handle):
    """The name, in the session ``prefix`` of another host, of its copy of ``handle``."""
    return f"{prefix}_x{handle.lstrip('/')[len('synk_'):]}"


class ShmControl:
    """Commands, replies, barriers and votes among the ranks of one host.

    ``n`` slots: by default every slot is a rank ("member") and slot ``master_rank`` sends
    the commands.  A host of a multi-host session adds a ``lead`` slot: the one through
    which the rest of the session takes part in this host's barriers and votes (its
    arrivals and votes are written by the ``mpi`` plane's ``hub``); ``members`` are then the slots of
    the host's ranks.  ``mirror``: buffer handles name another host's buffers, which this
    host holds copies of (``mirror_name``)."""

    channel_kind = "shm"

    def __init__(self, prefix, n, rank, master_rank, waiter, create, members=None, lead=None, mirror=False):
        self.prefix, self.n, self.rank, self.master_rank = prefix, n, rank, master_rank
        self.is_master = rank == master_rank
        self.waiter = waiter
        self.members = tuple(range(n)) if members is None else tuple(members)
        self.lead = lead
        self.sync_slots = self.members + (() if lead is None or lead in self.members else (lead,))
        self.mirror = mirror
        self.workers = tuple(r for r in self.members if r != master_rank)
        self.ctrl_seg = shm.Segment(prefix + "_ctrl", ctrl_size(n) * 8, create=create)
        # a memoryview of int64: its items are Python ints (half the cost of numpy scalars
        # in the polling loops)
        self.ctrl = memoryview(self.ctrl_seg.mm).cast("B")[:ctrl_size(n) * 8].cast("q")
        if create:
            self.ctrl[MASTER_PID] = os.getpid()     # lets a later run reap this one if it dies
            for r in range(n):
                self.set_field(r, REPLY_SEQ, -1)         # the start-up reply is number 0
                self.set_field(r, REPLY_OK, -1)
        opener = shm.new_semaphore if create else posix_ipc.Semaphore
        self.semaphores = [opener(f"{prefix}_w{r}") for r in range(n)]
        self.mailbox = Mailbox(prefix, rank, self._field(rank, GEN))
        self.readers = {r: MailboxReader(prefix, r, self._field(r, GEN)) for r in range(n) if r != rank}
        self.seq = int(self.ctrl[CMD_SEQ])
        self.step = 0
        self.n_buffers = 0
        self.views = {}          # handle -> Segment attached here
        self._sent_args = (None, None)    # master: (arguments object, its pickle or None)
        self._got_args = (None, None)     # worker: (pickle, arguments) of the last command
        self._meetings = {}
        self.flight_seg = shm.Segment(prefix + "_flight", n * flight.WORDS * 8, create=create)

    def _field(self, rank, f):
        i = BASE + STRIDE * rank + f
        return self.ctrl[i:i + 1]

    def get_field(self, rank, f):
        return int(self.ctrl[BASE + STRIDE * rank + f])

    def set_field(self, rank, f, value):
        self.ctrl[BASE + STRIDE * rank + f] = value

    def sleep(self, tick):
        """Sleep until woken or ``tick`` passes.  Signals are held meanwhile and delivered
        right after: posix_ipc would replace a handler's exception (Ctrl-C, a timeout) by
        its own SignalError, so the handler runs in Python instead, within one tick."""
        sem = self.semaphores[self.rank]
        try:
            with signals.deferred():
                sem.acquire(tick)
        except (posix_ipc.BusyError, posix_ipc.SignalError):   # timeout; a stop/continue
            return
        while sem.value > 0:               # extra posts would only cause empty wake-ups
            try:
                sem.acquire(0)
            except posix_ipc.BusyError:
                break

    def wake(self, ranks):
        for r in ranks:
            self.semaphores[r].release()

    def hand_off(self, ranks):
        """Wake ``ranks``, which now have work that this process handed them, and give them
        this core: where a host's cores are all busy (more processes than cores, or
        simulated hosts sharing one machine) a woken process otherwise waits for the
        waker's time slice; on a core of its own the yield returns at once (measured:
        docs/several-machines.rst)."""
        self.wake(ranks)
        os.sched_yield()

    def _others(self):
        return [r for r in range(self.n) if r != self.rank]

    def _sync_others(self):
        return [r for r in self.sync_slots if r != self.rank]

    # ---- master --------------------------------------------------------------------------
    def send(self, seq, command, needs=()):
        # a command's arguments go as their own pickle, made once per arguments object: a
        # call repeated with the same plan sends the same bytes, which workers recognise
        # and do not unpickle again (arguments with arrays out of band go as they are)
        blob = None
        if self.workers:
            args = command.args
            if args is not self._sent_args[0]:
                bufs = []
                blob = pickle.dumps(args, protocol=5, buffer_callback=bufs.append)
                self._sent_args = (args, None if bufs else blob)
            blob = self._sent_args[1]
        self.send_pickled(seq, command, blob)

    def send_pickled(self, seq, command, blob):
        """``send`` of a command whose arguments come pickled already (``blob``; None: as
        they are): a host's agent passes the master's pickle on to its ranks."""
        if not self.workers:                # one rank: nobody reads the command
            self.ctrl[CMD_SEQ] = seq
            self.begin(seq)
            return
        name, args, forget, settle = command
        wire = (name, args, forget, settle) if blob is None else (name, None, forget, settle, blob)
        self.mailbox.write(seq, wire)
        self.ctrl[CMD_SEQ] = seq            # the commit point: from here on workers see it
        self.begin(seq)
        self.wake(self.workers)

    def committed(self):
        return int(self.ctrl[CMD_SEQ])

    def collect(self, seq, ranks, what="command"):
        self.set_field(self.rank, DONE, seq)     # this rank's share of the command is done
        for r in ranks:
            self.waiter.wait(lambda: self.get_field(r, REPLY_SEQ) == seq, self.sleep,
                             owed=lambda: [x for x in ranks if self.get_field(x, REPLY_SEQ) != seq], what=what)
            yield r, self.reply_of(r, seq)

    def reply_of(self, rank, seq):
        """Rank ``rank``'s reply to command ``seq`` (call once it has replied)."""
        if self.get_field(rank, REPLY_OK) == seq:
            return OK
        return Reply.from_wire(self.readers[rank].read(seq))

    def peek(self, seq, rank):
        """Rank ``rank``'s reply to command ``seq`` if it is there already, else None."""
        return self.reply_of(rank, seq) if self.get_field(rank, REPLY_SEQ) == seq else None

    def alloc(self, nbytes, tag="d", kept=True):
        shm.check_space(nbytes)
        self.n_buffers += 1
        seg = shm.Segment(f"{self.prefix}_{tag}{self.n_buffers}", nbytes, create=True)
        seg.kept = kept                 # a user's Data: its values outlive the session
        return ShmBuffer(seg)

    # ---- worker --------------------------------------------------------------------------
    def receive(self):
        last = self.seq
        self.waiter.wait(lambda: int(self.ctrl[CMD_SEQ]) != last, self.sleep, idle=True,
                         what="the next command")
        seq = int(self.ctrl[CMD_SEQ])
        self.begin(seq)
        wire = self.readers[self.master_rank].read(seq)
        if len(wire) == 5:                    # arguments pickled on their own (``send``)
            name, _, forget, settle, blob = wire
            if blob != self._got_args[0]:
                self._got_args = (blob, pickle.loads(blob))
            return seq, Command(name, self._got_args[1], forget, settle)
        return seq, Command(*wire)

    def reply(self, seq, reply):
        if reply.value is None and reply.status == "ok" and reply.fingerprint is None:   # the commonest: no message
            self.set_field(self.rank, REPLY_OK, seq)
        else:
            self.mailbox.write(seq, reply.to_wire())
        self.set_field(self.rank, DONE, seq)
        self.set_field(self.rank, REPLY_SEQ, seq)
        self.hand_off([self.master_rank])

    # ---- every rank ----------------------------------------------------------------------
    def begin(self, seq):
        self.seq, self.step = seq, 0

    def abort(self, seq=None):
        self.ctrl[ABORT_SEQ] = self.seq if seq is None else seq
        self.wake(self._others())

    def last_abort(self):
        """The number of the last command any rank aborted."""
        return int(self.ctrl[ABORT_SEQ])

    def aborted(self):
        return int(self.ctrl[ABORT_SEQ]) == self.seq

    def next_token(self):
        """The token of this rank's next barrier or vote (tokens only grow)."""
        return step_token(self.seq, self.step + 1)

    def _token(self):
        token = step_token(self.seq, self.step + 1)
        self.step += 1
        return token

    def _meet(self, field, slots, grace=0.0):
        """Arrive (this rank's ``field`` := the next step's token) and wait until every
        slot of ``slots`` has arrived too; Aborted if the command is aborted meanwhile (and
        the meeting does not complete within ``grace`` seconds of it)."""
        if len(slots) == 1:
            self._token()            # every rank counts every step, whether it waits or not
            return
        token = self.next_token()
        self.set_field(self.rank, field, token)
        where, others = self._meeting(field, slots)
        ctrl = self.ctrl
        self.meet(lambda: all(ctrl[i] >= token for _, i in where),
                  lambda: [r for r, i in where if ctrl[i] < token], others, grace=grace)

    def _meeting(self, field, slots):
        """``([(slot, index of its field)], the other slots)`` of a meeting (made once)."""
        got = self._meetings.get((field, slots))
        if got is None:
            got = self._meetings[(field, slots)] = ([(r, BASE + STRIDE * r + field) for r in slots],
                                                    [r for r in slots if r != self.rank])
        return got

    def meet(self, arrived, late, others=None, what="a barrier", grace=0.0):
        """A meeting: the caller has written its arrival (for ``next_token``; e.g. next to
        its data, so that one cache line tells both); this wakes the ``others`` (default:
        every other slot of the command), takes that token and waits until ``arrived()``;
        Aborted if the command is aborted meanwhile, once ``grace`` seconds have passed
        without the meeting completing.  ``late()``: the slots not there yet (for stall
        messages)."""
        self.wake(self._meeting(ARRIVE, self.sync_slots)[1] if others is None else others)
        self._token()
        since = None

        def ready():
            nonlocal since
            if arrived():
                return True
            # arrivals first, and looked at again once an abort is seen: a rank may arrive
            # after the look above, pass the meeting and fail (an unequal shape: it aborts)
            # before the abort is read here; this rank then passed the meeting too and must
            # fail alike, not leave it Aborted
            if not self.aborted():
                return False
            if arrived():
                return True
            now = time.monotonic()
            since = now if since is None else since
            if now - since >= grace:
                raise Aborted("another rank failed during this command")
            return False

        self.waiter.wait(ready, self.sleep, owed=late, what=what, hopeless=lambda: self._finished(late))

    def _finished(self, late):
        """RuntimeError when a rank this meeting waits for has finished its share of the
        command: it will never arrive (the ranks ran different numbers of collectives)."""
        if self.aborted():              # (a rank that failed aborted first: that ends the wait)
            return
        done = [r for r in late() if r != self.lead and self.get_field(r, DONE) == self.seq]
        # and still not arrived when looked at again: a rank arrives before it finishes, so
        # one that arrived between the two reads above (passed the meeting, finished) is not
        # late; one seen done and then still not arrived never arrives
        if done:
            done = [r for r in late() if r in done]
        if done:
            raise RuntimeError(
                f"rank(s) {done} finished their part of this command while rank {self.rank} waits for them "
                f"in its collective or barrier number {self.step}: the ranks ran different numbers of "
                "collectives (a scan or loop over a rank's own rows?); every rank must run the same "
                "collectives in the same order")

    def barrier(self, check_after=True):
        self._meet(ARRIVE, self.sync_slots)
        if check_after and len(self.sync_slots) > 1 and self.aborted():
            raise Aborted("another rank failed during this command")

    def host_barrier(self, grace=0.0):
        """The ranks of this host meet (not the rest of a multi-host session); ``grace``:
        see ``meet``."""
        self._meet(HOST_ARRIVE, self.members, grace)

    def vote(self, ok, on_commit=None, meanwhile=None):
        """All-or-nothing: commit (run ``on_commit`` and return True) only if every rank
        votes yes; every rank decides alike.  A rank that failed earlier and never arrives
        has aborted the command, which ends the others' wait with "no".  A False vote ends
        the command on every rank (callers raise), so a later vote's token means that this
        one was decided "yes".  Signals are held from a rank's commit to the end of the
        command, so no rank is interrupted out of a commit that the others make.

        On one host the master decides (``_decided_vote``); a host of a multi-host session
        votes symmetrically, its lead slot standing for the other hosts.  ``meanwhile`` (a
        worker's, on one host): run while the decision is awaited (work that is used only if
        it commits)."""
        token = self._token()
        if len(self.sync_slots) == 1:
            signals.hold()
            if ok and on_commit is not None:
                on_commit()
            return bool(ok)
        if self.lead is None:
            return self._decided_vote(token, ok, on_commit, meanwhile)
        signals.hold()                  # (may raise a pending interrupt: nothing decided yet)
        self.set_field(self.rank, VOTE, token if ok else -token)
        self.wake(self._sync_others())
        if not ok:
            return False
        # a rank already past this vote (a later token) voted yes here and saw every yes:
        # votes only grow, so a rank that moved on cannot hide its vote from a slower one
        ctrl = self.ctrl
        where, _ = self._meeting(VOTE, self.sync_slots)

        def late():
            return [r for r, i in where if abs(ctrl[i]) < token]

        def ready():
            for _, i in where:
                if abs(ctrl[i]) < token:
                    return self.aborted()
            return True                 # arrivals first: a later abort cannot undo them

        self.waiter.wait(ready, self.sleep, owed=late, what="a vote")
        votes = [int(ctrl[i]) for _, i in where]
        if any(abs(v) < token or v == -token for v in votes):
            return False
        if on_commit is not None:
            on_commit()
        return True

    def _decided_vote(self, token, ok, on_commit, meanwhile):
        """The vote of one host's ranks, decided by the master: workers post their votes
        (``VOTE`` := +-token) and wait for the master's decision (its ``VOTE``: +token
        commit, -token not, a later token: this one was "yes").  The master waits for the
        workers' votes with signals not held (an interrupt then decides "no": nothing was
        decided yet, so Ctrl-C reaches a master waiting for a frozen rank at once), then
        holds them and decides."""
        ctrl = self.ctrl
        mine = BASE + STRIDE * self.rank + VOTE
        if not self.is_master:
            signals.hold()
            ctrl[mine] = token if ok else -token
            self.wake([self.master_rank])
            if not ok:
                return False
            boss = BASE + STRIDE * self.master_rank + VOTE
            master = self.master_rank
            if meanwhile is not None:
                meanwhile()
            self.waiter.wait(lambda: abs(ctrl[boss]) >= token or self.aborted(), self.sleep,
                             owed=lambda: [] if abs(ctrl[boss]) >= token else [master], what="a vote")
            decision = int(ctrl[boss])
            if decision != token and abs(decision) <= token:
                return False
            if on_commit is not None:
                on_commit()
            return True
        every, workers = self._meeting(VOTE, self.sync_slots)
        where = [(r, i) for r, i in every if r != self.rank]
        decided = False
        try:
            if ok:
                def ready():
                    for _, i in where:
                        v = ctrl[i]
                        if v == -token:
                            return True             # a "no": decided
                        if v < token:
                            return self.aborted()
                    return True

                self.waiter.wait(ready, self.sleep, owed=lambda: [r for r, i in where if abs(ctrl[i]) < token],
                                 what="a vote")
                ok = all(ctrl[i] == token for _, i in where)
            if ok:
                signals.hold()
            ctrl[mine] = token if ok else -token
            decided = True
        finally:
            if not decided:                          # interrupted: "no"
                ctrl[mine] = -token
            self.wake(workers)
        if ok and on_commit is not None:
            on_commit()
        return ok

    def view(self, handle, dtype, shape):
        seg = self.views.get(handle)
        if seg is None:
            seg = self.views[handle] = shm.Segment(mirror_name(self.prefix, handle) if self.mirror else handle)
        return seg.array(dtype, shape)

    def array(self, ref):
        """The local array of an ``ArrayRef`` (an empty array for a None handle)."""
        if ref.handle is None:
            return np.empty(ref.shape, ref.dtype)
        return self.view(ref.handle, ref.dtype, ref.shape)

    def forget(self, handles):
        for h in handles:
            self.views.pop(h, None)

    def flight_area(self, slot):
        """Slot ``slot``'s flight-recorder area: (int64 view, float64 view) of the same words."""
        raw = memoryview(self.flight_seg.mm).cast("B")[slot * flight.WORDS * 8:(slot + 1) * flight.WORDS * 8]
        return raw.cast("q"), raw.cast("d")

    def flights(self, wait=0.0, ranks=None, host=""):
        """What the flight recorder holds of every member (``ranks``: slot -> global rank)."""
        now = time.monotonic()
        out = []
        for slot in self.members:
            f = flight.read(self.flight_area(slot), slot if ranks is None else ranks[slot], host, now)
            if ranks is not None or self.lead is not None:     # waits name slots of this host: ranks,
                names = ranks or {}                            # and -1 for the lead (the other hosts)
                f = dataclasses.replace(f, waiting_on=tuple(-1 if s == self.lead and s not in self.members
                                                            else names.get(s, s) for s in f.waiting_on))
            out.append(dataclasses.replace(f, state=process_state(f.pid) or "gone") if f.pid > 0 else f)
        return out

    def close(self):
        self.mailbox.close()
        if self.is_master:
            shm.remove_all(self.prefix)

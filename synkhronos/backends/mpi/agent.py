"""The agent of a host other than the master's: the MPI process of that host, which starts
and watches the host's workers and forwards between them and the master (commands and the
data they read, barrier arrivals, votes, aborts, replies, lost ranks, requests for MPI
collectives and channel messages).  ``serve_host`` is its whole life: ``synk.fork()``
never returns there."""
import dataclasses
import math
import os
import pickle
import signal
import sys
import time

import numpy as np

from .channel import HostRelay
from .hosts import worker_config
from .hub import HostView
from .requests import Pending, Requests, abandon
from .world import (ABORT, ARRIVE_T, BYE, CMD, DECIDE, END, ENDED, EXIT, GO, IDLE_AFTER, KEEP_HOT, LOST,
                    POLL, POLL_IDLE, FLIGHT, READY, REPLY, RESYNC, START, VOTE_T, world)
from ..host.device import usable_cores
from ..host.launcher import SubprocessLauncher, worker_argv, worker_environment
from ..registry import make_device
from ..shm import segments as shm
from ..shm.control import REPLY_SEQ, ShmControl, mirror_name
from ..shm.slots import Slots
from ...launcher import RankGone
from ...messages import Command
from ...waiting import Waiter


def serve_host():
    """The life of an MPI process other than the master: say which host it is on, then
    serve the master's sessions until the master exits.  Never returns."""
    w = world()
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the master's (mpiexec forwards it to all)
    w.isend((w.host, usable_cores(), os.getpid()), 0, READY)
    try:
        while True:
            src, tag, obj = _next(w, (START, EXIT))
            if tag == EXIT or _session(w, obj) == "exit":
                break
            w.isend(None, 0, ENDED)        # after every message of the session: the master drops them up to here
    finally:
        w.isend(None, 0, BYE)
        w.flush()
    sys.exit(0)


def _session(w, cfg):
    """One session of this host, from the master's START to its END (or EXIT)."""
    # first of all, whatever fails next: every MPI process opens the session's communicator
    # once per session (MPI pairs them by their order alone: one missing here would pair
    # every later session's operations with the wrong ones)
    coll = w.session_comm(lambda: None)
    try:
        agent = Agent(w, cfg, coll)
    except Exception as e:             # (e.g. no room in /dev/shm)
        coll.Free()
        return _not_started(w, cfg["first"], e)
    return agent.run()


def _not_started(w, first, e):
    """The session could not start on this host: the master hears of it as the loss of the
    host's first rank (and ends the session); the agent waits for that end."""
    print(f"synkhronos: the session could not start on host {w.host}: {e!r}", file=sys.stderr, flush=True)
    w.isend((first, w.host, 1, False), 0, LOST)
    _, tag, _ = _next(w, (END, EXIT))
    return "exit" if tag == EXIT else "end"


def _next(w, tags):
    """The next message with one of ``tags`` (others are dropped), polling."""
    while True:
        messages = w.poll()
        for i, (src, tag, obj) in enumerate(messages):
            if tag in tags:
                w.unread(messages[i + 1:])
                return src, tag, obj
        time.sleep(0.002)


class Agent:
    """One session on a host other than the master's: its workers, its shared memory, and
    the messages between them and the master."""

    def __init__(self, w, cfg, coll):
        self.w, self.cfg = w, cfg
        self.k = k = cfg["device"]["local_n"]
        self.first = cfg["first"]
        self.prefix = shm.new_prefix()
        self.members = tuple(range(1, k + 1))
        self.waiter = Waiter(lambda: None, None, None, spin=cfg.get("spin"))
        self.ctl = ShmControl(self.prefix, k + 1, 0, 0, self.waiter, create=True, members=self.members,
                              lead=0, mirror=True)
        self.host = HostView(self.ctl)
        self.requests = Requests(self.prefix, True)
        self.launcher = SubprocessLauncher()
        self.mirrors = {}              # master's handle -> Segment (its copy on this host)
        self.buffers = {}              # host buffers attached for MPI requests
        self.inflight = None
        self.relay = None              # the host's end of channels (channel.HostRelay)
        self.replied = -1              # the last command every rank of the host answered
        self.req_done = 0
        self.mpi_op = None             # (token, requests.Pending) of the MPI operation in progress
        # until when an answer from the master is awaited (after this host's arrival, vote or
        # replies): the agent looks for it between yields, not sleeps; once the master's
        # answer is handed to the ranks they are at work, and they wake the agent
        self.hot_until = 0.0
        self.coll = coll               # the session's communicator for collectives
        self.lost_sent = False
        self.leaving = ()              # the ranks told to quit: their exit with status 0 is no loss

    def grank(self, slot):
        return self.first + slot - 1

    def slot(self, grank):
        return grank - self.first + 1

    def start(self):
        cfg = self.cfg
        device = make_device(cfg["device"], cfg["n"])

        def env_for(r):
            wc = dict(cfg, **worker_config(self.prefix, self.k + 1, self.slot(r), self.members, 0, True,
                                           cfg["host_index"], cfg["host_sizes"], r, os.getpid(), self.w.mpi_shm))
            wc.pop("first", None)
            return worker_environment(wc, device.worker_env(r))
        ranks = [self.grank(s) for s in self.members]
        self.launcher.start(ranks, worker_argv, env_for)
        self.inflight = 0
        pids = {r: p for r, _h, p in self.launcher.info()}
        self.relay = HostRelay(self.w, self.ctl, self.first, pids)
        self.w.isend((self.w.host, pids), 0, READY)

    def run(self):
        try:
            try:
                self.start()
            except Exception as e:
                return _not_started(self.w, self.first, e)
            quiet_since = None
            while True:
                busy = self.step()
                if busy is None:
                    return self.ended
                if busy:
                    quiet_since = None
                    continue
                now = time.perf_counter()
                if quiet_since is None:
                    quiet_since = now
                quiet = now - quiet_since
                if now < self.hot_until or (self.mpi_op is not None and self.mpi_op[1].young()):
                    os.sched_yield()             # MPI messages wake nobody: look again at once
                else:                            # the ranks of this host are at work (they wake the
                    # agent when they need it) or nothing is awaited: sleep until a rank posts,
                    # or a tick passes (short while a command may be going on, longer once the
                    # session has been idle for a while)
                    self.ctl.sleep(POLL if quiet < IDLE_AFTER else POLL_IDLE)
        finally:
            self.stop()

    def step(self):
        """One round of everything the agent watches; None once the session ended."""
        w, host, ctl = self.w, self.host, self.ctl
        busy = self.relay.service(self.replied)     # channels first: a run opens before its command
        messages = w.poll()
        for i, (_src, tag, obj) in enumerate(messages):
            busy = True
            if tag == CMD:
                self.command(*obj)
                self.hot_until = 0.0
                os.sched_yield()               # the ranks it woke: this core first (ShmControl.hand_off)
            elif tag == GO:
                host.release(obj)
                self.hot_until = 0.0
                os.sched_yield()               # (likewise)
            elif tag == DECIDE:
                host.decide(*obj)
                self.hot_until = 0.0
                os.sched_yield()               # (likewise)
            elif tag == ABORT:
                if obj >= ctl.seq:
                    host.sent_abort = obj
                    host.set_abort(obj)
            elif tag == FLIGHT:                # the master asks for this host's flight records
                ranks = {m: self.grank(m) for m in self.members}
                w.isend([dataclasses.astuple(f) for f in ctl.flights(ranks=ranks, host=w.host)], 0, FLIGHT)
            elif tag == RESYNC:                # after an aborted command: a new communicator
                self.resync()
            elif tag in (END, EXIT):
                self.graceful = not obj if tag == END else False
                self.ended = "end" if tag == END else "exit"
                w.unread(messages[i + 1:])
                return None
        a = host.local_abort()             # first: a rank that aborts, then arrives, is seen aborted
        if a is not None:
            host.sent_abort = a
            w.isend(a, 0, ABORT)
            busy = True
        # (the replies next: the master waits for them, and nothing below delays them)
        if self.inflight is not None and all(ctl.get_field(m, REPLY_SEQ) == self.inflight for m in self.members):
            seq = self.inflight
            w.isend((seq, {self.grank(m): ctl.reply_of(m, seq).to_wire() for m in self.members}), 0, REPLY)
            self.inflight = None
            self.replied = seq
            self.hot_until = time.perf_counter() + KEEP_HOT     # (the next command, often)
            busy = True
        tok = host.members_arrived()
        if tok > host.sent_arrive:
            host.sent_arrive = tok
            w.isend(tok, 0, ARRIVE_T)
            self.hot_until = time.perf_counter() + KEEP_HOT
            busy = True
        voted = host.members_voted()
        if voted is not None and voted[0] > host.sent_vote:
            host.sent_vote = voted[0]
            w.isend(voted, 0, VOTE_T)
            self.hot_until = time.perf_counter() + KEEP_HOT
            busy = True
        if self.mpi_op is None:            # a request of this host's ranks: start it...
            req = self.requests.pending(self.req_done)
            if req is not None:
                token, r = req
                self.mpi_op = (token, Pending(self.coll, w.MPI, r, self.buffers))
                busy = True
        if self.mpi_op is not None and self.mpi_op[1].look():     # ...and answer once done
            token, op = self.mpi_op
            self.requests.answer(token, op.result)
            self.req_done, self.mpi_op = token, None
            ctl.hand_off(self.members)
            busy = True
        if not self.lost_sent:
            try:
                self.launcher.check(self.leaving)
            except RankGone as g:
                self.lost_sent = True
                w.isend((g.rank, w.host, g.returncode, g.stopped), 0, LOST)
        return busy

    def resync(self):
        """The master renews the session's communicator after an aborted command (every
        rank of it has answered): give up what is pending and drop the requests of that
        command that were never started, then join the new communicator."""
        if self.mpi_op is not None:
            abandon(self.mpi_op[1])
            self.mpi_op = None
        else:
            self.coll.Free()
        pending = self.requests.pending(self.req_done)
        if pending is not None:
            self.req_done = pending[0]
        self.coll = self.w.session_comm(lambda: None)

    def command(self, seq, wire, heads):
        """A command from the master: take the data it needs into this host's copies of the
        master's buffers, drop the copies the master released, hand it to the ranks."""
        name, _, forget, settle, blob = wire           # (the arguments pickled once, by the master)
        for handle in forget:                         # the master's released buffers
            seg = self.mirrors.pop(handle, None)
            if seg is not None:
                seg.unlink()
        resized = []
        for ref, kind, where, idx_ref, nbytes, inline in heads:
            arr = self.mirror(ref, resized)
            if kind == "index":
                part = np.empty((nbytes // max(1, arr.dtype.itemsize * int(math.prod(arr.shape[1:])) or 1),)
                                + arr.shape[1:], arr.dtype)
            else:
                part = arr if kind == "all" else arr[where]
            if inline is not None:       # (small data comes inside the command's message)
                np.copyto(part, np.frombuffer(inline, arr.dtype).reshape(part.shape))
            elif kind == "all":
                self.w.recv_array(arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8), 0)
            else:
                self.w.recv_array(part, 0)
            if kind == "index":
                positions = self.mirror(idx_ref, resized)[where[0]:where[1]]
                arr[positions] = part
        if name == "quit":                            # the session closes: each rank exits once it has answered
            self.leaving = tuple(self.grank(m) for m in self.members)
        if name == "distribute":                      # the ranks attach to the slot table
            self.table = Slots(self.prefix, 0, self.k + 1, max(64, pickle.loads(blob)[1]), True)
        # the ranks forget the copies that were resized too (a new segment under the same
        # name: the mapping they keep is the old one, which this agent no longer writes)
        command = Command(name, None, tuple(forget) + tuple(resized), settle)
        self.ctl.send_pickled(seq, command, blob)
        self.inflight = seq

    def mirror(self, ref, resized):
        """This host's copy of the master's buffer ``ref`` (made, or grown: its handle is
        added to ``resized``, whose mappings the ranks must drop)."""
        handle, dtype, shape = ref
        dtype = np.dtype(dtype)
        if handle is None:               # no buffer (an empty array): the ranks make their own
            return np.empty(tuple(shape), dtype)
        nbytes = max(64, int(math.prod(shape)) * dtype.itemsize)
        seg = self.mirrors.get(handle)
        if seg is None or seg.size < nbytes:
            if seg is not None:
                seg.unlink()
                resized.append(handle)
                nbytes = max(nbytes, seg.size * 3 // 2)     # (room to grow: the master's buffer may be larger)
            shm.check_space(nbytes)
            seg = self.mirrors[handle] = shm.Segment(mirror_name(self.prefix, handle), nbytes, create=True)
        return seg.array(dtype, tuple(shape))

    def stop(self):
        if self.mpi_op is not None:        # the session ended inside an MPI operation
            abandon(self.mpi_op[1])
        elif self.coll is not None:
            self.coll.Free()
        if self.relay is not None:
            self.relay.abandon()
        self.launcher.stop(getattr(self, "graceful", False))
        self.ctl.close()
        shm.remove_all(self.prefix)

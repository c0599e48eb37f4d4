"""MPI for a session over several hosts: whether this process was started by ``mpiexec``,
the job's world (initialised once per process), and the tags of the messages between the
master and the hosts' agents.

An uncaught exception in an MPI process must end the job, not hang the others: the master
closes its session (the agents are told to exit), any other process calls ``MPI_Abort``.
What ``MPI_Init`` made in /dev/shm is noted, so that a host can remove it if the job is
killed."""
import os
import pickle
import socket
import sys

import numpy as np

from ..shm import segments as shm

# message tags, master <-> host agents
CMD, REPLY, ARRIVE_T, GO, VOTE_T, DECIDE, ABORT, LOST, DATA, START, READY, END, EXIT, BYE, ENDED, RESYNC, \
    FLIGHT = range(101, 118)
# messages from other hosts wake no sleeper: an MPI process polls every POLL seconds while a
# command may be going on, every POLL_IDLE once nothing happened for IDLE_AFTER seconds
POLL, POLL_IDLE, IDLE_AFTER = 0.0002, 0.005, 1.0
# ... but first, after anything happened, it looks between yields of its core (not sleeps)
# for KEEP_HOT seconds, and for up to OP_HOT seconds while an MPI operation is in flight (MPI
# moves its data only while the operation is tested): a message between hosts is then seen
# within microseconds, and a process that waits for nothing sleeps
KEEP_HOT, OP_HOT = 0.005, 2.0
# an MPI operation in flight is tested without a break for up to OP_TIGHT seconds at each
# look while it is younger than OP_HOT (requests.Pending.look): one between hosts then takes a
# few tests, not rounds
OP_TIGHT = 0.0003
_world = None




def launched():
    """Whether this process is one of several started by an MPI launcher."""
    for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(v, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def world():
    """MPI, initialised once per process (with what MPI_Init created in /dev/shm noted, so
    that the host can remove it if the job is killed)."""
    global _world
    if _world is None:
        _world = World()
    return _world


class World:
    def __init__(self):
        try:
            import mpi4py
        except ImportError:
            raise RuntimeError("synkhronos runs under mpiexec but mpi4py is missing: "
                               "pip install 'synkhronos[mpi]'") from None
        mpi4py.rc.thread_level = "serialized"
        before = set(shm_names())
        from mpi4py import MPI
        self.MPI = MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_SERIALIZED)
        self.comm = MPI.COMM_WORLD.Dup()
        self.chan = MPI.COMM_WORLD.Dup()     # channels (backends.mpi.channel): never command traffic
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.host = MPI.Get_processor_name() or socket.gethostname()
        self.mpi_shm = sorted(set(shm_names()) - before)        # e.g. mpich_shm_<hex>_<node>
        self.pending = []            # Isend requests still in flight (with their buffers)
        self.backlog = []
        self.finished = False         # the master's session ended and the agents were told
        self.close_session = None    # set by the master's wiring: closes its session (-> whether one was open)
        _abort_on_uncaught(self)

    def session_comm(self, idle, timeout=120.0):
        """A communicator of its own for one session's collectives (``Idup``: every MPI
        process of the job calls this when a session opens, in the same order); ``idle()``
        is called while the others join (it may raise to give up)."""
        import time
        comm, req = self.comm.Idup()
        deadline = time.monotonic() + timeout
        while not req.Test():
            idle()
            if time.monotonic() > deadline:
                raise RuntimeError(f"synkhronos: the MPI processes did not open the session within {timeout} s")
            time.sleep(0.0005)
        return comm

    def isend(self, obj, dest, tag):
        data = pickle.dumps(obj, protocol=5)
        self.pending.append((self.comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag), data))
        self._reap()

    def isend_array(self, arr, dest, tag):
        arr = np.ascontiguousarray(arr)
        self.pending.append((self.comm.Isend([arr, self.MPI.BYTE], dest=dest, tag=tag), arr))
        self._reap()

    def _reap(self):
        if len(self.pending) > 16:
            self.pending = [(r, b) for r, b in self.pending if not r.Test()]

    def flush(self):
        for r, _ in self.pending:
            r.Wait()
        self.pending = []

    def poll(self):
        """Every control message that has arrived: [(source, tag, object)] (those put back
        with ``unread`` first)."""
        out, self.backlog = self.backlog, []
        st = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG, status=st):
            if st.Get_tag() == DATA:
                break                 # array payloads are received where they are expected
            n = st.Get_count(self.MPI.BYTE)
            buf = bytearray(n)
            src, tag = st.Get_source(), st.Get_tag()
            self.comm.Recv([buf, self.MPI.BYTE], source=src, tag=tag)
            out.append((src, tag, pickle.loads(buf)))
        return out

    def unread(self, messages):
        """Messages taken by ``poll`` but not handled: the next ``poll`` returns them first."""
        self.backlog = list(messages) + self.backlog

    def recv_array(self, out, src):
        self.comm.Recv([out, self.MPI.BYTE], source=src, tag=DATA)


def shm_names():
    try:
        return [e for e in os.listdir(shm.SHM_DIR) if e.startswith("mpich_shm_")]
    except OSError:
        return []


def _abort_on_uncaught(w):
    """An uncaught exception in an MPI process must end the job, not hang the others: in
    the master (once ``synk.fork()`` has run) the interpreter exits as usual, and at exit
    the session closes and every agent is told to exit; anywhere else ``MPI_Abort``."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        try:
            sys.stderr.flush()
            if w.rank == 0 and w.close_session is not None:
                return       # the normal way out, at exit: the session closes, the agents exit (hosts.finish)
        except BaseException:
            pass
        for name in w.mpi_shm:            # MPICH's files of this host: the abort leaves them
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except OSError:
                pass
        w.comm.Abort(1)
    sys.excepthook = hook

"""Named POSIX shared memory and semaphores, private to the user (mode 0600, unguessable names).

Every name made by one session starts with that session's random prefix, so that a closed
or crashed session can remove all of its segments and semaphores by prefix.  When the
environment variable ``SYNK_PREFIX_LOG`` names a file, every new prefix is appended to it
(test harnesses use this to check for leaks of their own sessions only)."""
import gc
import mmap
import os
import re
import secrets
import weakref

import numpy as np
import posix_ipc

from ...signals import deferred

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
SESSION_NAME = re.compile(r"synk_[0-9a-f]{16}")


def new_prefix():
    """An unguessable name prefix for one session (``/synk_`` and 16 hex digits)."""
    prefix = "/synk_" + secrets.token_hex(8)
    log = os.environ.get("SYNK_PREFIX_LOG")
    if log:
        try:
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "a") as fh:
                fh.write(prefix + "\n")
        except OSError:
            pass
    return prefix


_mapped = weakref.WeakSet()     # every Segment of this process (remove_all gives their memory back)
_observers = []                 # see observe


def observe(observer):
    """From now on tell ``observer`` of every segment this process maps
    (``observer.mapped(segment)``; those mapped already at once) and of each whose memory
    is given back (``observer.released(segment)``), e.g. to page-lock them for a GPU's
    copies.  The observer keeps its own errors."""
    _observers.append(observer)
    for seg in list(_mapped):
        observer.mapped(seg)


def unobserve(observer):
    """Stop telling ``observer`` (see ``observe``)."""
    if observer in _observers:
        _observers.remove(observer)


class Segment:
    """A mapped shared-memory segment.  The creator owns the name and unlinks it.
    ``kept``: its contents outlive the session (a user's ``synk.Data``)."""

    __slots__ = ("name", "size", "mm", "owner", "kept", "__weakref__")

    def __init__(self, name, size=0, create=False):
        if create:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(int(size), 1))
        else:
            shm = posix_ipc.SharedMemory(name)
        size = shm.size
        try:
            self.mm = mmap.mmap(shm.fd, size)
        except BaseException:
            if create:
                unlink_segment(name)
            raise
        finally:
            shm.close_fd()
        self.name, self.size, self.owner, self.kept = name, size, create, False
        _mapped.add(self)
        for observer in _observers:
            observer.mapped(self)

    def array(self, dtype, shape, offset=0):
        """A numpy view of the segment (no copy)."""
        return np.ndarray(shape, dtype=dtype, buffer=self.mm, offset=offset)

    def address(self):
        return np.frombuffer(self.mm, np.uint8, count=1).ctypes.data

    def overlaps(self, arr):
        """Whether numpy array ``arr`` is (part of) a view of this segment."""
        return arr.size > 0 and np.may_share_memory(arr, np.frombuffer(self.mm, np.uint8))

    def unlink(self):
        unlink_segment(self.name)

    def release(self):
        """Give the segment's memory back now, keeping the mapping valid (pages written
        later come back as new zero pages): for a buffer that an operation given up on may
        still write to, so that nothing else can use it and its memory is not held."""
        for observer in _observers:
            observer.released(self)
        try:
            self.mm.madvise(mmap.MADV_REMOVE)
        except (OSError, ValueError, AttributeError):
            pass


def check_space(nbytes):
    """MemoryError if ``nbytes`` cannot fit in the shared-memory filesystem now (a write
    past its free space would kill the process with SIGBUS instead).  Short of room, the
    garbage is collected first: a closed session's segments stay mapped (their memory in
    use) while unreachable objects still refer to them, e.g. through an exception's
    traceback."""
    free = _free()
    if nbytes > free:
        gc.collect()
        free = _free()
    if nbytes > free:
        raise MemoryError(f"cannot allocate {nbytes / 2**20:.1f} MiB of shared memory: only "
                          f"{free / 2**20:.1f} MiB free in {SHM_DIR}")


def _free():
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return float("inf")
    return st.f_bavail * st.f_frsize


def unlink_segment(name):
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def new_semaphore(name):
    return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)


def remove_all(prefix):
    """Unlink every segment and semaphore whose name starts with ``prefix`` + ``_``, and
    give back the memory of this process's mappings of them (but a ``kept`` one's).

    The session is over, yet objects that outlive it can still hold its mappings: an
    exception's traceback holds the frames that held views, until the garbage collector
    finds the cycle.  Their memory would stay in use (on a host whose /dev/shm is small,
    enough to refuse the next session's buffers).  The names go first, all in one signal
    window: a Ctrl-C during a close (a signal storm found it) left segments whose memory
    was given back, the control block's master pid with it, which no later session could
    then reap.  Returns the number removed.  Safe to call from any rank, any number of
    times."""
    base = prefix.lstrip("/") + "_"      # this session's names only, never a longer prefix
    removed = 0
    with deferred():
        try:
            entries = os.listdir(SHM_DIR)
        except OSError:
            entries = []
        for entry in entries:
            try:
                if entry.startswith(base):
                    posix_ipc.unlink_shared_memory("/" + entry)
                elif entry.startswith("sem." + base):
                    posix_ipc.unlink_semaphore("/" + entry[4:])
                else:
                    continue
                removed += 1
            except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
                pass
        mine = [seg for seg in list(_mapped) if seg.name.lstrip("/").startswith(base)]
        kept = {seg.name for seg in mine if seg.kept}       # (a file's memory is the file's: any
        for seg in mine:                                    # mapping of a kept one keeps it)
            if seg.name not in kept:
                seg.release()
    return removed


def leftovers(prefix="synk_"):
    """Names in /dev/shm that start with ``prefix`` (segments or semaphores)."""
    base = prefix.lstrip("/")
    try:
        return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(base) or e.startswith("sem." + base))
    except OSError:
        return []

"""Security: what the runtime exposes on the machine, and what its workers trust.

Trust model (what these tests check):

* The master and its workers are processes of one user on one machine; they trust each
  other completely.  A worker unpickles (and so may execute) whatever the master wrote into
  its mailbox segment — the functions at ``distribute()``, every command — and nothing
  else: it opens only segments of its own session, whose names the master published in the
  session's control segment, and the master creates every segment exclusively (O_CREAT |
  O_EXCL), so a name taken by someone else makes the master fail instead of handing its
  workers foreign data.
* Everything the runtime shares lives in POSIX shared memory (``/dev/shm``): segments and
  semaphores are mode 0600, owned by the user, named ``/synk_<64 random bits>_*``; another
  user can neither open nor remove them (``/dev/shm`` is sticky).  The names are
  unguessable but not secret (the worker command line shows the prefix): they prevent
  squatting by guessing, the file modes prevent access.
* No network socket is opened by the runtime, so nothing listens beyond (or on) loopback.
* Files: the runtime writes none, except the optional per-worker profiles
  (``profile_workers=True``).

Regressions checked below (bugs found here, since fixed): profiles written with a
predictable name, following symlinks, with the umask's mode; workers importing modules
from the master's current directory; a stale-session reaper that trusted any
``/dev/shm/synk_*_ctrl`` entry and removed live sessions."""
import json
import os
import pickle
import re
import stat
import subprocess
import sys
import types
import warnings

import numpy as np
import posix_ipc
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
from synkhronos.backends.shm import control as shm_control   # this module tests the shm backend itself
from synkhronos.backends.shm import mailbox, reaper
from synkhronos.backends.shm import segments as shm

PREFIX_RE = re.compile(r"^/synk_[0-9a-f]{16}$")


@pytest.fixture(scope="class")
def S():
    """A session in which every kind of segment exists: control, mailboxes (grown), Data,
    staging, collective slots and their table, and the semaphores."""
    before_sockets = socket_inodes(os.getpid())
    synk.fork(3)
    try:
        x = T.vector("x", dtype="float64")
        w = pytensor.shared(np.zeros(100_000), name="w")       # a large distribute payload
        f = synk.function([x], [(T.sum(x), "sum"), (T.sum(w), None)])
        synk.distribute()
        d = synk.data(np.arange(10.0))
        assert f(d)[0] == 45.0
        assert f(np.arange(4.0))[0] == 6.0
        synk.broadcast(w, np.ones(10))
        synk.all_reduce(w)
        synk.gather(w)
        synk.scatter(w, np.arange(30.0))
        yield types.SimpleNamespace(prefix=tu.prefix(), f=f, w=w, d=d,
                                    pids=list(tu.worker_pids().values()),
                                    before_sockets=before_sockets)
    finally:
        synk.close()


def entries(prefix):
    return tu.shm_entries(prefix)


def socket_inodes(pid):
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def inet_sockets():
    """{inode: (protocol, local address, state)} of every IPv4/IPv6 TCP/UDP socket."""
    out = {}
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{proto}") as fh:
                next(fh)
                for ln in fh:
                    p = ln.split()
                    out[int(p[9])] = (proto, p[1], p[3])
        except OSError:
            pass
    return out


class TestSession:

    # ---- names, modes, owners ----------------------------------------------------------------

    def test_prefix_is_random(self, S):
        assert PREFIX_RE.match(S.prefix), S.prefix
        many = {shm.new_prefix() for _ in range(200)}
        assert len(many) == 200 and all(PREFIX_RE.match(p) for p in many)

    def test_every_segment_and_semaphore_is_private(self, S):
        names = entries(S.prefix)
        kinds = {re.sub(r"\d+", "#", n.split(S.prefix.lstrip("/"))[1]) for n in names}
        # every kind is there: control, semaphores, mailboxes, Data, slot table and slots
        for k in ["_ctrl", "_w#", "_m#_#", "_d#", "_slots", "_v#k#r#g#"]:
            assert k in kinds, (k, sorted(kinds))
        for n in names:
            st = os.stat(os.path.join(shm.SHM_DIR, n))
            assert stat.S_IMODE(st.st_mode) == 0o600, (n, oct(st.st_mode))
            assert st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode)
        mode = stat.S_IMODE(os.stat(shm.SHM_DIR).st_mode)
        assert mode & stat.S_ISVTX, "/dev/shm is not sticky: other users could remove segments"

    def test_workers_map_only_their_session(self, S):
        """Everything a worker maps from /dev/shm belongs to its own session."""
        base = S.prefix.lstrip("/")
        for pid in S.pids:
            with open(f"/proc/{pid}/maps") as fh:
                shm_maps = {ln.split(None, 5)[5].strip() for ln in fh
                            if len(ln.split(None, 5)) == 6 and "/dev/shm/" in ln}
            assert shm_maps, "a worker maps nothing from /dev/shm?"
            foreign = [m for m in shm_maps
                       if not re.match(rf"^/dev/shm/(sem\.)?{base}_", m.replace(" (deleted)", ""))]
            assert foreign == [], foreign

    @pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
    def test_another_user_cannot_open_anything(self, S):
        """A child process that becomes 'nobody' can open none of the session's segments or
        semaphores, neither through posix_ipc nor as files."""
        names = entries(S.prefix)
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)      # fork() with threads
            pid = os.fork()
        if pid == 0:                                                   # pragma: no cover - child
            out = {}
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                for n in names:
                    res = []
                    try:
                        if n.startswith("sem."):
                            posix_ipc.Semaphore("/" + n[4:])
                        else:
                            posix_ipc.SharedMemory("/" + n)
                        res.append("OPENED")
                    except Exception as e:
                        res.append(type(e).__name__)
                    try:
                        with open(os.path.join(shm.SHM_DIR, n), "rb"):
                            res.append("OPENED")
                    except Exception as e:
                        res.append(type(e).__name__)
                    try:
                        os.unlink(os.path.join(shm.SHM_DIR, n))
                        res.append("REMOVED")
                    except Exception as e:
                        res.append(type(e).__name__)
                    out[n] = res
                os.write(w, json.dumps(out).encode())
            finally:
                os._exit(0)
        os.close(w)
        data = b""
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
        os.close(r)
        os.waitpid(pid, 0)
        out = json.loads(data)
        assert sorted(out) == sorted(names)
        for n, res in out.items():
            assert res == ["PermissionsError", "PermissionError", "PermissionError"], (n, res)
        assert entries(S.prefix) == names

    # ---- sockets ---------------------------------------------------------------------------------

    def test_no_network_sockets(self, S):
        """The workers hold no socket at all; the master opened no IPv4/IPv6 socket (so none
        listens anywhere, loopback included)."""
        inet = inet_sockets()
        for pid in S.pids:
            assert socket_inodes(pid) == set(), f"worker {pid} holds sockets"
        new = socket_inodes(os.getpid()) - S.before_sockets
        assert [inet[i] for i in new if i in inet] == []


# ---- what the workers unpickle ---------------------------------------------------------------

class _Evil:
    """Unpickling this runs os.mkdir(path): proof that someone unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_workers_never_read_a_squatted_mailbox(tmp_path, assert_clean):
    """Someone who learned the session prefix creates the segment that the master's mailbox
    will grow into, filled with a malicious pickle.  The master's exclusive create fails
    (an exception in the master, nothing sent), no worker ever unpickles the planted
    message, and once the squatter is gone distribute() simply works."""
    marker = tmp_path / "UNPICKLED"
    try:
        synk.fork(2)
        prefix = tu.prefix()
        x = T.vector("x", dtype="float64")
        w = pytensor.shared(np.zeros(100_000), name="w")       # payload > the first mailbox
        f = synk.function([x], [(T.sum(x), "sum"), (T.sum(w), None)])
        name = f"{prefix}_m0_1"                   # the master's first mailbox (no command yet)
        header = pickle.dumps(("distribute", (_Evil(str(marker)), 1), [], None), protocol=5)
        seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o666, size=1 << 22)
        try:
            import mmap
            mm = mmap.mmap(seg.fd, seg.size)
            mailbox.HEADER.pack_into(mm, 0, 1, len(header), 0)
            mm[mailbox.HEADER.size:mailbox.HEADER.size + len(header)] = header
            mm.close()
        finally:
            seg.close_fd()
        seq = tu.commands_sent()
        with pytest.raises(posix_ipc.ExistentialError):
            synk.distribute()
        assert tu.commands_sent() == seq, "a command was sent"
        assert tu.is_open() and all(tu.pid_running(p) for p in tu.worker_pids().values())
        posix_ipc.unlink_shared_memory(name)                    # the squatter goes away
        synk.distribute()
        assert f(np.arange(5.0))[0] == 10.0
        synk.close()
        assert not marker.exists(), "a worker unpickled the planted message"
    finally:
        synk.close()
    assert_clean()


# ---- files ---------------------------------------------------------------------------------

def test_profile_files_are_private(tmp_path, monkeypatch, assert_clean):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / "synk_worker_1.prof").symlink_to(victim)
    monkeypatch.chdir(tmp_path)
    try:
        synk.fork(3, profile_workers=True)
        synk.close()
    finally:
        synk.close()
    assert_clean()
    prof2 = tmp_path / "synk_worker_2.prof"
    assert prof2.exists()                                  # the documented feature works
    try:
        assert victim.read_bytes() == b"precious", "a planted symlink was followed"
        assert stat.S_IMODE(prof2.stat().st_mode) == 0o600, oct(prof2.stat().st_mode)
    finally:
        for p in tmp_path.glob("synk_worker_*.prof"):
            p.unlink()


_PLANTED = '''
import os, sys
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "PLANTED_RAN"), "w").write(
    str(os.getpid()))
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["json"]
import json as _real
sys.modules["json"] = _real
globals().update(_real.__dict__)
'''


def test_workers_do_not_import_from_the_current_directory(tmp_path, monkeypatch, assert_clean):
    (tmp_path / "json.py").write_text(_PLANTED)
    marker = tmp_path / "PLANTED_RAN"
    monkeypatch.chdir(tmp_path)
    try:
        synk.fork(2)
        synk.close()
    finally:
        synk.close()
        monkeypatch.undo()
    assert_clean()
    assert not marker.exists(), f"worker {marker.read_text()} ran {tmp_path / 'json.py'}"


# ---- the stale-session reaper -------------------------------------------------------------

def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_reaper_leaves_live_sessions_alone(assert_clean):
    fake = None
    try:
        synk.fork(2)
        prefix = tu.prefix()
        x = T.vector("x", dtype="float64")
        f = synk.function([x], (T.sum(x), "sum"))
        synk.distribute()
        assert f(np.arange(4.0)) == 6.0
        live = entries(prefix)
        # a short 'session' name that is a prefix of ours only (never of anybody else's)
        fake = "/" + prefix.lstrip("/")[:13] + "_ctrl"
        seg = posix_ipc.SharedMemory(fake, posix_ipc.O_CREX, mode=0o644, size=4096)
        try:
            import mmap
            mm = mmap.mmap(seg.fd, seg.size)
            np.ndarray((8,), np.int64, mm)[shm_control.MASTER_PID] = _dead_pid()
            mm.close()
        finally:
            seg.close_fd()
        reaper.reap_stale_sessions()      # what the next synk.fork() anywhere runs
        assert entries(prefix) == live, "a live session's segments were removed"
        assert f(np.arange(4.0)) == 6.0
    finally:
        if fake is not None:
            shm.unlink_segment(fake)
        synk.close()
    assert_clean()

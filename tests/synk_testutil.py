"""Helpers shared by the synkhronos tests: the session's ranks and resources (through the
public ``synk.session_info()``), /dev/shm entries, worker processes, signals, waiting, and
figures printed on the terminal (``report``)."""
import atexit
import glob
import os
import signal
import tempfile
import time

import synkhronos as synk
from synkhronos.backends.shm import segments as shm

# Every new session prefix is appended to this file by synkhronos (SYNK_PREFIX_LOG), in this
# process and in every program the tests start: the leak checks look only at those.  Under
# pytest-xdist each test process keeps a log of its own, PREFIX_LOG.<worker> (a module's
# check must not see the live sessions of the module another process runs meanwhile);
# scripts/leakcheck.py reads them all.
def _remove_logs(path):
    """At the exit of the test process that made the log ``path``: remove it and its
    per-worker logs (nobody reads them later; scripts/test.sh keeps its own)."""
    for p in [path] + glob.glob(glob.escape(path) + ".*"):
        try:
            os.unlink(p)
        except OSError:
            pass


if not os.environ.get("SYNK_PREFIX_LOG"):
    _fd, _path = tempfile.mkstemp(prefix="synk-test-prefixes-")
    os.close(_fd)
    os.environ["SYNK_PREFIX_LOG"] = _path
    atexit.register(_remove_logs, _path)
if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("SYNK_PREFIX_LOG_WORKER"):
    os.environ["SYNK_PREFIX_LOG"] += "." + os.environ["PYTEST_XDIST_WORKER"]
    os.environ["SYNK_PREFIX_LOG_WORKER"] = "1"
PREFIX_LOG = os.environ["SYNK_PREFIX_LOG"]


def program_env(**extra_flags):
    """The environment for a program a test starts, with ``PYTENSOR_FLAGS`` reduced to the
    run's own caches (``base_compiledir``, set by scripts/test.sh) plus ``extra_flags``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTENSOR_FLAGS"}
    flags = [f for f in os.environ.get("PYTENSOR_FLAGS", "").split(",") if f.startswith("base_compiledir=")]
    flags += [f"{k}={v}" for k, v in extra_flags.items()]
    if flags:
        env["PYTENSOR_FLAGS"] = ",".join(flags)
    return env


def prefixes():
    """Every session prefix made so far by this test run, in order of creation."""
    try:
        with open(PREFIX_LOG) as fh:
            return [ln.strip() for ln in fh if ln.strip()]
    except OSError:
        return []


# ---- starting a session -----------------------------------------------------------------------

# The backend the functional tests run on: numba (None), or PyTensor's JAX mode in the
# JAX pass of scripts/test.sh (SYNK_MODE=JAX).
BACKEND = os.environ.get("SYNK_MODE") or None


def jax_backend():
    """Whether this run's sessions run PyTensor's JAX backend (the JAX pass)."""
    return (BACKEND or "").strip().upper() == "JAX"


def fork(n_parallel=None, **kw):
    """The one way the functional tests start a session: on the backend under test."""
    return synk.fork(n_parallel, mode=BACKEND, **kw)


# ---- the current session ----------------------------------------------------------------------

def info():
    """``synk.session_info()`` (None when no session)."""
    return synk.session_info()


def is_open():
    i = info()
    return i is not None and i.open


def prefix():
    """The shared-memory name prefix of the current session."""
    return info().resources["shm_prefix"]


def pid_of(rank):
    """The process id of ``rank`` in the current session."""
    for r in info().ranks:
        if r.rank == rank:
            return r.pid
    raise KeyError(rank)


def worker_pids():
    i = info()
    return {r.rank: r.pid for r in i.ranks if r.rank != i.master_rank}


def commands_sent(name=None):
    """Commands (named ``name``, or all) the master has sent so far in this session."""
    counts = info().commands
    return sum(counts.values()) if name is None else counts.get(name, 0)


class CommandCounter:
    """Commands the master sends from now on: ``n(name)``, ``names()``."""

    def __init__(self):
        self.start = dict(info().commands)

    def n(self, name=None):
        now = info().commands
        if name is None:
            return sum(now.values()) - sum(self.start.values())
        return now.get(name, 0) - self.start.get(name, 0)

    def names(self):
        now = info().commands
        return {k for k in now if now[k] != self.start.get(k, 0)}


def signal_rank(rank, sig):
    os.kill(pid_of(rank), sig)


def kill_rank(rank, wait=True):
    """SIGKILL ``rank`` and (by default) wait until it is gone."""
    pid = pid_of(rank)
    os.kill(pid, signal.SIGKILL)
    if wait:
        wait_until(lambda: not pid_running(pid), 5.0)
    return pid


# ---- /dev/shm and processes -------------------------------------------------------------------

def shm_entries(prefix):
    """Our /dev/shm entries (segments and semaphores) whose name starts with ``prefix``."""
    return shm.leftovers(prefix)


def entries_of(prefixes):
    """/dev/shm entries belonging to any of the session ``prefixes``."""
    out = []
    for p in prefixes:
        out.extend(shm_entries(p))
    return sorted(set(out))


def remove_all(prefix):
    shm.remove_all(prefix)


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _stat(pid):
    """(state, ppid) of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            s = fh.read()
    except OSError:
        return None
    rest = s[s.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def parent_of(pid):
    """The pid of ``pid``'s parent, None if it does not exist."""
    st = _stat(pid)
    return None if st is None else st[1]


def pid_running(pid):
    """True while ``pid`` exists and is not a zombie (an exited, unreaped process)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def _children(marker, ppid):
    ppid = os.getpid() if ppid is None else ppid
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None or st[1] != ppid or st[0] in ("Z", "X"):
            continue
        if marker in _cmdline(pid):
            found.append(pid)
    return found


def processes_with_env(entry):
    """Live processes (not zombies) whose environment holds ``entry`` (bytes ``NAME=value``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if entry in env and pid_running(int(name)):
            found.append(int(name))
    return found


def worker_children(ppid=None):
    """Live ``synkhronos.worker`` processes whose parent is ``ppid`` (default: this process)."""
    return _children("synkhronos.worker", ppid)


def guardians(ppid=None):
    """Live guardian processes (``backends/host/guardian.py``) whose parent is ``ppid``."""
    return _children("backends/host/guardian.py", ppid)


def fork_servers(ppid=None):
    """Live fork servers (``synkhronos.backends.host.forkserver``) whose parent is ``ppid``."""
    return _children("synkhronos.backends.host.forkserver", ppid)


def mapped_shm(pid, prefix):
    """Distinct /dev/shm files of session ``prefix`` that process ``pid`` has mapped."""
    base = prefix.lstrip("/")
    names = set()
    try:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and f"/dev/shm/{base}" in parts[5]:
                    names.add(parts[5].strip())
    except OSError:
        pass
    return names


def wait_until(pred, timeout, interval=0.05):
    """Poll ``pred()`` until true or ``timeout`` seconds pass; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


def backing_file(arr):
    """The /dev/shm file whose mapping holds numpy array ``arr`` in this process, or None."""
    addr = arr.__array_interface__["data"][0]
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi and len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                return parts[5].strip().replace(" (deleted)", "")
    return None


def deleted_mappings():
    """How many removed synkhronos segments this process still maps (memory not given back)."""
    with open(f"/proc/{os.getpid()}/maps") as fh:
        return len({ln.split()[-2] for ln in fh if "/dev/shm/synk_" in ln and ln.rstrip().endswith("(deleted)")})


def resident_shm(prefix, pid=None):
    """Bytes of session ``prefix``'s /dev/shm files resident in process ``pid``'s mappings
    (its memory still held through them; a released mapping counts nothing)."""
    base = f"/dev/shm/{prefix.lstrip('/')}_"
    total, inside = 0, False
    with open(f"/proc/{pid or os.getpid()}/smaps") as fh:
        for line in fh:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):      # a mapping's header line
                inside = base in line
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


# ---- the terminal -----------------------------------------------------------------------------

def report(config, text):
    """Print ``text`` on the terminal even while pytest captures output (the figures the
    fault, soak and fuzz tests measure)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        print(text)
        return
    with capman.global_and_fixture_disabled():
        print(text, flush=True)

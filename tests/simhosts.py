"""Simulated hosts on one Linux machine, for multi-machine MPI tests (stdlib only, no pytest).

Each simulated host is a network namespace (own hostname, network stack, ``/etc/hosts``,
System V IPC and a private tmpfs ``/dev/shm``) reached over veth links: a veth pair for two
hosts, a bridge in its own namespace for three or more. One long-lived *holder* process per
host owns that host's UTS, mount and IPC namespaces; every later command "on" the host enters
the holder's namespaces with ``nsenter``, so all processes on one host see the SAME
``/dev/shm`` and IPC, and the harness can inspect (``/proc/<holder>/root/dev/shm``) and clean
up a host while it exists.

Usage (as root)::

    import simhosts
    ok, why = simhosts.available()
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        cmd = hosts.mpiexec_cmd(4, 2, [sys.executable, "script.py"])
        res = hosts.run(cmd, timeout=60)         # runs `mpiexec ...` on hA
        print(res.returncode, res.stdout)
        print(hosts.shm_files())                  # {'hA': [...], 'hB': [...]}
    # namespaces, veths, holder and every process left inside the hosts are gone here

Two helper scripts are written into the instance's private temp dir (mode 0700):

* ``inhost HOST CMD [ARG...]`` runs CMD with its arguments exactly (no shell) on HOST, in the
  caller's working directory;
* ``nsssh [ssh options] HOST [COMMAND...]`` is a fake ``ssh`` for MPICH hydra
  (``-launcher ssh -launcher-exec nsssh``): like ssh it joins COMMAND with spaces and runs it
  with ``/bin/sh -c`` on HOST.

Every name (namespaces ``synksim-<pid>-<tag>-<host>``, root-namespace veth names
``sk<tag><i>a/b``, temp dir ``synksim-<pid>-<tag>-*``) carries a random tag, so two runs
cannot collide; namespaces and temp dirs left by a runner that died (its pid no longer
exists) are removed by :func:`cleanup_stale`, which ``SimHosts`` calls on entry.

What is NOT simulated (do not let a test pass because of it): there is no PID namespace, so
all hosts share pid numbers and ``/proc`` (a process on hB can see and signal hA's pids);
the file system is shared except ``/dev/shm`` and ``/etc/hosts``; all hosts share the CPUs.
``popen``/``run`` start the command itself (``inhost`` execs, nothing forks in between), so
``Popen.pid`` is the command's pid (e.g. ``mpiexec``'s) and signals to it arrive directly.
Hydra starts the proxy of the launch host by fork and the others through ``nsssh``; after
``mpiexec`` exits a remote proxy may need a few ms more: use :meth:`SimHosts.wait_idle`.
A rank killed by a signal leaves MPICH's ``mpich_shm_*`` segment in each host's /dev/shm:
:meth:`SimHosts.clear_shm` removes it.
"""
import ipaddress
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["available", "SimHosts", "cleanup_stale", "strip_mpi_env", "NS_PREFIX"]

NS_PREFIX = "synksim"
NETNS_DIR = "/run/netns"
_HOST_RE = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,30}$")
# Variables a process gets when it is an MPI rank (hydra's PMI wire-up): a process that
# inherits them and is not itself a rank of that job fails MPI_Init.
_MPI_ENV_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")

_available_cache = None


def strip_mpi_env(env=None):
    """A copy of ``env`` (default ``os.environ``) without the PMI_*/MPI_LOCAL* variables of
    an enclosing MPI job."""
    env = dict(os.environ if env is None else env)
    for k in list(env):
        if k.startswith(_MPI_ENV_PREFIXES):
            del env[k]
    return env


def _sh(args, timeout=20, check=True):
    """Run a short admin command, return CompletedProcess (text)."""
    res = subprocess.run(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{shlex.join(args)} failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def _tools():
    return {t: shutil.which(t) for t in ("ip", "unshare", "nsenter")}


def available():
    """``(True, "")`` when simulated hosts can be made here, else ``(False, reason)``.

    Checks root, the ``ip``/``unshare``/``nsenter`` tools, and really makes (and removes) a
    network namespace with a veth and a holder-style UTS+mount+IPC namespace with a tmpfs."""
    global _available_cache
    if _available_cache is not None:
        return _available_cache
    result = _probe()
    _available_cache = result
    return result


def _probe():
    if not sys.platform.startswith("linux"):
        return False, f"simulated hosts need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "simulated hosts need root (network/mount namespaces)"
    missing = [t for t, p in _tools().items() if not p]
    if missing:
        return False, f"missing tools: {', '.join(missing)}"
    tag = secrets.token_hex(3)
    ns = f"{NS_PREFIX}-{os.getpid()}-{tag}-probe"
    va, vb = f"sk{tag}pa", f"sk{tag}pb"
    made_ns = False
    try:
        try:
            _sh(["ip", "netns", "add", ns])
            made_ns = True
            _sh(["ip", "link", "add", va, "type", "veth", "peer", "name", vb])
            _sh(["ip", "link", "set", vb, "netns", ns])
            _sh(["ip", "netns", "exec", ns, "unshare", "--uts", "--mount", "--ipc",
                 "--propagation", "private", "sh", "-c",
                 "hostname probe && mount -t tmpfs -o size=1m tmpfs /dev/shm "
                 "&& [ \"$(hostname)\" = probe ]"])
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            return False, f"cannot make namespaces here: {e}"
        return True, ""
    finally:
        subprocess.run(["ip", "link", "del", va], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if made_ns:
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------
# processes inside a network namespace

def _ns_id(path):
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _pids_in_netns(ns_ids):
    """{netns id: [pids]} of every live (non-zombie) process whose network namespace is one
    of ``ns_ids`` (same test as ``ip netns pids``)."""
    out = {i: [] for i in ns_ids}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{name}/ns/net")
        except OSError:  # gone, or a zombie (its namespaces are already released)
            continue
        key = (st.st_dev, st.st_ino)
        if key in out:
            out[key].append(int(name))
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill_netns_procs(ns_paths, timeout=10.0, exclude=()):
    """SIGKILL every process in the given named namespaces until none is left; return the
    pids still there at the end (normally none)."""
    ids = []
    for p in ns_paths:
        try:
            ids.append(_ns_id(p))
        except OSError:
            pass
    if not ids:
        return []
    deadline = time.monotonic() + timeout
    while True:
        left = [pid for pids in _pids_in_netns(ids).values() for pid in pids
                if pid not in exclude]
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.02)


def _stale(name):
    """True for ``synksim-<pid>-...`` names whose creating process no longer exists."""
    m = re.match(rf"^{NS_PREFIX}-(\d+)-", name)
    if not m or int(m.group(1)) == os.getpid():
        return False
    try:
        os.kill(int(m.group(1)), 0)
        return False  # creator alive: not stale
    except ProcessLookupError:
        return True
    except PermissionError:
        return False


def cleanup_stale():
    """Remove namespaces ``synksim-<pid>-...`` (and temp dirs of the same form) whose
    creating process no longer exists (a runner killed before its teardown): kill what runs
    in them, then delete them. Returns the names removed."""
    removed = []
    tmp = tempfile.gettempdir()
    try:
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            if _stale(name) and os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    except OSError:
        pass
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return removed
    for name in names:
        if not _stale(name):
            continue
        path = os.path.join(NETNS_DIR, name)
        _kill_netns_procs([path], timeout=5.0)
        if subprocess.run(["ip", "netns", "del", name], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0:
            removed.append(name)
    return removed


# ---------------------------------------------------------------------------------------

_INHOST = """#!/bin/sh
# inhost HOST CMD [ARG...]: run CMD with ARGs (exactly, no shell) "on" simulated HOST:
# its network, UTS (hostname), mount (/etc/hosts, private /dev/shm) and IPC namespaces,
# entered through that host's holder process; the working directory is kept.
if [ $# -lt 2 ]; then echo "usage: inhost HOST CMD [ARG...]" >&2; exit 2; fi
host=$1; shift
case "$host" in *@*) host=${host#*@};; esac
pidfile={state}/"$host".pid
if [ ! -r "$pidfile" ]; then echo "inhost: unknown host '$host'" >&2; exit 255; fi
read pid < "$pidfile"
exec {nsenter} -t "$pid" -n -u -m -i -- /bin/sh -c 'cd "$0" 2>/dev/null || cd /; exec "$@"' "$PWD" "$@"
"""

_NSSSH = """#!/bin/sh
# nsssh [ssh options] HOST [COMMAND...]: a fake ssh for MPICH hydra. Like ssh, COMMAND's
# words are joined with spaces and run by /bin/sh -c on HOST (through inhost).
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; break;;
    -[BbcDEeFIiJLlmOoPpQRSWw]) shift 2;;
    -*) shift;;
    *) break;;
  esac
done
if [ $# -lt 1 ]; then echo "usage: nsssh [options] HOST [COMMAND...]" >&2; exit 255; fi
host=$1; shift
if [ $# -eq 0 ]; then exec {inhost} "$host" /bin/sh; fi
exec {inhost} "$host" /bin/sh -c "$*"
"""

# Holder: after namespace set-up it prints "ready" and becomes `cat`, which lives until its
# stdin (a pipe from the harness) closes -- i.e. until teardown or the harness's death.
_HOLDER = ('hostname "$1" && mount --bind "$2" /etc/hosts && '
           'mount -t tmpfs -o "size=$3,mode=1777" tmpfs /dev/shm && '
           'echo ready && exec cat >/dev/null')


class SimHosts:
    """Context manager making simulated hosts; see the module docstring.

    Attributes (valid inside the ``with``): ``names``, ``tmpdir``, ``inhost``, ``nsssh``,
    ``hosts_file``, ``addr`` ({host: ip}), ``netns`` ({host: namespace name}), ``holders``
    ({host: pid}), ``mpiexec`` (path)."""

    def __init__(self, names=("hA", "hB"), shm_size="1g", subnet="10.99.0.0/24",
                 mpiexec=None, python=None):
        names = tuple(names)
        if len(names) < 1 or len(set(names)) != len(names):
            raise ValueError("names must be distinct and non-empty")
        if len(names) > 99:
            raise ValueError("at most 99 hosts")
        for n in names:
            if not _HOST_RE.match(n) or n in ("localhost",):
                raise ValueError(f"bad host name {n!r}")
        if not re.match(r"^\d+[kmgKMG%]?$", str(shm_size)):
            raise ValueError(f"bad shm_size {shm_size!r}")
        self.names = names
        self.shm_size = str(shm_size)
        net = ipaddress.ip_network(subnet)
        hosts_ips = list(net.hosts())
        if len(hosts_ips) < len(names):
            raise ValueError("subnet too small")
        self.addr = {n: str(hosts_ips[i]) for i, n in enumerate(names)}
        self.prefixlen = net.prefixlen
        self.python = python or sys.executable
        if mpiexec is None:
            cand = os.path.join(os.path.dirname(self.python), "mpiexec")
            mpiexec = cand if os.access(cand, os.X_OK) else shutil.which("mpiexec")
        self.mpiexec = mpiexec
        self.tag = secrets.token_hex(3)
        base = f"{NS_PREFIX}-{os.getpid()}-{self.tag}"
        self.netns = {n: f"{base}-{n}" for n in names}
        self.bridge_ns = f"{base}--br" if len(names) > 2 else None
        self.tmpdir = None
        self.inhost = self.nsssh = self.hosts_file = None
        self.holders = {}
        self._holder_procs = {}
        self._made_ns = []
        self._made_links = []
        self._children = []
        self._closed = False
        self._entered = False

    # -- set-up -----------------------------------------------------------------------
    def __enter__(self):
        self._entered = True
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        problems = self.close()
        if problems and exc_type is None:
            raise RuntimeError("SimHosts teardown left: " + "; ".join(problems))
        return False

    def _setup(self):
        tools = _tools()
        missing = [t for t, p in tools.items() if not p]
        if missing:
            raise RuntimeError(f"missing tools: {', '.join(missing)}")
        self._nsenter = tools["nsenter"]
        cleanup_stale()
        self.tmpdir = tempfile.mkdtemp(prefix=f"{NS_PREFIX}-{os.getpid()}-{self.tag}-")
        os.chmod(self.tmpdir, 0o700)
        state = os.path.join(self.tmpdir, "hosts")
        os.mkdir(state, 0o700)
        self._state = state
        self.hosts_file = os.path.join(self.tmpdir, "etc-hosts")
        with open(self.hosts_file, "w") as fh:
            fh.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            for n in self.names:
                fh.write(f"{self.addr[n]}\t{n}\n")
        os.chmod(self.hosts_file, 0o644)
        self.inhost = os.path.join(self.tmpdir, "inhost")
        self.nsssh = os.path.join(self.tmpdir, "nsssh")
        self._write_script(self.inhost, _INHOST.replace("{state}", shlex.quote(state))
                           .replace("{nsenter}", shlex.quote(self._nsenter)))
        self._write_script(self.nsssh, _NSSSH.replace("{inhost}", shlex.quote(self.inhost)))

        for n in self.names:
            self._add_ns(self.netns[n])
        if self.bridge_ns:
            self._add_ns(self.bridge_ns)
            _sh(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
            _sh(["ip", "-n", self.bridge_ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        if len(self.names) == 2:
            a, b = self.names
            la, lb = f"sk{self.tag}0a", f"sk{self.tag}0b"
            self._made_links.append(la)
            _sh(["ip", "link", "add", la, "type", "veth", "peer", "name", lb])
            for n, link in ((a, la), (b, lb)):
                _sh(["ip", "link", "set", link, "netns", self.netns[n]])
                _sh(["ip", "-n", self.netns[n], "link", "set", link, "name", "eth0"])
        elif self.bridge_ns:
            for i, n in enumerate(self.names):
                la, lb = f"sk{self.tag}{i}a", f"sk{self.tag}{i}b"
                self._made_links.append(la)
                _sh(["ip", "link", "add", la, "type", "veth", "peer", "name", lb])
                _sh(["ip", "link", "set", la, "netns", self.netns[n]])
                _sh(["ip", "-n", self.netns[n], "link", "set", la, "name", "eth0"])
                _sh(["ip", "link", "set", lb, "netns", self.bridge_ns])
                _sh(["ip", "-n", self.bridge_ns, "link", "set", lb, "name", f"p{i}"])
                _sh(["ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0"])
                _sh(["ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "up"])
        for n in self.names:
            ns = self.netns[n]
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            if len(self.names) > 1:
                _sh(["ip", "-n", ns, "addr", "add", f"{self.addr[n]}/{self.prefixlen}",
                     "dev", "eth0"])
                _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            else:
                _sh(["ip", "-n", ns, "addr", "add", f"{self.addr[n]}/32", "dev", "lo"])
        for n in self.names:
            self._start_holder(n)

    @staticmethod
    def _write_script(path, text):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(path, 0o700)

    def _add_ns(self, name):
        _sh(["ip", "netns", "add", name])
        self._made_ns.append(name)

    def _start_holder(self, n):
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.netns[n], "unshare", "--uts", "--mount", "--ipc",
             "--propagation", "private", "/bin/sh", "-c", _HOLDER, "holder", n,
             self.hosts_file, self.shm_size],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self._holder_procs[n] = p
        line = p.stdout.readline()  # `ip netns exec` and `unshare` exec, no fork: pid stays
        if line.strip() != b"ready":
            p.kill()
            err = p.stderr.read().decode(errors="replace")
            p.wait()
            raise RuntimeError(f"holder for host {n} failed: {err.strip()}")
        if _ns_id(f"/proc/{p.pid}/ns/net") != _ns_id(os.path.join(NETNS_DIR, self.netns[n])):
            raise RuntimeError(f"holder for host {n} is not in its network namespace")
        self.holders[n] = p.pid
        with open(os.path.join(self._state, f"{n}.pid"), "w") as fh:
            fh.write(f"{p.pid}\n")

    # -- running commands ---------------------------------------------------------------
    def _check_open(self):
        if self._closed or not self.holders:
            raise RuntimeError("SimHosts is not set up (use it as a context manager)")

    def host_argv(self, cmd, host=None):
        """argv running ``cmd`` (a list, or a str for ``/bin/sh -c``) on ``host`` (default:
        the first); a list that already starts with ``inhost`` is returned unchanged."""
        self._check_open()
        host = self.names[0] if host is None else host
        if host not in self.holders:
            raise KeyError(host)
        if isinstance(cmd, str):
            cmd = ["/bin/sh", "-c", cmd]
        cmd = list(cmd)
        if cmd and cmd[0] == self.inhost:  # already placed on a host (e.g. mpiexec_cmd)
            return cmd
        return [self.inhost, host, *cmd]

    def popen(self, cmd, host=None, env=None, clean_mpi_env=True, **kw):
        """``subprocess.Popen`` of ``cmd`` on ``host`` (default: the first), in a new session.

        ``env`` entries are added to the environment (PMI_*/MPI_LOCAL* of an enclosing MPI
        job are removed unless ``clean_mpi_env`` is false)."""
        full = strip_mpi_env() if clean_mpi_env else dict(os.environ)
        if env:
            full.update({k: str(v) for k, v in env.items()})
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen(self.host_argv(cmd, host), env=full, **kw)
        self._children.append(p)
        return p

    def run(self, cmd, host=None, timeout=120, env=None, input=None, capture=True,
            kill_on_timeout=True, **kw):
        """Run ``cmd`` on ``host`` and wait; returns ``CompletedProcess`` (text output when
        ``capture``). On timeout the command's session and, if ``kill_on_timeout``, every
        non-holder process in every simulated host are SIGKILLed, then ``TimeoutExpired``
        is raised (with what output had been read)."""
        if capture:
            kw.setdefault("stdout", subprocess.PIPE)
            kw.setdefault("stderr", subprocess.PIPE)
            kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.PIPE if input is not None else subprocess.DEVNULL)
        p = self.popen(cmd, host, env=env, **kw)
        try:
            out, err = p.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            if kill_on_timeout:
                self.kill_all()
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(p.args, timeout, out, err) from None
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def mpiexec_cmd(self, n, ppn, argv, env=None, extra=(), hosts=None, launcher="ssh"):
        """argv that runs, on the first of ``hosts`` (default: all hosts),
        ``mpiexec -launcher ssh -launcher-exec <nsssh> -hosts a,b,.. -ppn K -n N *extra
        *argv`` with the python/mpiexec directory first on PATH and ``env`` set for mpiexec
        (hydra passes mpiexec's environment on to every rank). Run it with :meth:`run` or
        :meth:`popen` without a host (or with ``subprocess`` directly: it already contains
        ``inhost``). ``launcher="fork"`` starts every rank on the first host."""
        self._check_open()
        hosts = list(self.names if hosts is None else hosts)
        bindir = os.path.dirname(self.mpiexec)
        pydir = os.path.dirname(self.python)
        path = os.pathsep.join(dict.fromkeys([bindir, pydir, *os.environ.get(
            "PATH", "/usr/bin:/bin").split(os.pathsep)]))
        envs = [f"PATH={path}"] + [f"{k}={v}" for k, v in (env or {}).items()]
        cmd = [self.mpiexec, "-launcher", launcher]
        if launcher == "ssh":
            cmd += ["-launcher-exec", self.nsssh]
        cmd += ["-hosts", ",".join(hosts), "-ppn", str(ppn), "-n", str(n), *extra, *argv]
        return [self.inhost, hosts[0], "/usr/bin/env", *envs, *cmd]

    # -- inspection -----------------------------------------------------------------------
    def shm_files(self, host=None):
        """Entries in a host's private ``/dev/shm`` (sorted list), or ``{host: list}`` for all
        hosts when ``host`` is None. Read through ``/proc/<holder>/root``: no process is
        started."""
        self._check_open()
        if host is None:
            return {n: self.shm_files(n) for n in self.names}
        return sorted(os.listdir(f"/proc/{self.holders[host]}/root/dev/shm"))

    def shm_path(self, host, name=""):
        """Path, seen from outside, of ``/dev/shm/<name>`` on ``host``."""
        self._check_open()
        return os.path.join(f"/proc/{self.holders[host]}/root/dev/shm", name)

    def clear_shm(self, host=None):
        """Remove every entry of a host's ``/dev/shm`` (all hosts when None), e.g. the
        ``mpich_shm_*`` files MPICH leaves after a rank is killed. Returns what was removed
        as ``{host: [names]}``."""
        self._check_open()
        out = {}
        for n in (self.names if host is None else [host]):
            out[n] = self.shm_files(n)
            for name in out[n]:
                try:
                    os.unlink(self.shm_path(n, name))
                except FileNotFoundError:
                    pass
        return out

    def wait_idle(self, timeout=5.0, host=None):
        """Wait until no process but the holders runs on the host(s); True if so. (After
        ``mpiexec`` exits, a remote proxy may still be exiting for a few ms.)"""
        deadline = time.monotonic() + timeout
        while True:
            ps = self.pids()
            busy = [p for n in (self.names if host is None else [host]) for p in ps[n]]
            if not busy:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def pids(self, host=None, include_holder=False):
        """Live pids in a host's network namespace (``{host: [pids]}`` when host is None)."""
        self._check_open()
        names = self.names if host is None else [host]
        ids = {_ns_id(os.path.join(NETNS_DIR, self.netns[n])): n for n in names}
        found = _pids_in_netns(list(ids))
        out = {}
        for key, pids in found.items():
            n = ids[key]
            out[n] = sorted(p for p in pids if include_holder or p != self.holders.get(n))
        return out if host is None else out[host]

    def rank_pids(self):
        """``{rank: (host, pid)}`` of the MPI ranks now running in the hosts: processes whose
        environment has ``PMI_RANK`` and whose parent is a ``hydra_pmi_proxy`` (so children
        a rank started itself are not counted)."""
        out = {}
        for n, pids in self.pids().items():
            for pid in pids:
                try:
                    with open(f"/proc/{pid}/environ", "rb") as fh:
                        env = fh.read().split(b"\0")
                    with open(f"/proc/{pid}/stat") as fh:
                        ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                rank = [e[9:] for e in env if e.startswith(b"PMI_RANK=")]
                if rank and "hydra_pmi_proxy" in _cmdline(ppid):
                    out[int(rank[0])] = (n, pid)
        return dict(sorted(out.items()))

    def processes(self, host=None):
        """{host: [(pid, cmdline)]} of non-holder processes (or the list for one host)."""
        allp = self.pids()
        out = {n: [(p, _cmdline(p)) for p in allp[n]] for n in allp}
        return out if host is None else out[host]

    def net_bytes(self, host):
        """(rx_bytes, tx_bytes) of the host's ``eth0`` (from /proc/<holder>/net/dev)."""
        self._check_open()
        with open(f"/proc/{self.holders[host]}/net/dev") as fh:
            for line in fh:
                if line.strip().startswith("eth0:"):
                    f = line.split(":", 1)[1].split()
                    return int(f[0]), int(f[8])
        return 0, 0

    def kill_all(self, host=None, sig=signal.SIGKILL, wait=5.0):
        """Send ``sig`` to every non-holder process on ``host`` (all hosts when None); for
        SIGKILL, repeat until none is left (or ``wait`` s). Returns the pids signalled."""
        self._check_open()
        names = self.names if host is None else [host]
        hits = set()
        deadline = time.monotonic() + wait
        while True:
            ps = self.pids()
            left = [p for n in names for p in ps.get(n, [])]
            if not left:
                break
            for p in left:
                try:
                    os.kill(p, sig)
                    hits.add(p)
                except OSError:
                    pass
            if sig != signal.SIGKILL or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self._reap()
        return sorted(hits)

    def _reap(self):
        self._children = [p for p in self._children if p.poll() is None]

    # -- teardown --------------------------------------------------------------------------
    def close(self):
        """Tear everything down (idempotent, safe after a partial set-up). Returns a list of
        problems (empty when all is gone)."""
        if self._closed:
            return []
        self._closed = True
        problems = []
        paths = [os.path.join(NETNS_DIR, ns) for ns in self._made_ns]
        holder_pids = set(self.holders.values())
        # 1) every process in the hosts except the holders, then the holders
        left = _kill_netns_procs(paths, timeout=10.0, exclude=holder_pids)
        for p in self._holder_procs.values():
            try:
                p.stdin.close()
            except OSError:
                pass
            try:
                p.kill()
            except OSError:
                pass
        left += _kill_netns_procs(paths, timeout=5.0)
        if left:
            problems.append(f"processes would not die: {sorted(set(left))}")
        for p in list(self._holder_procs.values()) + self._children:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                problems.append(f"child {p.pid} did not exit")
            for f in (p.stdout, p.stderr, p.stdin):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
        # 2) namespaces (deleting a namespace destroys the veth ends in it)
        for ns in self._made_ns:
            r = subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
            if r.returncode != 0 and os.path.exists(os.path.join(NETNS_DIR, ns)):
                problems.append(f"netns {ns}: {r.stderr.strip()}")
        # 3) a veth still in the root namespace (set-up failed before moving it)
        for link in self._made_links:
            if os.path.exists(f"/sys/class/net/{link}"):
                subprocess.run(["ip", "link", "del", link], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
            if os.path.exists(f"/sys/class/net/{link}"):
                problems.append(f"link {link} still exists")
        # 4) files
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            if os.path.exists(self.tmpdir):
                problems.append(f"temp dir {self.tmpdir} still exists")
        self.holders = {}
        return problems

    def leftovers(self):
        """What of this instance still exists (for tests after teardown): namespaces, root
        veth names, temp dir."""
        out = [ns for ns in self._made_ns if os.path.exists(os.path.join(NETNS_DIR, ns))]
        out += [lk for lk in self._made_links if os.path.exists(f"/sys/class/net/{lk}")]
        out += [lk[:-1] + "b" for lk in self._made_links
                if os.path.exists(f"/sys/class/net/{lk[:-1]}b")]
        if self.tmpdir and os.path.exists(self.tmpdir):
            out.append(self.tmpdir)
        return out

"""Worker process main loop: ``python -m synkhronos.worker '{"rank": r}'``, with the session's
configuration in the environment variable ``SYNK_WORKER_CONFIG``.

A worker attaches to its master's control segment and semaphores, prepares its device,
then executes commands until told to quit.  It checks every half second that its master
is still alive; when the master is gone it removes the session's segments and exits."""
import json
import os
import signal
import sys
import traceback

from . import runtime, shm
from .commands import HANDLERS, worker_command
from .debug import fingerprint
from .errors import Aborted, MasterDied
from .transport import ShmTransport


class WorkerContext:
    """What a worker's command handlers can use."""

    def __init__(self, cfg, transport):
        self.rank, self.n = cfg["rank"], cfg["n"]
        self.master_rank = cfg["master_rank"]
        self.master_pid = cfg["master_pid"]
        self.prefix = cfg["prefix"]
        self.transport = transport
        self.functions = []
        self.shareds = []
        self.segments = {}      # name -> Segment attached here

    def alive(self):
        if os.getppid() != self.master_pid:
            raise MasterDied("master process is gone")
        return True

    def barrier(self, check_after=True):
        self.transport.barrier(self.alive, check_after)

    def view(self, desc):
        """numpy view of a Data from its descriptor ``(segment name, dtype, shape)``."""
        name, dtype, shape = desc
        if name is None:
            import numpy as np
            return np.empty(shape, dtype)
        seg = self.segments.get(name)
        if seg is None:
            seg = self.segments[name] = shm.Segment(name)
        return seg.array(dtype, shape)

    def forget(self, names):
        for name in names:
            self.segments.pop(name, None)


@worker_command("quit")
def _quit(ctx):
    return None


def serve(cfg):
    transport = ShmTransport(cfg["prefix"], cfg["n"], cfg["rank"], cfg["master_rank"], create=False)
    ctx = WorkerContext(cfg, transport)
    debug = cfg.get("debug", False)
    try:
        from .device import CpuDevice
        CpuDevice(cfg["n"]).init_worker(cfg["rank"])
        from . import function, collectives  # noqa: F401  (register their commands)
        import pytensor  # noqa: F401  (import before the first command, not during it)
        transport.reply(("ok", os.getpid()))
    except BaseException:
        transport.reply(("err", traceback.format_exc()))
        return 1
    while True:
        try:
            name, args, forget = transport.recv(ctx.alive)
        except (MasterDied, ConnectionError):
            shm.remove_all(ctx.prefix)
            return 0
        except Exception:          # could not read the command (e.g. out of file descriptors)
            transport.abort_from_worker()
            transport.reply(("err", traceback.format_exc()))
            continue
        ctx.forget(forget)
        fp = None
        try:
            if debug:
                fp = fingerprint(transport.seq, name, args, ctx.shareds)
            reply = ("ok", HANDLERS[name](ctx, *args))
        except Aborted:
            reply = ("aborted", None)
        except MasterDied:
            shm.remove_all(ctx.prefix)
            return 0
        except BaseException:
            transport.abort_from_worker()
            reply = ("err", traceback.format_exc())
        if debug:
            reply = reply + (fp,)
        try:
            transport.reply(reply)
        except BaseException:
            transport.reply(("err", traceback.format_exc()))
        if name == "quit":
            transport.mailbox.close()
            return 0


def _dump_private(prof, path):
    """Write the profile with mode 0600, never through a symlink planted at ``path``."""
    import marshal
    prof.create_stats()
    try:
        os.unlink(path) if os.path.islink(path) else None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        marshal.dump(prof.stats, fh)


def main():
    # Ctrl-C in a terminal reaches the whole process group: only the master acts on it
    # (it aborts the command in flight); workers follow the master, or exit when it dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = json.loads(os.environ.pop("SYNK_WORKER_CONFIG"))
    cfg.update(json.loads(sys.argv[1]))
    runtime.IN_WORKER = True
    for p in reversed(cfg.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 50000))
    if cfg.get("profile"):
        import cProfile
        prof = cProfile.Profile()
        try:
            return prof.runcall(serve, cfg)
        finally:
            _dump_private(prof, f"synk_worker_{cfg['rank']}.prof")
    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())

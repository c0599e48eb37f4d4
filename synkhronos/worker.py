"""Worker process main loop: ``python -m synkhronos.worker '{"rank": r}'``, with the session's
configuration in the environment variable ``SYNK_WORKER_CONFIG``.

A worker builds its device, control and comm planes from the configuration, then executes
commands until told to quit.  Before each command it settles what the previous one left
pending (the master says whether every rank succeeded).  It checks every half second
that its master is still alive; when the master is gone it frees the session's shared
resources and exits."""
import json
import os
import signal
import sys
import traceback

from . import backends, session, signals, timeline
from . import rank as rank_module
from .commands import handler, worker_command
from .compiling import generated_src_dir
from .debug import fingerprint
from .errors import Aborted, MasterDied
from .messages import Reply
from .rank import Rank
from .waiting import Waiter


@worker_command("quit")
def _quit(me):
    return timeline.take()          # this rank's timeline events (None when it is off)


def _master_watch(master_pid):
    """A worker's liveness check of its master (its parent process)."""
    def check():
        if os.getppid() != master_pid:
            raise MasterDied("master process is gone")
    return check


def serve(cfg):
    rank = cfg["rank"]
    # (no stall warnings here: the master watches for stalls)
    waiter = Waiter(_master_watch(cfg["master_pid"]), None, None, spin=cfg.get("spin"))
    control = backends.attach_control(cfg, rank, waiter)
    debug = cfg.get("debug", False)
    try:
        device = backends.make_device(cfg.get("device") or {"kind": "cpu"}, cfg["n"])
        comm = backends.attach_comm(cfg, rank, control, device)
        device.init_worker(rank)
        if cfg.get("timeline"):
            import socket
            timeline.start(rank, socket.gethostname(), int(cfg["timeline"]))
        me = Rank(rank, cfg["n"], cfg["master_rank"], device, control, comm)
        rank_module.become(me)
        from . import function, rankops  # noqa: F401  (register their commands)
        import pytensor  # (import before the first command, not during it)
        pytensor.config.generated_src_dir = generated_src_dir()
        control.reply(0, Reply("ok", os.getpid()))
    except BaseException:
        control.reply(0, Reply("err", traceback.format_exc()))
        return 1
    while True:
        try:
            seq, command = control.receive()
        except MasterDied:
            backends.worker_exit(cfg)
            return 0
        except Exception:          # could not read the command (e.g. out of file descriptors)
            control.abort()
            control.reply(control.seq, Reply("err", traceback.format_exc()))
            continue
        me.seq = seq
        me.flight.command(seq)
        fp = None
        try:
            me.settle(command.settle)
            me.forget(command.forget)
            if debug:
                fp = fingerprint(seq, command.name, command.args, me.shareds)
            reply = Reply("ok", handler(command.name)(me, *command.args))
        except Aborted:
            reply = Reply("aborted")
        except MasterDied:
            backends.worker_exit(cfg)
            return 0
        except BaseException:
            control.abort()
            reply = Reply("err", traceback.format_exc())
        finally:
            signals.release()
        if debug:
            reply = reply._replace(fingerprint=fp)
        me.flight.done(seq)
        try:
            control.reply(seq, reply)
        except BaseException:
            control.reply(seq, Reply("err", traceback.format_exc()))
        if command.name == "quit":
            control.close()
            comm.close()
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
    session.IN_WORKER = True
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


def exit_quickly(code):
    """End a worker that quit cleanly without the interpreter's teardown: its exit handlers
    run (PyTensor's cache and profile, JAX's, the user's) and its output is flushed, but
    freeing every module of PyTensor, numba and JAX one by one (~0.5 s a rank, seconds on a
    loaded machine, all of it inside the master's ``close()``) is left to the kernel, as
    multiprocessing does for its children.  With a non-daemon thread of user code still
    running, the normal exit waits for it instead."""
    import atexit
    import threading
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.current_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    exit_quickly(main())

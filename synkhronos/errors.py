"""Exceptions raised by synkhronos.

Every failure that happens inside a worker reaches the user as one of these, naming the
rank (and its host, where there are several) and carrying the worker's own traceback."""


class SynkError(RuntimeError):
    """Base class of synkhronos' own runtime errors."""


class WorkerError(SynkError):
    """One or more workers raised an exception while running a command.

    ``errors`` maps rank -> the worker's formatted traceback.  The session stays usable."""

    def __init__(self, errors, what="command"):
        self.errors = dict(errors)
        ranks = ", ".join(str(r) for r in sorted(self.errors))
        parts = [f"synkhronos: worker rank {ranks} raised an exception during {what}:"]
        for rank in sorted(self.errors):
            parts.append(f"--- traceback from rank {rank} ---\n{self.errors[rank].rstrip()}")
        super().__init__("\n".join(parts))

    @property
    def ranks(self):
        return sorted(self.errors)


class RankLost(SynkError):
    """A rank can no longer take part (it died, it is stopped, or it stalled past the
    timeout).  The session has been closed; call ``synk.fork()`` to start a new one."""

    ranks = ()


def _where(rank, host):
    return f"rank {rank}" + (f" on host {host}" if host else "")


class WorkerDied(RankLost):
    """A worker process exited or was killed."""

    def __init__(self, rank, returncode, what="command", host=None):
        self.rank, self.returncode, self.host = rank, returncode, host
        self.ranks = (rank,)
        if returncode is None:
            how = "is gone"
        elif returncode < 0:
            how = f"was killed by signal {-returncode}"
        else:
            how = f"exited with code {returncode}"
        super().__init__(f"synkhronos: worker {_where(rank, host)} {how} during {what}; the session "
                         "was closed (call synk.fork() to start again).")


class WorkerStopped(RankLost):
    """A worker process is stopped (SIGSTOP, a debugger): it cannot answer."""

    def __init__(self, rank, seconds, what="command", host=None):
        self.rank, self.host, self.seconds = rank, host, seconds
        self.ranks = (rank,)
        super().__init__(f"synkhronos: worker {_where(rank, host)} is stopped (process state T for "
                         f"{seconds:.1f} s) during {what}; the session was closed (call synk.fork() to "
                         "start again).")


class StallTimeout(RankLost):
    """Ranks did not answer within the session's ``timeout``."""

    def __init__(self, ranks, seconds, what="command"):
        self.ranks = tuple(ranks)
        self.seconds = seconds
        who = f"rank(s) {', '.join(map(str, self.ranks))}" if self.ranks else "the other ranks"
        super().__init__(f"synkhronos: {who} did not answer within the timeout ({seconds:.1f} s) during "
                         f"{what}; the session was closed (call synk.fork() to start again).")


class DeviceMemoryError(SynkError, MemoryError):
    """A rank's device ran out of memory computing its share of a call: names the rank,
    its device, the allocation that failed and this rank's inputs.  Nothing was applied
    (updates are all-or-nothing) and the session stays usable: a smaller batch, or
    ``num_slices``, fits.  A MemoryError too."""

    def __init__(self, rank, device, what, detail, inputs, stats=None):
        self.rank, self.device, self.detail, self.stats = rank, device, detail, stats
        text = (f"synkhronos: rank {rank} ({device}) ran out of device memory during {what}: {detail}. "
                f"This rank's inputs: {inputs}.")
        if stats:
            text += (f" Device memory: {_gib(stats.get('bytes_in_use'))} in use, peak "
                     f"{_gib(stats.get('peak_bytes_in_use'))}, limit {_gib(stats.get('bytes_limit'))}.")
        text += (" Nothing was applied and the session is usable: use a smaller batch, or num_slices=k to "
                 "compute each rank's share in k pieces.")
        super().__init__(text)


def _gib(n):
    return "?" if n is None else f"{n / 2 ** 30:.2f} GiB"


class OutOfRange(IndexError, ValueError):
    """An index or selector out of range.  An IndexError; also a ValueError, which the
    original Synkhronos raised, so code written for it still catches it."""


class BadArgument(TypeError, ValueError):
    """An argument of the wrong kind.  A TypeError; also a ValueError, which the original
    Synkhronos raised for some of these, so code written for it still catches it."""


class ForeignSession(SynkError):
    """The session belongs to another process (this one was forked from it)."""


class MasterDied(SynkError):
    """Raised inside a worker when its master process is gone (the worker then exits)."""


class Aborted(SynkError):
    """Raised inside a rank when another rank failed during a multi-phase command."""

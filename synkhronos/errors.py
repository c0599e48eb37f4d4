"""Exceptions raised by synkhronos.

Every failure that happens inside a worker reaches the user as one of these, naming the
rank and carrying the worker's own traceback text."""


class SynkError(RuntimeError):
    """Base class of synkhronos' own runtime errors."""


class WorkerError(SynkError):
    """One or more workers raised an exception while running a command.

    ``errors`` maps rank -> the worker's formatted traceback.  The runtime stays usable."""

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


class WorkerDied(SynkError):
    """A worker process exited or was killed.  The runtime has been closed;
    call ``synk.fork()`` again to start a new one."""

    def __init__(self, rank, returncode, what="command"):
        self.rank, self.returncode = rank, returncode
        how = f"was killed by signal {-returncode}" if returncode and returncode < 0 else f"exited with code {returncode}"
        super().__init__(
            f"synkhronos: worker rank {rank} {how} during {what}; the runtime was closed "
            f"(call synk.fork() to start again).")


class MasterDied(SynkError):
    """Raised inside a worker when its master process is gone (the worker then exits)."""


class Aborted(SynkError):
    """Raised inside a rank when another rank failed during a multi-phase command."""

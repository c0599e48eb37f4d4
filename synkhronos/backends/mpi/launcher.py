"""The ``mpi`` launcher: the master's own host's workers (started as on one host), and the
other hosts' ranks as their agents report them (started, lost or stopped)."""
import socket

from ...launcher import RankGone


class MpiLauncher:
    """The master's launcher: its own host's workers, and the other hosts' ranks through
    their agents' reports."""

    def __init__(self, local, hub, remote_info):
        self.local, self.hub, self.remote_info = local, hub, remote_info
        self.host = socket.gethostname()

    def start(self, ranks, argv, env_for):
        self.local.start(ranks, argv, env_for)

    def check(self, leaving=()):
        self.hub.service()
        self.hub.check(leaving)
        try:
            self.local.check(leaving)
        except RankGone as gone:          # across hosts every report names the host
            if gone.host is None:
                gone.host = self.host
            raise

    def info(self):
        return self.local.info() + list(self.hub.ranks_info)

    def stop(self, graceful=True):
        self.local.stop(graceful)

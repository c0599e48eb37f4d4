"""What the master can tell about its session, for diagnostics: its ranks, hosts and
processes, the commands sent, its shared resources, what every rank is doing (the flight
recorder) and, in debug mode, every command's fingerprints."""
from dataclasses import dataclass

from . import flight
from .session import current, last


@dataclass(frozen=True)
class RankInfo:
    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class SessionInfo:
    """What ``synk.session_info()`` reports about the current session."""
    open: bool
    distributed: bool
    n: int
    master_rank: int
    ranks: tuple            # RankInfo of every rank, the master's included
    commands: dict          # command name -> how many the master sent so far
    debug: bool
    resources: dict         # what the session owns, e.g. {"shm_prefix": "/synk_…"}
    flight: tuple = ()      # flight.RankFlight of every rank: what each is doing (synkhronos.flight)
    device: str = ""        # what the ranks compute on, as the fork banner says it
    gpu: bool = False       # whether the ranks compute on GPUs


def session_info():
    """A description of the current session (its ranks' hosts and processes, commands sent,
    the names of its shared resources, and what every rank is doing: ``flight``), or None
    when there is none.  For diagnostics; ``flight_report()`` puts ``flight`` in words."""
    session = last()
    if session is None:
        return None
    ranks = [RankInfo(r, h, p) for r, h, p in session.launcher.info()]
    ranks.append(RankInfo(session.rank, session.launcher.host, session.pid))
    planes = session.planes
    free = session.lock.acquire(blocking=False)     # (another thread's call may be using MPI)
    try:
        flights = tuple(session.flights(wait=0.3 if free else 0.0))
    finally:
        if free:
            session.lock.release()
    return SessionInfo(not session.closed, session.distributed, session.n, session.master_rank,
                       tuple(sorted(ranks, key=lambda i: i.rank)), dict(session.commands_sent), session.debug,
                       dict(planes.resources) if planes is not None else {}, flights,
                       session.device.describe(), getattr(session.device, "platform", "") == "gpu")


def flight_report():
    """What every rank is doing (the command, the collective, what it waits for and on
    whom, since when; its last collectives), as text; None without a session."""
    session = current()
    if session is None:
        return None
    return flight.report(session.flights(), session.command_log)


def debug_log():
    """Fingerprints of every command so far ({rank: fingerprint} each), in debug mode."""
    session = last()
    return [] if session is None else list(session.debug_log)



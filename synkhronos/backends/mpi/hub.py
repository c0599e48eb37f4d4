"""The lead slot of a host: how the rest of a multi-host session takes part in the
barriers, votes and aborts of a host's shared-memory session.

``HostView`` reads and writes a host's session on behalf of its MPI process (the master on
its own host, an agent on the others).  ``Hub`` is the master's side: it gathers the
agents' arrivals, votes, aborts, replies and lost ranks, and answers with "go", decisions
and aborts, at every look of the master's waits."""
from .world import ABORT, ARRIVE_T, DECIDE, FLIGHT, GO, LOST, READY, REPLY, VOTE_T
from ..shm.control import ARRIVE, VOTE
from ... import signals
from ...launcher import RankGone
from ...flight import RankFlight
from ...messages import Reply


class HostView:
    """A host's shared-memory session seen by its MPI process (the lead)."""

    def __init__(self, control):
        self.ctl = control
        self.members = control.members
        self.lead = control.lead
        self.sent_arrive = self.sent_vote = 0
        self.sent_abort = -1

    def members_arrived(self):
        """The barrier token every member has reached (the smallest), 0 if none."""
        return min(self.ctl.get_field(r, ARRIVE) for r in self.members)

    def members_voted(self):
        """(token, all yes) when every member voted the same token; else None."""
        votes = [self.ctl.get_field(r, VOTE) for r in self.members]
        tok = abs(votes[0])
        if tok == 0 or any(abs(v) != tok for v in votes):
            return None
        return tok, all(v > 0 for v in votes)

    def release(self, token):
        self.ctl.set_field(self.lead, ARRIVE, token)
        self.ctl.wake(self.members)

    def decide(self, token, ok):
        self.ctl.set_field(self.lead, VOTE, token if ok else -token)
        self.ctl.wake(self.members)

    def local_abort(self):
        a = self.ctl.last_abort()
        return a if a > self.sent_abort and a >= self.ctl.seq else None

    def set_abort(self, seq):
        self.ctl.abort(seq)


class Hub:
    """The master's side of the session between hosts (run at every poll of its waits)."""

    def __init__(self, w, host0, agents):
        self.w, self.host, self.agents = w, host0, agents
        self.arrivals = {}          # token -> set of agents
        self.votes = {}             # token -> {agent: ok}
        self.replies = {}           # seq -> {global rank: reply}
        self.lost = []              # the agents' reports of ranks gone: (rank, host, returncode, stopped)
        self.ranks_info = []        # (rank, host, pid) of the other hosts' ranks
        self.flights = {}           # agent -> the flight records it sent last

    def finished_hosts(self, seq):
        """The other hosts all of whose ranks have replied "ok" to command ``seq`` (none of
        them takes part in a collective of it any more, and none failed: a failure aborts)."""
        got = self.replies.get(seq)
        if not got:
            return []
        hosts = {}
        for r, host, _ in self.ranks_info:
            hosts.setdefault(host, []).append(r)
        return [h for h, ranks in hosts.items() if all(r in got and got[r].status == "ok" for r in ranks)]

    def service(self):
        # forwarding and deciding are not split by an interrupt: a vote decided here is
        # decided on every host
        with signals.deferred():
            self._service()

    def _service(self):
        for src, tag, obj in self.w.poll():
            if tag == ARRIVE_T:
                self.arrivals.setdefault(obj, set()).add(src)
            elif tag == VOTE_T:
                tok, ok = obj
                self.votes.setdefault(tok, {})[src] = ok
            elif tag == ABORT:
                if obj >= self.host.ctl.seq:
                    self.host.set_abort(obj)
                    self.host.sent_abort = obj
                    for a in self.agents:
                        if a != src:
                            self.w.isend(obj, a, ABORT)
            elif tag == REPLY:
                seq, reps = obj
                self.replies.setdefault(seq, {}).update((r, Reply.from_wire(t)) for r, t in reps.items())
            elif tag == LOST:
                self.lost.append(obj)
            elif tag == FLIGHT:         # an agent's flight records (asked for)
                self.flights[src] = [RankFlight(*f) for f in obj]
            elif tag == READY:          # an agent started its ranks
                host, pids = obj
                self.ranks_info.extend((r, host, p) for r, p in sorted(pids.items()))
        h = self.host
        a = h.local_abort()
        if a is not None:
            h.sent_abort = a
            for ag in self.agents:
                self.w.isend(a, ag, ABORT)
        tok = h.members_arrived()
        if tok > h.sent_arrive and self.arrivals.get(tok, set()) >= set(self.agents):
            h.sent_arrive = tok
            self.arrivals = {t: v for t, v in self.arrivals.items() if t > tok}
            for ag in self.agents:
                self.w.isend(tok, ag, GO)
            h.release(tok)
        voted = h.members_voted()
        if voted is not None and voted[0] > h.sent_vote:
            tok, ok = voted
            theirs = self.votes.get(tok, {})
            if set(theirs) >= set(self.agents):
                ok = ok and all(theirs.values())
                h.sent_vote = tok
                self.votes = {t: v for t, v in self.votes.items() if t > tok}
                for ag in self.agents:
                    self.w.isend((tok, ok), ag, DECIDE)
                h.decide(tok, ok)

    def remote_flights(self, wait):
        """The other hosts' flight records: asked for, awaited ``wait`` seconds (0: the
        last ones received; no MPI call, e.g. from a signal handler)."""
        import time
        if wait > 0:
            asked = time.monotonic()
            self.flights = {}
            for a in self.agents:
                self.w.isend(None, a, FLIGHT)
            while len(self.flights) < len(self.agents) and time.monotonic() - asked < wait:
                self.service()
                time.sleep(0.002)
        return [f for a in sorted(self.flights) for f in self.flights[a]]

    def check(self, leaving=()):
        """Raise ``RankGone`` for the first rank another host reported gone (a rank of
        ``leaving`` that exited with status 0 did as told)."""
        for rank, host, rc, stopped in self.lost:
            if not (rc == 0 and stopped is None and rank in leaving):
                raise RankGone(rank, returncode=rc, stopped=stopped, host=host)

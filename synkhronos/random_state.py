"""Every rank's random generators: the ``RandomType`` shared variables (a
``numpy.random.Generator`` in each rank, each drawing its own numbers), read and set through
their bit generator's state, a JSON-able dict.  What checkpoints save of them
(``synkhronos.checkpoint``).

Every rank draws its own stream: at ``synk.distribute()`` the master's rank keeps its
generator's and rank r gets a new, independent stream of the same bit generator seeded
from the master's state and r (``spread``).  At another number of ranks, rank r continues
saved rank r's stream while there is one; a rank beyond them gets the stream seeded from
the saved rank 0 state and r (the same seed every time: a resumed run is repeatable).
A state saved on numba ranks continues on JAX ranks from the key PyTensor derives from it;
one drawn by JAX continues on numba ranks as a stream seeded from it (the two backends
draw different numbers from one generator anyway)."""
from . import generators
from .commands import worker_command

__all__ = ["random_shareds", "states", "set_states", "resized", "spread"]

_GET = __name__ + ":get"
_SET = __name__ + ":set"


def random_shareds(session):
    """``[(position, variable)]`` of the session's shared variables that hold generators."""
    from pytensor.tensor.random.type import RandomType
    return [(i, v) for i, v in enumerate(session.shareds) if isinstance(v.type, RandomType)]


def _get_states(me, vids):
    return [me.device.generator_state(me.shareds[v]) for v in vids]


def _set_states(me, vids, per_rank):
    for v, state in zip(vids, per_rank[me.rank]):
        me.device.set_generator_state(me.shareds[v], state)


worker_command(_GET)(_get_states)
worker_command(_SET)(_set_states)


def states(session, vids):
    """``[[state of rank 0, ...] per variable]`` of the variables ``vids`` (registry ids)."""
    with session.api(True):
        mine, theirs = session.execute(_GET, (vids,), lambda: _get_states(session.me, vids),
                                       what="random states")
    per_rank = dict(theirs)
    per_rank[session.rank] = mine
    return [[per_rank[r][i] for r in range(session.n)] for i in range(len(vids))]


def set_states(session, vids, per_var):
    """Set rank r's generator of ``vids[i]`` to ``per_var[i][r]``: every state is checked
    in the master first (ValueError), then every rank sets its own."""
    for sts in per_var:
        for st in sts:
            generators.generator(st)
    per_rank = [[sts[r] for sts in per_var] for r in range(session.n)]
    with session.api(True):
        session.execute(_SET, (vids, per_rank), lambda: _set_states(session.me, vids, per_rank),
                        what="set random states")


def resized(saved, n):
    """The states of ``n`` ranks from ``saved`` (one per saved rank): rank r keeps saved
    rank r's; a rank beyond them a new stream seeded from saved rank 0's state and r."""
    return list(saved[:n]) + [generators.state_of(generators.derived(saved[0], r))
                              for r in range(len(saved), n)]


def spread(session):
    """Give every rank its own stream of each generator the session's functions read
    (after ``synk.distribute()`` every rank holds a copy of the master's generators, and
    ranks drawing the same numbers, e.g. the same dropout masks for their different rows,
    would not be the independent draws of a serial run): the master's rank keeps its
    stream, rank r another one seeded from it and r (the rule of ``resized``)."""
    vids = [i for i, _ in random_shareds(session)]
    if not vids or session.n == 1:
        return
    m = session.rank
    per_var = [[sts[m] if r == m else generators.state_of(generators.derived(sts[m], r))
                for r in range(session.n)] for sts in states(session, vids)]
    set_states(session, vids, per_var)

"""Every rank's random generators: the ``RandomType`` shared variables (a
``numpy.random.Generator`` in each rank, each drawing its own numbers), read and set through
their bit generator's state, a JSON-able dict.  What checkpoints save of them
(``synkhronos.checkpoint``).

At another number of ranks, rank r continues saved rank r's stream while there is one;
a rank beyond them gets a new, independent stream of the same bit generator, seeded from
the saved rank 0 state and r (the same seed every time: a resumed run is repeatable)."""
import hashlib
import json

import numpy as np

from .commands import worker_command

__all__ = ["random_shareds", "states", "set_states", "resized"]

_GET = __name__ + ":get"
_SET = __name__ + ":set"


def random_shareds(session):
    """``[(position, variable)]`` of the session's shared variables that hold generators."""
    return [(i, v) for i, v in enumerate(session.shareds)
            if isinstance(v.get_value(borrow=True), np.random.Generator)]


def _to_json(x):
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return {"ndarray": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, np.integer):
        return int(x)
    return x


def _from_json(x):
    if isinstance(x, dict):
        if set(x) == {"ndarray", "dtype"}:
            return np.asarray(x["ndarray"], dtype=x["dtype"])
        return {k: _from_json(v) for k, v in x.items()}
    return x


def generator(state):
    """A new ``Generator`` in ``state`` (a dict of ``states``); ValueError if it is not one."""
    try:
        bit_gen = getattr(np.random, state["bit_generator"])()
        bit_gen.state = _from_json(state)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not the state of a numpy bit generator: {e}") from None
    return np.random.Generator(bit_gen)


def _get_states(me, vids):
    return [_to_json(me.device.get(me.shareds[v]).bit_generator.state) for v in vids]


def _set_states(me, vids, per_rank):
    for v, state in zip(vids, per_rank[me.rank]):
        me.device.set(me.shareds[v], generator(state))


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
            generator(st)
    per_rank = [[sts[r] for sts in per_var] for r in range(session.n)]
    with session.api(True):
        session.execute(_SET, (vids, per_rank), lambda: _set_states(session.me, vids, per_rank),
                        what="set random states")


def resized(saved, n):
    """The states of ``n`` ranks from ``saved`` (one per saved rank): rank r keeps saved
    rank r's; a rank beyond them a new stream seeded from saved rank 0's state and r."""
    out = list(saved[:n])
    words = np.frombuffer(hashlib.sha256(json.dumps(saved[0], sort_keys=True).encode()).digest(), np.uint32)
    for r in range(len(out), n):
        kind = getattr(np.random, saved[0]["bit_generator"])
        out.append(_to_json(kind(np.random.SeedSequence([int(w) for w in words] + [r])).state))
    return out

"""What the exchange strategies share: the session they build in, the registry indices of
their shared variables, and the state a strategy keeps on a rank."""
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.session import get_session


def before_distribute(what):
    """The session, which must not be distributed yet: ``what`` makes functions and shared
    variables of its own, and only ``synk.distribute()`` sends those to the workers."""
    session = get_session()
    if session.distributed:
        raise RuntimeError(f"{what} makes functions and shared variables of its own: build it after "
                           "synk.fork() and before synk.distribute()")
    return session


def as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def shared_id(session, var, what):
    """``var``'s registry index (the same on every rank); ``what`` names the caller in the error."""
    vid = session.shared_ids.get(id(var))
    if vid is None:
        raise ValueError(f"{what}: {var} is not a shared variable of any distributed synkhronos function")
    return vid


def register_variables(name, variables):
    """A function that is never called (no JIT): it makes the variables known to the
    collectives (every shared variable of a function gets a registry index)."""
    return synk.function([], outputs=[pt.sum(v) for v in variables], name=name)


def rank_state(me):
    """The dict the exchange strategies keep on rank ``me`` (buffers reused across calls)."""
    return me.extras.setdefault("exchange", {})

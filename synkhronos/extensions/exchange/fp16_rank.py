"""What every rank does in a float16 all-reduce: compress (with error feedback), all-reduce
the float16 shadows in one comm call, decompress.  A command of its own (``COMMAND``) or a
follow-up step of a call (``("ext", COMMAND, items, op)``)."""
import numpy as np

from synkhronos.kernels import half
from synkhronos.commands import worker_command

from .common import rank_state

COMMAND = __name__ + ":fp16"


def _spare(state, key, current, shape, dtype):
    """One of two buffers kept for ``key`` on this rank: the one that is not ``current``
    (the variable's value now), so a new value never overwrites the one it replaces."""
    bufs = state.setdefault(key, [])
    for b in bufs:
        if b.shape == shape and b.dtype == dtype and b is not current and not np.may_share_memory(b, current):
            return b
    b = np.empty(shape, dtype)
    bufs.append(b)
    del bufs[:-2]
    return b


@worker_command(COMMAND)
def fp16_all_reduce(me, items, op):
    """Every rank: compress, all-reduce the float16 shadows (one comm call), decompress.
    ``items``: ``(variable, shadow, residual or -1)`` registry indices.  Reads each
    variable's pending value (a follow-up reads what the call just computed); the results
    become pending (and the variables' values, for the next follow-up).  A device rank
    (JAX) does the same on host copies of its values (the conversions are the host's numba
    kernels) and puts the results back on its device."""
    dev = me.device
    on_host = dev.placement == "host"
    st = rank_state(me)
    work = []
    for vid, svid, rvid in items:
        var, svar = me.shareds[vid], me.shareds[svid]
        value = np.ascontiguousarray(dev.to_host(me.pending_value(var)))
        if value.dtype != np.float32:
            raise TypeError(f"fp16 all_reduce: {var} holds {value.dtype} values, expected float32")
        shape = value.shape
        # after the first exchange: the comm's slot (no copy-in)
        shadow = dev.get(svar) if on_host else st.get(("s", svid))
        if not (isinstance(shadow, np.ndarray) and shadow.dtype == np.float16 and shadow.shape == shape
                and shadow.flags.c_contiguous and shadow.flags.writeable):
            shadow = np.empty(shape, np.float16)
        rvar = r_new = None
        if rvid >= 0:
            rvar = me.shareds[rvid]
            r = dev.get(rvar) if on_host else np.asarray(dev.to_host(dev.get(rvar)))
            if not (isinstance(r, np.ndarray) and r.dtype == np.float32 and r.shape == shape):
                r = np.zeros(shape, np.float32)          # a new shape: start afresh
            r_new = _spare(st, ("r", rvid), r, shape, np.float32)
            half.compress(value, shadow, np.ascontiguousarray(r), r_new)
        else:
            half.compress(value, shadow)
        work.append((var, svar, svid, rvar, r_new, shadow, shape, vid))
    comm = me.comm.pick("all_reduce", np.float16, op, "host")     # shadows are host arrays
    results = comm.all_reduce([(svid, shadow) for _, _, svid, _, _, shadow, _, _ in work], op, fence=True)
    held = {}
    for (var, svar, svid, rvar, r_new, _, shape, vid), res in zip(work, results):
        out = _spare(st, ("v", vid), dev.get(var) if on_host else None, shape, np.float32)
        half.decompress(np.asarray(res), out)
        if on_host:
            held[svar] = res
        else:                         # the shadow stays on the host (internal: no copy to the device)
            st[("s", svid)] = res
            out = dev.to_device(out)                                 # (copies)
            r_new = None if rvar is None else dev.to_device(r_new)
        dev.set(var, out)             # a follow-up step of this command reads it
        held[var] = out
        if rvar is not None:
            held[rvar] = r_new
    me.hold(me.seq, held)
    return None

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
    """Every rank: agree on each variable's wire scale, compress, all-reduce the float16
    shadows (one comm call), decompress.  ``items``: ``(variable, shadow, residual or -1)``
    registry indices.  Reads each variable's pending value (a follow-up reads what the call
    just computed); the results become pending (and the variables' values, for the next
    follow-up).  A device rank (JAX) does the same on host copies of its values (the
    conversions are the host's numba kernels) and puts the results back on its device.

    The wire scale (``half.wire_scale``: a power of two, 1 unless the values are large)
    comes from every rank's largest finite magnitude (one small all-reduce), so that the
    float16 sum of every rank's values never overflows: no finite input becomes inf, and
    what does not fit one exchange stays in the residual for the next."""
    dev = me.device
    on_host = dev.placement == "host"
    st = rank_state(me)
    work = []
    for vid, svid, rvid in items:
        var = me.shareds[vid]
        value = np.ascontiguousarray(dev.to_host(me.pending_value(var)))
        if value.dtype != np.float32:
            raise TypeError(f"fp16 all_reduce: {var} holds {value.dtype} values, expected float32")
        r = None
        if rvid >= 0:
            r = dev.get(me.shareds[rvid]) if on_host else np.asarray(dev.to_host(dev.get(me.shareds[rvid])))
            if not (isinstance(r, np.ndarray) and r.dtype == np.float32 and r.shape == value.shape):
                r = np.zeros(value.shape, np.float32)          # a new shape: start afresh
            r = np.ascontiguousarray(r)
        work.append((vid, svid, rvid, value, r))
    scales = _wire_scales(me, work)
    sent = []
    for (vid, svid, rvid, value, r), scale in zip(work, scales):
        shape = value.shape
        # after the first exchange: the comm's slot (no copy-in)
        shadow = dev.get(me.shareds[svid]) if on_host else st.get(("s", svid))
        if not (isinstance(shadow, np.ndarray) and shadow.dtype == np.float16 and shadow.shape == shape
                and shadow.flags.c_contiguous and shadow.flags.writeable):
            shadow = np.empty(shape, np.float16)
        r_new = None
        if r is not None:
            r_new = _spare(st, ("r", rvid), r, shape, np.float32)
            half.compress(value, shadow, r, r_new, scale=scale)
        else:
            half.compress(value, shadow, scale=scale)
        sent.append((shadow, r_new))
    comm = me.comm.pick("all_reduce", np.float16, op, "host")     # shadows are host arrays
    results = comm.all_reduce([(w[1], shadow) for w, (shadow, _) in zip(work, sent)], op, fence=True)
    held = {}
    for (vid, svid, rvid, value, _), (_, r_new), scale, res in zip(work, sent, scales, results):
        var, svar = me.shareds[vid], me.shareds[svid]
        out = _spare(st, ("v", vid), dev.get(var) if on_host else None, value.shape, np.float32)
        half.decompress(np.asarray(res), out, scale=scale)
        if on_host:
            held[svar] = res
        else:                         # the shadow stays on the host (internal: no copy to the device)
            st[("s", svid)] = res
            out = dev.to_device(out)                                 # (copies)
            r_new = None if r_new is None else dev.to_device(r_new)
        me.set_ahead(var, out)        # a follow-up step of this command reads it
        if rvid >= 0:
            held[me.shareds[rvid]] = r_new
    me.hold(me.seq, held)
    return None


def _wire_scales(me, work):
    """Each variable's wire scale, the same on every rank: from the largest finite
    magnitude of what any rank sends (its value plus its residual)."""
    tops = np.array([half.finite_max(value, r) for _, _, _, value, r in work], np.float32)
    if me.n > 1:
        comm = me.comm.pick("all_reduce", np.float32, "max", "host")
        key = len(me.shareds)                  # (a key reserved for in-graph collectives: none runs here)
        tops = comm.all_reduce([(key, tops)], "max", scratch=True, owned=True)[0]
    return [half.wire_scale(t, me.n) for t in tops]

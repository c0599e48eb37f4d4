"""Collectives of device arrays through the host: device -> host -> shared memory -> device.

Wraps the host implementation (``ShmComm``) for every verb: each rank moves its arrays to
the host (a view where the device is the CPU), runs the host collective, and moves the
results back (copies: a device array never aliases the shared slots, which the next
collective reuses).  The host collective is always fenced, since the results are read at
once.  It serves whatever the device's own path (XLA's collectives: NCCL on GPUs) does not,
and everything when that path is not available; on a GPU it says so, once per reason (rank 0
only).

``all_reduce`` of numeric values combines on the device where the device says so
(``reduce_on_device``: ``"all"``, or ``"large"`` for values of ``DEVICE_MIN_BYTES`` and more:
the default on GPUs; ``SYNK_STAGED_REDUCE``): every rank copies its
value into its page-locked slot (on a GPU by the copy engine, straight into the slot),
copies the other ranks' slots to its device and reduces there in rank order (so every rank
computes the same bits), instead of reducing on the host and copying the result back: no
host copy, and the adds at the GPU's speed."""
import sys
import time

import numpy as np

from ... import timeline
from ...comm import ReadsAll
from ...reductions import accumulator


_warned = set()
DEVICE_MIN_BYTES = 1 << 20      # ("large") smaller values: the host's one-meeting all_reduce is faster


class StagedComm:
    """``host``: the host comm of the same ranks; ``device``: moves arrays (``to_host``/
    ``to_device``); ``why``: why the device's own collectives do not serve (for the
    warning); ``front``: the device comm in front of this one, if any."""

    name = "staged"
    returns_new = ()            # (device arrays are never buffers the comm reuses; in-graph ops copy anyway)

    def __init__(self, host, device, why=None, front=None):
        self.host, self.device, self.why, self.front = host, device, why, front
        self.n = host.n
        self.gpu = getattr(device, "platform", None) == "gpu"
        self.on_device = getattr(device, "reduce_on_device", None) if isinstance(host, ReadsAll) else None

    def accepts(self, verb, dtype, op=None, placement="host"):
        if placement != "device" or not self.host.accepts(verb, dtype, op, "host"):
            return False
        if self.gpu and self.n > 1 and verb not in ("shapes", "barrier") and getattr(self.host, "rank", 0) == 0:
            self._warn(verb, dtype, op)       # (one rank says it: once a session, not once a rank; none alone)
        return True

    def _warn(self, verb, dtype, op):
        if self.front is not None:
            reason = (f"XLA's collectives (NCCL) serve only {', '.join(self.front.verbs)} of numeric dtypes, "
                      f"not {verb} of {dtype}" + (f" with op {op}" if op else ""))
        else:
            reason = self.why or "NCCL is not available for this session"
        if reason in _warned:
            return
        _warned.add(reason)
        print(f"synkhronos: warning: collectives of GPU arrays go through host memory (GPU -> host -> shared "
              f"memory -> GPU), not NCCL: {reason}", file=sys.stderr, flush=True)

    # ---- helpers -----------------------------------------------------------------------------
    def _h(self, arr):
        return self.device.to_host(arr)

    def _d(self, arrs):
        return [self.device.to_device(a) for a in arrs]

    # ---- verbs -------------------------------------------------------------------------------
    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):   # (device arrays: new)
        if self.n == 1:
            return [a for _, a in items]     # device arrays are immutable: the value itself
        if self.on_device and (self.on_device == "all" or sum(a.nbytes for _, a in items) >= DEVICE_MIN_BYTES) \
                and all(_device_reducible(op, a.dtype) for _, a in items):
            return self._device_all_reduce(items, op, scratch)
        return self._d(self.host.all_reduce([(k, self._h(a)) for k, a in items], op, fence=True,
                                            scratch=scratch))

    def _device_all_reduce(self, items, op, scratch):
        """Every rank's value through the host slots, reduced on this rank's device."""
        me, tl = self.host.rank, timeline.current()

        def combine(views):
            t0 = time.time()
            out = [self.device.combine(op, [a if r == me else v for r, v in enumerate(vs)])
                   for (_, a), vs in zip(items, views)]
            self.device.wait(out)          # copies done (the slots may change) and errors raised, before the vote
            if tl is not None:             # (synk.fork(timeline=...): where the adds happened shows)
                tl.span("adding on the device", "device", t0, time.time(),
                        {"bytes": sum(a.nbytes for _, a in items), "ranks": len(views[0]) if views else 0})
            return out
        return self.host.read_all(items, combine, "all_reduce", scratch=scratch,
                                  fill=lambda i, slot: self.device.read_into(items[i][1], slot))

    def reduce(self, items, op, root, in_place=True, fence=True):
        if self.n == 1 and in_place:
            return [a for _, a in items]
        res = self.host.reduce([(k, self._h(a)) for k, a in items], op, root, in_place=in_place, fence=True)
        if res is None:
            return None
        return self._d(res) if in_place else res      # a result not installed stays on the host

    def broadcast(self, items, root, fence=True):
        if self.n == 1:
            return self._d([a for _, a, _ in items])
        hitems = [(k, None if a is None else self._h(a), dt) for k, a, dt in items]
        return self._d(self.host.broadcast(hitems, root, fence=True))

    def all_gatherv(self, items, fence=True):
        return self._d(self.host.all_gatherv([(k, self._h(a)) for k, a in items], fence=True))

    def gatherv(self, items, root, fence=True):
        return self.host.gatherv([(k, self._h(a)) for k, a in items], root, fence=True)   # host copies

    def reduce_scatter(self, items, op, fence=True, counts=None, scratch=False):
        return self._d(self.host.reduce_scatter([(k, self._h(a)) for k, a in items], op, fence=True,
                                                counts=counts, scratch=scratch))

    def setup(self, n_keys, names=None):
        pass                     # (the host comm below is set up on its own)

    def shapes(self, shapes):
        return self.host.shapes(shapes)

    def barrier(self):
        self.host.barrier()

    def settle(self, committed):
        pass                     # (results are new device arrays; the host comm settles its own)

    def close(self):
        pass


def _device_reducible(op, dtype):
    """Whether the device reduces ``op`` of ``dtype`` as the host would: numeric values whose
    accumulator JAX has (64-bit ones only in JAX's x64 mode)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "fiu":
        return False
    if accumulator(op, dtype).itemsize <= 4 or dtype.itemsize == 8:
        return True
    import jax
    return bool(jax.config.jax_enable_x64)

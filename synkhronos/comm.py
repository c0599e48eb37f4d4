"""The comm plane: collectives that every rank calls, at the same point, on its local arrays.

Verbs (each takes a list of items, so that several arrays share one synchronisation):

=================  ==========================================================================
``all_reduce``     every rank gets the reduction (``reduce.OPS``) of all ranks' arrays
``reduce``         the root gets it; the others keep their arrays
``broadcast``      every rank gets the root's array
``all_gatherv``    every rank gets the concatenation (axis 0, rank order) of all arrays
``gatherv``        the root gets every rank's array, exactly as each rank holds it
``reduce_scatter`` rank r gets block r (axis 0: near-equal blocks, or ``counts[r]`` rows)
                   of the reduction
``shapes``         every rank learns every rank's shape of each item
``barrier``        all ranks meet
=================  ==========================================================================

An item is ``(key, array)``: ``key`` (an int every rank agrees on, e.g. a shared
variable's registry index) lets an implementation keep per-variable buffers between calls;
arrays may live on the host (numpy) or on a device.  Results are returned, never written
into the caller's array: they may be buffers the implementation owns, valid until the
next collective on the same key.  Unequal shapes where a verb needs equal ones raise
``ValueError`` on every rank alike; an array is changed on every rank or on none.

``fence=False`` promises that no rank touches the results before the command that called
the collective has ended on every rank (the command boundary is the fence), which saves
implementations a closing barrier.

Each call is served by the first implementation in a ``CommStack`` whose ``accepts``
takes the verb, dtype, op and placement: a backend adds its fast paths (MPI between hosts,
NCCL on GPUs) in front of general ones (shared memory, host-staged)."""


class Comm:
    """Interface of one comm implementation, bound to one rank."""

    name = "abstract"

    def accepts(self, verb, dtype, op=None, placement="host"):
        """Whether this implementation serves ``verb`` for ``dtype``/``op``/``placement``."""
        return False

    def setup(self, n_keys, names=None):
        """Called on every rank once the keys are known (at distribute); ``names``: key ->
        what to call it in messages."""

    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):
        """``scratch``: the results are intermediate values of a call (an in-graph op, a
        training step's gradient), so an implementation may skip the all-or-nothing vote (a
        failed call applies nothing).  ``owned``: the results must be arrays of the
        caller's own, never buffers the comm reuses (an in-graph op's values)."""
        raise NotImplementedError

    def reduce(self, items, op, root, outs=None, fence=True):
        """Returns the results on ``root`` (written into ``outs[i]`` where given), else None."""
        raise NotImplementedError

    def broadcast(self, items, root, fence=True):
        """``items``: ``(key, array, dtype)``; ``array`` matters on the root only."""
        raise NotImplementedError

    def all_gatherv(self, items, fence=True):
        raise NotImplementedError

    def gatherv(self, items, root):
        """Returns, on ``root``, a list per item of every rank's array (copies); else None."""
        raise NotImplementedError

    def reduce_scatter(self, items, op, fence=True, counts=None):
        """Rank r gets its block of rows of the reduction of each item (new arrays).
        ``counts``: None, or one entry per item: None (near-equal blocks, rows
        ``r*N//n`` to ``(r+1)*N//n``) or the rows of each rank (the same on every rank)."""
        raise NotImplementedError

    def shapes(self, shapes):
        """``shapes``: this rank's shape of each item; returns ``[[shape per rank] per item]``."""
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def close(self):
        pass


class CommStack:
    """Dispatches each verb to the first implementation that accepts it."""

    def __init__(self, impls):
        self.impls = list(impls)
        self._cache = {}

    def pick(self, verb, dtype=None, op=None, placement="host"):
        k = (verb, dtype, op, placement)
        impl = self._cache.get(k)
        if impl is None:
            for c in self.impls:
                if c.accepts(verb, dtype, op, placement):
                    impl = c
                    break
            else:
                raise TypeError(f"no collective implementation accepts {verb} of dtype {dtype} "
                                f"(op {op}, on {placement}); have {[c.name for c in self.impls]}")
            self._cache[k] = impl
        return impl

    def setup(self, n_keys, names=None):
        for c in self.impls:
            c.setup(n_keys, names)

    def barrier(self):
        self.impls[-1].barrier()

    def close(self):
        for c in self.impls:
            c.close()

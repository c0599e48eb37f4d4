"""A rank's comm implementations in order of preference: each verb goes to the first one
whose ``accepts`` takes it (the choice is cached per verb, dtype, op and placement)."""


class CommStack:
    """Dispatches each verb to the first implementation that accepts it."""

    def __init__(self, impls):
        self.impls = list(impls)
        self._cache = {}
        self.flight = None         # the rank's flight recorder (set by its Rank): each pick is recorded

    def pick(self, verb, dtype=None, op=None, placement="host", nbytes=0):
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
        if self.flight is not None:
            self.flight.collective(verb, nbytes, via=impl.name)
        return impl

    def find(self, name):
        """The implementation called ``name``, or None."""
        return next((c for c in self.impls if c.name == name), None)

    def record(self, verb, nbytes=0, via=None):
        """A collective that runs inside compiled code (no ``pick``), for the flight recorder."""
        if self.flight is not None:
            self.flight.collective(verb, nbytes, via=via)

    def setup(self, n_keys, names=None):
        for c in self.impls:
            c.setup(n_keys, names)

    def barrier(self):
        self.impls[-1].barrier()

    def settle(self, committed):
        """The command in progress ended: committed or dropped (``Comm.settle``)."""
        for c in self.impls:
            c.settle(committed)

    def close(self):
        for c in self.impls:
            c.close()

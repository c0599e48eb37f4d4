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

Each call is served by the first implementation in the rank's stack of comms
(``backends.stack.CommStack``) whose ``accepts`` takes the verb, dtype, op and placement:
the wiring (``synkhronos.backends``) puts fast paths (NCCL on GPUs) in front of general
ones (host-staged, shared memory).  Implementations: ``shm`` (``backends.shm.comm``),
``hier`` (``backends.mpi.comm``), ``staged`` and ``xla`` (``backends.jax``).

A verb an implementation's ``accepts`` refuses is never called on it (it may raise
``NotImplementedError``)."""


from typing import Any, Optional, Protocol, Sequence, runtime_checkable

VERBS = ("all_reduce", "reduce", "broadcast", "all_gatherv", "gatherv", "reduce_scatter", "shapes", "barrier")


@runtime_checkable
class Comm(Protocol):
    """One comm implementation, bound to one rank."""

    name: str                 # the registry name
    returns_new: tuple        # verbs whose results are new arrays (never buffers the comm reuses)

    def accepts(self, verb: str, dtype, op: Optional[str] = None, placement: str = "host") -> bool:
        """Whether this implementation serves ``verb`` for ``dtype``/``op``/``placement``."""

    def setup(self, n_keys: int, names: Optional[dict] = None) -> None:
        """Called on every rank once the keys are known (at distribute); ``names``: key ->
        what to call it in messages."""

    def all_reduce(self, items: Sequence, op: str, fence: bool = True, scratch: bool = False,
                   owned: bool = False) -> list:
        """Every rank gets the reduction of each item.  ``scratch``: the results are
        intermediate values of a call (an in-graph op, a training step's gradient), so an
        implementation may skip the all-or-nothing vote (a failed call applies nothing).
        ``owned``: the results must be arrays of the caller's own, never buffers the comm
        reuses (an in-graph op's values)."""

    def reduce(self, items: Sequence, op: str, root: int, in_place: bool = True, fence: bool = True) -> Optional[list]:
        """The root gets the reductions (``in_place``: into the buffers it may keep as its
        values; else into results of their own), the other ranks None."""

    def broadcast(self, items: Sequence, root: int, fence: bool = True) -> list:
        """``items``: ``(key, array, dtype)``; ``array`` matters on the root only.  Every
        rank gets the root's arrays."""

    def all_gatherv(self, items: Sequence, fence: bool = True) -> list:
        """Every rank gets the concatenation (axis 0, rank order) of every rank's array."""

    def gatherv(self, items: Sequence, root: int, fence: bool = True) -> Optional[list]:
        """The root gets, per item, the list of every rank's array (copies); others None."""

    def reduce_scatter(self, items: Sequence, op: str, fence: bool = True, counts: Optional[Sequence] = None,
                       scratch: bool = False) -> list:
        """Rank r gets its block of rows of the reduction of each item (new arrays).
        ``counts``: None, or one entry per item: None (near-equal blocks, rows
        ``r*N//n`` to ``(r+1)*N//n``) or the rows of each rank (the same on every rank).
        ``scratch``: as for ``all_reduce`` (the vote may be skipped)."""

    def shapes(self, shapes: Sequence) -> list:
        """``shapes``: this rank's shape of each item; returns ``[[shape per rank] per item]``."""

    def barrier(self) -> None:
        """All ranks meet."""

    def settle(self, committed: bool) -> None:
        """The command in progress ended on this rank: ``committed`` (the caller keeps the
        ``scratch`` results it was given), or not (it dropped them: a buffer they lie in
        may be written again, and one it kept before may not)."""

    def close(self) -> Any:
        """Free what this rank holds."""


@runtime_checkable
class ReadsAll(Protocol):
    """An optional capability of a host comm: every rank sees every rank's value (the
    host-staged path's device-side reduction uses it).  Implemented by ``shm``; a comm
    without it (``hier``: the other hosts' values are not in this host's memory) leaves
    the staged path reducing on the host."""

    def read_all(self, items: Sequence, use, what: str, scratch: bool = False, fill=None) -> Any:
        """Every rank publishes its whole value of each item (equal shapes checked: every
        rank raises alike), then ``use(views)`` runs on every rank, ``views[i][r]`` being
        rank r's value of item i (read-only, valid only inside ``use``); its result is
        returned once every rank's ``use`` succeeded (``scratch``: a meeting, no vote).
        ``fill(i, buffer)``: the caller writes its value of item i into the host buffer
        that the others read (no copy in between); the items then give shapes and dtypes."""

"""Collectives of device arrays through XLA's own multi-process collectives: NCCL between
GPUs, gloo on the CPU (where it is slower than shared memory: selected only by
``SYNK_JAX_COMM=xla``, e.g. to test this path without a GPU).

Every process (one per rank, all joined to ``jax.distributed`` by ``jax.device``) holds one
device; a 1-D mesh over the ranks' devices, in rank order, makes the ranks' arrays the
shards of one global array, and one jitted ``shard_map`` program per verb and signature
runs the collective (``psum``/``pmax``/``pmin``, ``all_gather``).  Serves ``all_reduce``
(sum, avg, max, min, prod), ``broadcast`` and ``all_gatherv`` of numeric dtypes; anything
else goes to the next implementation (host-staged).

Ranks first exchange their shapes through the host (unequal shapes raise ``ValueError`` on
every rank alike, before XLA is involved: XLA would hang on them), then run the program and
wait for it with the control plane's liveness checks (a lost peer can leave XLA waiting),
then vote: results are returned only when every rank succeeded."""
import functools

import numpy as np

from .held import Held
from .runtime import ensure, local
from .distributed import stop_distributed
from .transfers import is_device_array, run_ready, to_device, wait_ready
from ... import reductions as red
from ...errors import Aborted, MasterDied, StallTimeout
from ...launcher import RankGone
from ...signals import deferred

_KINDS = "fiu"          # floats, signed and unsigned ints (bool and complex: host-staged)


def uninterrupted(verb):
    """``verb`` whole in a signal window, from the ranks' meeting on their shapes to the
    end of its program: an interrupt after the meeting and before the dispatch would leave
    the other ranks inside XLA's collective, waiting for this one (on a CPU device XLA
    runs the program inside the dispatch, where nothing else is looked at).  The waits
    still watch for lost ranks; an interrupt lands when the verb ends."""
    @functools.wraps(verb)
    def whole(*args, **kwargs):
        with deferred():
            return verb(*args, **kwargs)
    return whole


class XlaComm:
    name = "xla"
    returns_new = ()
    verbs = ("all_reduce", "broadcast", "all_gatherv")

    def __init__(self, rank, n, master_rank, sync, host):
        self.rank, self.n, self.master_rank = rank, n, master_rank
        self.sync, self.host = sync, host
        self.names = {}
        self._mesh = None
        self._fns = {}
        self.broken = None         # why XLA's collectives cannot be trusted any more in this session

    def accepts(self, verb, dtype, op=None, placement="host"):
        if placement != "device" or verb not in self.verbs or dtype is None:
            return False
        if verb == "all_reduce" and op not in red.OPS:
            return False
        return serves(dtype, op if verb == "all_reduce" else None)

    def setup(self, n_keys, names=None):
        self.names = dict(names or {})

    # ---- machinery -----------------------------------------------------------------------------
    def mesh(self):
        """``(mesh, sharding)``: the ranks' devices as a one-axis mesh ``"r"`` in rank order,
        and the sharding of an array whose leading axis is split over it."""
        if self._mesh is None:
            import jax
            from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
            ensure()
            by_process = {}
            for d in jax.devices():
                by_process.setdefault(d.process_index, d)
            devs = [by_process[(r - self.master_rank) % self.n] for r in range(self.n)]
            mesh = Mesh(np.array(devs), ("r",))
            self._mesh = (mesh, NamedSharding(mesh, P("r")))
        return self._mesh

    def shard(self, x, new_axis=True):
        """This rank's array as its block of a global array split along axis 0 over the
        ranks: a new leading axis of length 1 (``new_axis``), else along ``x``'s own first
        axis (every rank's ``x`` has the same shape)."""
        import jax
        _, sharding = self.mesh()
        x = to_device(x)
        if new_axis:
            return jax.make_array_from_single_device_arrays((self.n,) + x.shape, sharding,
                                                            [x.reshape((1,) + x.shape)])
        return jax.make_array_from_single_device_arrays((self.n * x.shape[0],) + x.shape[1:], sharding, [x])

    def _program(self, key, body):
        fn = self._fns.get(key)
        if fn is None:
            import jax
            mapped = over_ranks(body, self.mesh()[0], key[1], len(key[2]), sharded_out=False)
            fn = self._fns[key] = Held(jax.jit(mapped))   # (a Ctrl-C in its dispatch lands as itself)
        return fn

    def execute(self, program, args):
        """Run ``program`` (a jitted program over the ranks' mesh, the same on every rank) on
        this rank's shards ``args`` and wait for it with the control plane's liveness checks
        (a lost peer can leave XLA waiting); its outputs.  When it fails on a rank, XLA's
        collectives are not trusted again in this session (other ranks may still wait in it)."""
        if self.broken:
            raise RuntimeError(f"synkhronos: an earlier XLA collective failed ({self.broken}) and may still be "
                               "pending on other ranks; close the session (synk.close()) and fork again")
        wait = lambda ready, sleep: self.sync.waiter.wait(ready, sleep, what="an XLA collective")  # noqa: E731
        try:
            if not local.gpu:        # (XLA's CPU client runs such a program inside its dispatch)
                return run_ready(lambda: program(*args), wait, self.sync.aborted)
            outs = program(*args)
            wait_ready(outs, wait, self.sync.aborted)
            return outs
        except (RankGone, MasterDied, StallTimeout):
            raise                    # the control plane's own ways out (the session ends)
        except Aborted:
            self.broken = "another rank failed during one"
            raise
        except Exception as e:       # this rank failed
            self.broken = f"{type(e).__name__} on rank {self.rank}"
            raise

    def _run(self, key, body, args, vote=True):
        """Run the program on every rank, wait for it, vote (unless the caller does:
        ``all_gatherv``, as with the host implementation); returns this rank's results
        (device arrays)."""
        if self.broken:
            self.execute(None, ())                     # (raises why)
        ok, err, outs = True, None, None
        try:
            outs = [o.addressable_data(0) for o in self.execute(self._program(key, body), args)]
        except (RankGone, MasterDied, StallTimeout, Aborted):
            raise
        except Exception as e:       # this rank failed: every rank keeps its values
            if not vote:
                raise
            ok, err = False, e
        if vote and not self.sync.vote(ok):
            self.broken = self.broken or "another rank failed during one"
            if err is not None:
                raise err
            raise Aborted("another rank failed during this collective")
        return outs

    def meet(self, shapes):
        """The ranks' meeting before a program: every rank's ``shapes`` (by position, by
        rank), and whether XLA's collectives are usable on every rank.  A rank whose earlier
        XLA collective failed (``broken``) must not leave the others alone inside the next
        program: it says so here, and no rank dispatches."""
        per = self.host.shapes(list(shapes) + [(int(self.broken is None),)])
        return per[:-1], all(s == (1,) for s in per[-1])

    def _shapes(self, arrays, shapes=None):
        per, usable = self.meet([tuple(np.shape(a)) for a in arrays] if shapes is None else shapes)
        if not usable:
            raise RuntimeError("synkhronos: an earlier XLA collective failed on a rank and may still be pending "
                               "on others; close the session (synk.close()) and fork again")
        return per

    def _equal_shapes(self, keys, per, what):
        for key, shapes in zip(keys, per):
            if len(set(shapes)) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"{what}{of} needs the same shape on every rank, got {shapes} (by rank)")

    # ---- verbs ---------------------------------------------------------------------------------
    @uninterrupted
    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):   # (device arrays: new)
        if self.n == 1:
            return [a for _, a in items]
        keys = [k for k, _ in items]
        arrays = [to_device(a) for _, a in items]
        self._equal_shapes(keys, self._shapes(arrays), "all_reduce")
        sig = tuple((a.shape, str(a.dtype)) for a in arrays)
        n = self.n

        def body(*xs):
            return tuple(reduced(x[0], op, n) for x in xs)
        return self._run(("all_reduce", len(arrays), sig, op), body, [self.shard(a) for a in arrays])

    @uninterrupted
    def broadcast(self, items, root, fence=True):
        """``items``: ``(key, array, dtype)``, the array given on the root only.  Exact bits:
        the root's value as unsigned integers, summed with zeros from the other ranks."""
        if self.n == 1:
            return [to_device(np.asarray(a, dtype=dt)) for _, a, dt in items]
        dtypes = [np.dtype(dt) for _, _, dt in items]
        if self.rank == root:
            arrays = [to_device(np.asarray(a, dtype=dt) if not is_device_array(a) else a)
                      for (_, a, _), dt in zip(items, dtypes)]
            shapes = self._shapes(arrays)
        else:
            shapes = self._shapes(None, [()] * len(items))
            arrays = None
        root_shapes = [s[root] for s in shapes]
        if arrays is None:
            arrays = [_zeros(shape, dt) for shape, dt in zip(root_shapes, dtypes)]
        sig = tuple((tuple(s), str(dt)) for s, dt in zip(root_shapes, dtypes))

        def body(*xs):
            return tuple(broadcasted(x[0], root) for x in xs)
        return self._run(("broadcast", len(arrays), sig, root), body, [self.shard(a) for a in arrays])

    @uninterrupted
    def all_gatherv(self, items, fence=True):
        """Every rank gets the concatenation along axis 0 (rank order): arrays are padded to
        the longest, gathered, and the padding dropped."""
        keys = [k for k, _ in items]
        arrays = [to_device(a) for _, a in items]
        if self.n == 1:
            for key, a in zip(keys, arrays):
                self._check_gather(key, [a.shape])
            return arrays
        per = self._shapes(arrays)
        for key, shapes in zip(keys, per):
            self._check_gather(key, shapes)
        longest = [max(s[0] for s in shapes) for shapes in per]
        padded = [_pad(a, m) for a, m in zip(arrays, longest)]
        sig = tuple((tuple(tuple(s) for s in shapes), str(a.dtype)) for shapes, a in zip(per, arrays))
        rows = [[s[0] for s in shapes] for shapes in per]

        def body(*xs):
            import jax
            import jax.numpy as jnp
            outs = []
            for x, r in zip(xs, rows):
                g = jax.lax.all_gather(x[0], "r")          # (n, longest, ...)
                outs.append(jnp.concatenate([g[i, :r[i]] for i in range(len(r))], axis=0))
            return tuple(outs)
        return self._run(("all_gatherv", len(arrays), sig), body, [self.shard(p) for p in padded], vote=False)

    def _check_gather(self, key, shapes):
        if len(shapes[0]) == 0 or len({s[1:] for s in shapes}) > 1:
            of = f" of {self.names[key]}" if key in self.names else ""
            raise ValueError(f"all_gather{of} concatenates along axis 0 and needs equal trailing shapes "
                             f"of at least 1 dimension; got {list(shapes)} (by rank)")

    def reduce(self, items, op, root, in_place=True, fence=True):
        raise NotImplementedError("the xla comm does not serve reduce (accepts() refuses it)")

    def gatherv(self, items, root, fence=True):
        raise NotImplementedError("the xla comm does not serve gatherv (accepts() refuses it)")

    def reduce_scatter(self, items, op, fence=True, counts=None, scratch=False):
        raise NotImplementedError("the xla comm does not serve reduce_scatter (accepts() refuses it)")

    def shapes(self, shapes):
        return self.host.shapes(shapes)

    def barrier(self):
        self.host.barrier()

    def settle(self, committed):
        pass                     # (results are new device arrays; the host comm settles its own)

    def close(self):
        stop_distributed()


# ---- programs over the ranks' mesh (also inside whole graphs: ``one_program``) -----------------

def over_ranks(body, mesh, n_in, n_out, sharded_out):
    """``body`` mapped over the mesh's axis ``"r"``: each input is split along its leading
    axis (one block per rank); each output too when ``sharded_out``, else replicated (the
    same on every rank by construction: XLA does not check it)."""
    from jax.sharding import PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:                        # JAX < 0.7
        from jax.experimental.shard_map import shard_map
    out = P("r") if sharded_out else P()
    specs = dict(mesh=mesh, in_specs=(P("r"),) * n_in, out_specs=(out,) * n_out)
    try:
        return shard_map(body, check_vma=False, **specs)
    except TypeError:                          # older JAX
        return shard_map(body, check_rep=False, **specs)


def reduced(x, op, n):
    """Inside a program over the ranks: the reduction ``op`` of every rank's ``x``, in
    ``x``'s dtype, accumulated as ``reductions`` does (``avg``: the sum over n, rounded for
    integers)."""
    import jax
    import jax.numpy as jnp
    dt = x.dtype
    acc = jnp.dtype(red.accumulator(op, np.dtype(dt)))
    y = x.astype(acc)
    if op in ("sum", "avg"):
        y = jax.lax.psum(y, "r")
    elif op == "max":
        y = jax.lax.pmax(y, "r")
    elif op == "min":
        y = jax.lax.pmin(y, "r")
    else:                                           # prod: no product all-reduce in XLA
        g = jax.lax.all_gather(y, "r")
        y = g[0]
        for i in range(1, n):
            y = y * g[i]
    if op == "avg":              # as reductions.finish
        if np.dtype(dt).kind in "iu":
            y = jnp.rint(y / jnp.asarray(n, acc))
        else:
            y = y * jnp.asarray(1.0 / n, acc)
    return y.astype(dt)


def broadcasted(x, root):
    """Inside a program over the ranks: the root's ``x``, bit for bit (its bits as unsigned
    integers, summed with zeros from the other ranks)."""
    import jax
    import jax.numpy as jnp
    dt = x.dtype
    bits = jnp.dtype(f"uint{8 * np.dtype(dt).itemsize}")
    u = jax.lax.bitcast_convert_type(x, bits)
    is_root = jax.lax.axis_index("r") == root
    u = jax.lax.psum(jnp.where(is_root, u, jnp.zeros_like(u)), "r")
    return jax.lax.bitcast_convert_type(u, dt)


def serves(dtype, op=None):
    """Whether XLA's collectives take values of ``dtype`` (and reduction ``op``): numeric,
    64-bit ones only in JAX's x64 mode (the accumulator of ``op`` too)."""
    dt = np.dtype(dtype)
    if dt.kind not in _KINDS or dt.itemsize > 8 or (dt.itemsize == 8 and not _x64()):
        return False          # (without JAX's x64 mode, 64-bit values are not 64-bit on the device)
    if op is not None:
        if op not in red.OPS:
            return False
        if red.accumulator(op, dt).itemsize == 8 and not _x64():
            return False      # the accumulator (float64 means of ints) needs JAX's x64 mode
    return True


def _x64():
    try:
        import jax
        return bool(jax.config.jax_enable_x64)
    except Exception:
        return False


_ZEROS = {}


def _zeros(shape, dtype):
    """A device array of zeros (cached: device arrays are immutable)."""
    key = (tuple(shape), str(dtype))
    z = _ZEROS.get(key)
    if z is None:
        import jax
        import jax.numpy as jnp
        ensure()
        z = _ZEROS[key] = jax.jit(lambda: jnp.zeros(key[0], key[1]))()    # made on the device
        if len(_ZEROS) > 64:
            _ZEROS.pop(next(iter(_ZEROS)))
    return z


def _pad(a, rows):
    if a.shape[0] == rows:
        return a
    import jax.numpy as jnp
    return jnp.concatenate([a, _zeros((rows - a.shape[0],) + tuple(a.shape[1:]), a.dtype)], axis=0)

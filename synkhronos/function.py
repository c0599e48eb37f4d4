"""``synk.function`` and ``synk.distribute``: PyTensor functions run data-parallel.

Each function is compiled once, in the master, into a variant that returns its outputs and
its update values (updates are applied by synkhronos, so that sliced calls can accumulate
them), plus, with ``sliceable_shareds``, a variant that reads those shared variables
through an index vector.  ``distribute()`` pickles all functions with their shared
variables in one go into the master's private mailbox; every worker rebuilds them.
A call validates everything in the master, sends one small command, computes the master's
own shard, and reduces the outputs that come back through shared memory."""
import pickle
import sys
import time
from collections import OrderedDict

import numpy as np

from . import scatter as sc
from .commands import worker_command
from .data import Data, condition
from .reduce import OUTPUT_MODES, check_mode, combine
from .runtime import get_runtime

# ------------------------------------------------------------------------------------------
# The part every rank holds


class Core:
    """Compiled variants and metadata of one function; pickled to every worker."""

    def __init__(self, fid, f, f_s, n_scatter, n_bcast, n_out, modes, update_vars, update_modes,
                 sliceable):
        self.fid, self.f, self.f_s, self.sliceable = fid, f, f_s, sliceable
        self.n_scatter, self.n_bcast, self.n_out = n_scatter, n_bcast, n_out
        self.modes, self.update_vars, self.update_modes = modes, update_vars, update_modes

    def shareds(self):
        out = list(self.update_vars)
        for fn in (self.f, self.f_s):
            if fn is not None:
                out.extend(fn.get_shared())
        return out

    def run(self, rank, arrays, plan, worker):
        """Compute this rank's share of a call.  Returns ``(outputs, rows)``, ``None`` if empty."""
        kind, bounds, base, idx, mbs, sel_s, num_slices, send = plan
        a, b = bounds[rank], bounds[rank + 1]
        ns = self.n_scatter
        scat, bcast = arrays[:ns], arrays[ns:]
        if kind == "index":
            pos = idx[a:b]
            scat = [x[a - base:b - base] if mb else np.take(x, pos, axis=0)
                    for x, mb in zip(scat, mbs)]
        elif ns:
            scat = [x[a - base:b - base] if mb else x[a:b] for x, mb in zip(scat, mbs)]
        sel = None if sel_s is None else sel_s[rank]
        rows = b - a if ns else None
        if self.f_s is not None and (sel is not None or num_slices > 1):
            local_len = self._sliceable_length()
            if sel is None:
                sel_idx = np.arange(local_len, dtype=np.int64)
            elif sel[0] == "range":
                if sel[2] > local_len:
                    raise IndexError(f"batch_s slice {sel[1]}:{sel[2]} is out of range for rank {rank}'s "
                                     f"sliceable shareds of length {local_len}")
                sel_idx = np.arange(sel[1], sel[2], dtype=np.int64)
            else:
                sel_idx = sel[1]
                if len(sel_idx) and sel_idx.max() >= local_len:
                    raise IndexError(f"batch_s index {sel_idx.max()} is out of range for rank {rank}'s "
                                     f"sliceable shareds of length {local_len}")
            if rows is not None and rows != len(sel_idx):
                raise ValueError(f"rank {rank}: scattered inputs give {rows} rows but batch_s selects "
                                 f"{len(sel_idx)} rows of the sliceable shareds; they must agree")
            rows = len(sel_idx)
        else:
            sel_idx = None
            if rows is None and self.sliceable:     # whole local sliceable shareds: weight by rows
                rows = self._sliceable_length()
        if rows == 0:
            return None
        if num_slices <= 1 or rows is None:
            outs = self._call(scat, bcast, sel_idx)
        else:
            outs = self._sliced(scat, bcast, sel_idx, rows, num_slices)
        n_out = self.n_out
        for var, val in zip(self.update_vars, outs[n_out:]):
            var.container.storage[0] = val
        res = outs[:n_out]
        if worker and send is not None:      # outputs the master will not use stay here
            res = [o if send[i] else None for i, o in enumerate(res)]
        return res, (1 if rows is None else rows)

    def _sliceable_length(self):
        lens = {len(v.container.storage[0]) for v in self.sliceable}
        if len(lens) > 1:
            raise ValueError(f"sliceable shareds have different lengths {sorted(lens)} in this rank; "
                             "give batch_s or make them equal")
        return lens.pop()

    def _call(self, scat, bcast, sel_idx):
        if sel_idx is None:
            return self.f(*scat, *bcast)
        return self.f_s(*scat, *bcast, sel_idx)

    def _sliced(self, scat, bcast, sel_idx, rows, num_slices):
        parts, weights = [], []
        for pa, pb in sc.pieces(rows, num_slices):
            s = [x[pa:pb] for x in scat]
            parts.append(self._call(s, bcast, None if sel_idx is None else sel_idx[pa:pb]))
            weights.append(pb - pa)
        modes = list(self.modes) + list(self.update_modes)
        out = []
        for i, mode in enumerate(modes):
            vals = [p[i] for p in parts]
            out.append(vals[-1] if mode is None else combine(mode, vals, weights))
        return out


# ------------------------------------------------------------------------------------------
# Master side


def _parse_outputs(outputs):
    """-> (variables, modes, return_list)."""
    if outputs is None:
        return [], [], True

    def one(o):
        if isinstance(o, tuple):
            if len(o) != 2 or not (o[1] is None or isinstance(o[1], str)):
                raise TypeError("output tuples must be (variable, reduce mode), e.g. (loss, 'sum'); "
                                f"got {o!r}")
            return o[0], check_mode(o[1], OUTPUT_MODES, "output reduce mode")
        return o, "avg"

    if isinstance(outputs, list):
        pairs = [one(o) for o in outputs]
        return [p[0] for p in pairs], [p[1] for p in pairs], True
    v, m = one(outputs)
    return [v], [m], False


def _parse_updates(updates):
    """-> list of (shared var, update expression, mode)."""
    if updates is None:
        return []
    if isinstance(updates, dict):
        return [(k, v, "avg") for k, v in updates.items()]
    if not isinstance(updates, (list, tuple)):
        raise TypeError("updates must be a list of (shared_var, new_value[, reduce mode]) tuples or a dict")
    out = []
    for u in updates:
        if not isinstance(u, tuple) or len(u) not in (2, 3):
            raise TypeError(f"updates must be (shared_var, new_value[, reduce mode]) tuples; got {u!r}")
        mode = check_mode(u[2], OUTPUT_MODES, "update reduce mode") if len(u) == 3 else "avg"
        if mode == "gather":
            raise ValueError("an update cannot use reduce mode 'gather'")
        out.append((u[0], u[1], mode))
    return out


def _as_list(x, what):
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"{what} must be a list of variables, got {type(x).__name__}")


class Function:
    """A data-parallel function: call it like a PyTensor function, with ``Data`` or arrays.

    Scattered ``inputs`` are split along axis 0 over all ranks; ``bcast_inputs`` are used
    whole by every rank; outputs are reduced by their mode; updates apply locally in every
    rank."""

    def __init__(self, rt, inputs, bcast_inputs, outputs, updates, givens, sliceable_shareds, kwargs):
        import pytensor
        from pytensor.compile.sharedvalue import SharedVariable
        self._rt = rt
        self._inputs = _as_list(inputs, "inputs")
        self._bcast = _as_list(bcast_inputs, "bcast_inputs")
        self._all_inputs = self._inputs + self._bcast
        out_vars, self._output_modes, self._return_list = _parse_outputs(outputs)
        ups = _parse_updates(updates)
        for i, (var, upd, mode) in enumerate(ups):
            if not isinstance(var, SharedVariable):
                raise TypeError(f"update targets must be shared variables, got {var!r}")
            try:   # the same check (and safe conversion) plain PyTensor applies to updates
                ups[i] = (var, var.type.filter_variable(upd, allow_convert=True), mode)
            except TypeError as e:
                raise TypeError(f"update of {var} must have the shared variable's type: {e}") from None
        self._update_modes = [m for _, _, m in ups]
        sliceable = _as_list(sliceable_shareds, "sliceable_shareds")
        for v in sliceable:
            if not isinstance(v, SharedVariable):
                raise TypeError(f"sliceable_shareds must be shared variables, got {v!r}")
            if v.ndim == 0:
                raise ValueError(f"sliceable shared {v} is 0-d and cannot be sliced")
        self._kwargs = dict(kwargs)
        self._allow_downcast = bool(kwargs.get("allow_input_downcast"))
        all_out = out_vars + [u for _, u, _ in ups]
        upd_vars = [v for v, _, _ in ups]
        for v in upd_vars:
            if not isinstance(v, SharedVariable):
                raise TypeError(f"update targets must be shared variables, got {v!r}")
        f = pytensor.function(self._all_inputs, all_out, givens=givens, **kwargs)
        shared_of_f = f.get_shared()
        missing = [v for v in sliceable if not any(v is s for s in shared_of_f)]
        if missing:
            raise ValueError(f"sliceable_shareds {missing} are not used by this function")
        f_s = None
        if sliceable:
            import pytensor.tensor as pt
            idx = pt.lvector("synk_batch_s_idx")
            g = OrderedDict()
            user_givens = list(givens.items()) if isinstance(givens, dict) else list(givens or [])
            for old, new in user_givens:
                g[old] = new[idx] if any(new is v for v in sliceable) else new
            for v in sliceable:
                if not any(new is v for _, new in user_givens) and v not in g:
                    g[v] = v[idx]
            f_s = pytensor.function(self._all_inputs + [idx], all_out, givens=list(g.items()), **kwargs)
        f.trust_input = True
        if f_s is not None:
            f_s.trust_input = True
        self._sliceable = sliceable
        self._updates_sliceable = False     # set by distribute()
        self._core = Core(len(rt.functions), f, f_s, len(self._inputs), len(self._bcast), len(out_vars),
                          self._output_modes, upd_vars, self._update_modes, sliceable)
        self._names = {v.name: i for i, v in enumerate(self._all_inputs) if v.name}
        self._staging = [None] * len(self._all_inputs)
        self._idx_stage = None
        self._warm = set()
        self._types = [(np.dtype(v.type.dtype), v.type.ndim, getattr(v.type, "shape", None))
                       for v in self._all_inputs]

    # ---- documented properties ---------------------------------------------------------
    name = property(lambda self: self._kwargs.get("name"), doc="as in PyTensor functions")
    output_modes = property(lambda self: list(self._output_modes), doc="reduce mode of each output")
    update_modes = property(lambda self: list(self._update_modes),
                            doc="how each update accumulates over slices")

    def get_shared(self):
        return self._core.f.get_shared()

    # ---- helpers -----------------------------------------------------------------------
    def _order(self, args, kwargs):
        n = len(self._all_inputs)
        vals = list(args) + [None] * (n - len(args))
        if len(args) > n:
            raise TypeError(f"this function takes {n} data inputs ({len(self._inputs)} scattered + "
                            f"{len(self._bcast)} broadcast), got {len(args)} positional")
        for k, v in kwargs.items():
            i = self._names.get(k)
            if i is None:
                raise TypeError(f"unknown input name {k!r}; inputs are named {list(self._names)}")
            if i < len(args) or vals[i] is not None:
                raise TypeError(f"input {k!r} given twice")
            vals[i] = v
        missing = [i for i, v in enumerate(vals) if v is None]
        if missing:
            raise TypeError(f"this function takes {n} data inputs, missing input(s) at position(s) {missing}")
        return vals

    def _to_data(self, i, value):
        dtype, ndim, static = self._types[i]
        if isinstance(value, Data):
            if value._rt_ref() is not self._rt:
                raise RuntimeError(f"input {i} is a Data of another (closed) synkhronos session")
            if value.dtype != dtype:
                raise TypeError(f"input {i} ({self._all_inputs[i]}): Data dtype {value.dtype} but the "
                                f"variable expects {dtype}")
            if value.ndim != ndim:
                raise TypeError(f"input {i} ({self._all_inputs[i]}): Data has {value.ndim} dims but the "
                                f"variable expects {ndim}")
            d = value
        else:
            arr = condition(value, dtype, ndim, force_cast=self._allow_downcast)
            d = self._staging[i]
            if d is None:
                d = self._staging[i] = Data(dtype, ndim, name=f"staging{i}", _rt=self._rt)
            d._reshape(arr.shape, 1.5 if arr.size > d.alloc_size else 1, keep=False)
            np.copyto(d.data, arr)
        if static is not None:
            shp = d.shape
            for ax, s in enumerate(static):
                if s is not None and (ax > 0 or i >= len(self._inputs)) and shp[ax] != s:
                    raise ValueError(f"input {i} ({self._all_inputs[i]}): shape {shp} does not match "
                                     f"the variable's static shape {static}")
        return d

    # ---- calling -----------------------------------------------------------------------
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1, **kwargs):
        """Run on all ranks and return the reduced outputs (see the user guide for selectors)."""
        with self._rt.lock:
            return self._call(args, kwargs, output_subset, batch, batch_s, num_slices)

    def _call(self, args, kwargs, output_subset, batch, batch_s, num_slices):
        rt = self._rt
        if rt.closed:
            raise RuntimeError("synkhronos is closed; this function belongs to a closed session")
        if not rt.distributed:
            raise RuntimeError("functions are not distributed yet: call synk.distribute() first")
        n = rt.n
        datas = [self._to_data(i, v) for i, v in enumerate(self._order(args, kwargs))]
        ns = len(self._inputs)
        scat = datas[:ns]
        if isinstance(num_slices, bool) or not isinstance(num_slices, (int, np.integer)) or num_slices < 1:
            raise ValueError(f"num_slices must be a positive integer, got {num_slices!r}")
        num_slices = int(num_slices)
        if num_slices > 1 and not ns and not self._sliceable:
            raise ValueError("num_slices > 1 but this function has nothing to slice "
                             "(no scattered inputs and no sliceable_shareds)")
        wanted = self._subset(output_subset)
        sel = sc.normalize_batch(batch)
        if sel is not None and not ns:
            raise ValueError("batch selects rows of scattered inputs, but this function has none "
                             "(use batch_s for sliceable shareds)")
        if batch_s is not None and not self._sliceable:
            raise ValueError("batch_s given but this function has no sliceable_shareds")
        sel_s = sc.normalize_batch_s(batch_s, n)
        mbs = [d.minibatch for d in scat]
        kind, idx, base = "range", None, 0
        idx_desc = None
        if ns:
            full = [len(d) if d.ndim else 1 for d, mb in zip(scat, mbs) if not mb]
            mb_len = [len(d) for d, mb in zip(scat, mbs) if mb]
            if any(d.ndim == 0 for d in scat):
                raise ValueError("scattered inputs must have at least 1 dimension (axis 0 is split)")
            if sel is None:
                lens = full + mb_len
                if len(set(lens)) > 1:
                    raise ValueError(f"scattered inputs have different lengths {lens}; without batch they "
                                     "must all be the same length")
                total = lens[0]
                bounds = sc.split(total, n)
            elif sel[0] == "range":
                _, start, stop = sel
                if full and stop > min(full):
                    raise IndexError(f"batch {start}:{stop} is out of range for inputs of length {min(full)}")
                total = stop - start
                base = start
                bounds = sc.split(total, n, start)
            else:
                idx = sel[1]
                total = len(idx)
                if full and total and idx.max() >= min(full):
                    raise IndexError(f"batch index {idx.max()} is out of range for inputs of length {min(full)}")
                kind = "index"
                bounds = sc.split(total, n)
                st = self._idx_stage
                if st is None:
                    st = self._idx_stage = Data(np.int64, 1, name="batch_idx", _rt=rt)
                st._reshape(idx.shape, 1.5 if idx.size > st.alloc_size else 1, keep=False)
                np.copyto(st.data, idx)
                idx_desc = st._desc()
            if mb_len and min(mb_len) < total:
                raise ValueError(f"minibatch inputs of lengths {mb_len} are shorter than the batch ({total} rows)")
        else:
            total = None
            bounds = (0,) * (n + 1)
        variant = "s" if (self._sliceable and (sel_s is not None or num_slices > 1)) else "f"
        if self._sliceable and (variant == "s" or ns):
            self._check_sliceable(sel_s, bounds if ns else None)
        descs = [d._desc() for d in datas]
        me = rt.rank
        arrays = [d.data for d in datas]
        idx_local = None if idx_desc is None else self._idx_stage.data
        core = self._core

        def local():
            return core.run(me, arrays, (kind, bounds, base, idx_local, mbs, sel_s, num_slices, None), False)

        master_first = variant not in self._warm and (total is None or bounds[me + 1] > bounds[me])
        send = self._send_mask(wanted, self._master_has_rows(ns, bounds, sel_s))
        wplan = (kind, bounds, base, idx_desc, mbs, sel_s, num_slices, send)
        mine, theirs = rt.execute("call", (core.fid, descs, wplan), local, master_first,
                                  what=f"call of function {self.name or core.fid}")
        self._warm.add(variant)
        if self._updates_sliceable:
            rt.sliceable_lengths.clear()
        return self._collect(mine, theirs, wanted, arrays, variant)

    def _check_sliceable(self, sel_s, bounds):
        """Check batch_s against every rank's sliceable-shared lengths, in the master.

        Workers' lengths change only through synkhronos commands, so they are cached and
        re-read (one round trip) after any command that may have changed them."""
        rt = self._rt
        vids = tuple(rt.shared_ids[id(v)] for v in self._sliceable)
        lens = rt.sliceable_lengths.get(vids)
        if lens is None:
            from .collectives import get_shapes
            shapes = get_shapes(list(self._sliceable))
            lens = rt.sliceable_lengths[vids] = [[s[r][0] for s in shapes] for r in range(rt.n)]
        lens = [list(l) for l in lens]
        lens[rt.rank] = [len(v.container.storage[0]) for v in self._sliceable]   # master may set_value locally
        for r in range(rt.n):
            sel = None if sel_s is None else sel_s[r]
            if sel is None and len(set(lens[r])) > 1:
                raise ValueError(f"sliceable shareds have different lengths {lens[r]} on rank {r}; "
                                 "pass batch_s or make them equal")
            top = min(lens[r])
            if sel is not None and sc.sel_max(sel) > top:
                raise IndexError(f"batch_s selects row {sc.sel_max(sel) - 1} on rank {r}, but its sliceable "
                                 f"shareds have only {top} rows")
            if bounds is not None:
                rows = bounds[r + 1] - bounds[r]
                srows = top if sel is None else sc.sel_length(sel, top)
                if rows != srows:
                    raise ValueError(f"rank {r}: the scattered inputs give {rows} rows but the sliceable "
                                     f"shareds give {srows}; their per-rank lengths must agree "
                                     "(use batch / batch_s to select matching rows)")

    def _run_empty(self, arrays, variant):
        """Every shard is empty: compute once on the empty input, as serial PyTensor would
        (updates are not applied)."""
        ns = self._core.n_scatter
        scat = [x[:0] for x in arrays[:ns]]
        if variant == "s":
            outs = self._core.f_s(*scat, *arrays[ns:], np.zeros(0, np.int64))
        else:
            outs = self._core.f(*scat, *arrays[ns:])
        return outs[:self._core.n_out], 0

    def _subset(self, output_subset):
        if output_subset is None:
            return None
        n_out = self._core.n_out
        if not isinstance(output_subset, (list, tuple)) or not all(sc._is_int(i) for i in output_subset):
            raise TypeError(f"output_subset must be a list of output indices (ints), got {output_subset!r}")
        if len(set(output_subset)) != len(output_subset):
            raise ValueError(f"output_subset has repeated entries: {output_subset}")
        for i in output_subset:
            if not 0 <= i < n_out:
                raise IndexError(f"output_subset entry {i} is out of range for {n_out} outputs")
        self._subset_order = [int(i) for i in output_subset]
        return tuple(i in set(output_subset) for i in range(n_out))

    def _master_has_rows(self, ns, bounds, sel_s):
        me = self._rt.rank
        if ns:
            return bounds[me + 1] > bounds[me]
        if self._sliceable:
            if sel_s is not None:
                return sc.sel_length(sel_s[me], 0) > 0
            return self._core._sliceable_length() > 0
        return True

    def _send_mask(self, wanted, master_has_rows):
        """Which outputs workers send back: the requested ones, except mode None outputs
        (the master's own result) unless the master has no rows."""
        mask = tuple((wanted is None or wanted[i]) and (m is not None or not master_has_rows)
                     for i, m in enumerate(self._output_modes))
        return None if all(mask) else mask

    def _collect(self, mine, theirs, wanted, arrays, variant):
        rt = self._rt
        results = dict(theirs)
        results[rt.rank] = mine
        order = [r for r in range(rt.n) if results.get(r) is not None]
        if not order:           # no rank had rows: compute once on empty input, as serial would
            results[rt.rank] = self._run_empty(arrays, variant)
            order = [rt.rank]
        n_out = self._core.n_out
        idxs = range(n_out) if wanted is None else self._subset_order
        outs = []
        for i in idxs:
            mode = self._output_modes[i]
            if mode is None:
                src = rt.rank if results.get(rt.rank) is not None else order[0]
                outs.append(np.array(results[src][0][i], copy=True))
                continue
            parts = [results[r][0][i] for r in order]
            weights = [results[r][1] for r in order]
            outs.append(combine(mode, parts, weights))
        if self._return_list or wanted is not None:
            return outs
        return outs[0] if outs else []

    # ---- master-only conveniences --------------------------------------------------------
    def as_theano(self, *args, **kwargs):
        """Call the function in the master only, as plain PyTensor (updates apply in the master)."""
        vals = self._order(args, kwargs)
        f = self._core.f
        f.trust_input = False
        try:
            outs = f(*vals)
        finally:
            f.trust_input = True
        n_out = self._core.n_out
        for var, val in zip(self._core.update_vars, outs[n_out:]):
            var.container.storage[0] = val
        outs = outs[:n_out]
        if self._return_list:
            return outs
        return outs[0] if outs else []

    def build_inputs(self, *args, force_cast=False, oversize=1., minibatch=False, **kwargs):
        """``synk.data`` for each input, given values as if calling the function."""
        from .data import data
        vals = self._order(args, kwargs)
        mbs = minibatch if isinstance(minibatch, (list, tuple)) else [minibatch] * len(vals)
        if len(mbs) != len(vals):
            raise ValueError(f"minibatch list needs {len(vals)} entries, got {len(mbs)}")
        ds = tuple(data(value=v, var=var, minibatch=mb, force_cast=force_cast, oversize=oversize)
                   for v, var, mb in zip(vals, self._all_inputs, mbs))
        return ds[0] if len(ds) == 1 else ds


def function(inputs, outputs=None, bcast_inputs=None, updates=None, givens=None,
             sliceable_shareds=None, **kwargs):
    """Replacement for ``theano.function``: see ``Function``.  Call before ``distribute()``.

    Outputs may be ``(var, mode)`` with mode in avg (default), sum, prod, max, min, gather,
    None; updates may be ``(var, new, mode)`` triples (the mode accumulates over slices)."""
    rt = get_runtime()
    if rt.distributed:
        raise RuntimeError("cannot make new functions after synk.distribute() (functions are "
                           "replicated once)")
    f = Function(rt, inputs, bcast_inputs, outputs, updates, givens, sliceable_shareds, kwargs)
    rt.functions.append(f)
    return f


def _graph_items(cores):
    """Every variable and node of the compiled graphs in topological order.  Pickled ahead of
    the functions, so that each node finds its inputs already pickled: the pickler's
    recursion stays shallow however deep the graph (ResNet-50), instead of following one
    owner -> inputs -> owner chain to the bottom."""
    items = []
    for c in cores:
        for fn in (c.f, c.f_s):
            if fn is not None:
                fg = fn.maker.fgraph
                items.extend(fg.inputs)
                for node in fg.toposort():
                    items.append(node)
                    items.extend(node.outputs)
    return items


def distribute():
    """Replicate every function and its shared variables in all workers (once)."""
    rt = get_runtime()
    if rt.distributed:
        raise RuntimeError("synk.distribute() was already called (it can be called once)")
    t0 = time.perf_counter()
    cores = [f._core for f in rt.functions]
    shareds, seen = [], set()
    for c in cores:
        for v in c.shareds():
            if id(v) not in seen:
                seen.add(id(v))
                shareds.append(v)
    print("Synkhronos distributing functions...", flush=True)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 50000))
    try:
        payload = pickle.dumps((_graph_items(cores), cores, shareds), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise TypeError(f"synk.distribute() could not pickle the functions for the workers: {e!r}. "
                        "Every op and shared value must be picklable (ops defined in __main__ "
                        "must be importable by the workers: put them in a module).") from e
    finally:
        sys.setrecursionlimit(old)
    slc = {id(v) for f in rt.functions for v in f._sliceable}
    for f in rt.functions:
        f._updates_sliceable = any(id(u) in slc for u in f._core.update_vars)
    rt.shareds = shareds
    rt.shared_ids = {id(v): i for i, v in enumerate(shareds)}
    from .collectives import master_env
    master_env(rt)          # creates the slot table the workers attach to
    rt.execute("distribute", (payload,), what="distribute")
    rt.distributed = True
    print(f"...distribution complete ({time.perf_counter() - t0:.1f} s).", flush=True)


# ------------------------------------------------------------------------------------------
# Worker side


@worker_command("distribute")
def _w_distribute(ctx, payload):
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 50000))
    _, cores, shareds = pickle.loads(payload)
    for c in cores:
        c.f.trust_input = True
        if c.f_s is not None:
            c.f_s.trust_input = True
    ctx.functions, ctx.shareds = cores, shareds
    from .collectives import worker_env
    ctx.coll_env = worker_env(ctx)
    return None


@worker_command("call")
def _w_call(ctx, fid, descs, plan):
    core = ctx.functions[fid]
    arrays = [ctx.view(d) for d in descs]
    kind, bounds, base, idx_desc, mbs, sel_s, num_slices, send = plan
    idx = None if idx_desc is None else ctx.view(idx_desc)
    return core.run(ctx.rank, arrays, (kind, bounds, base, idx, mbs, sel_s, num_slices, send), True)

"""``synk.function`` and ``synk.distribute``: PyTensor functions run data-parallel.

A function is compiled once, in the master, for the session's device (``replica``).
``distribute()`` pickles all functions with their shared variables in one go; every worker
rebuilds them.  A call goes through five steps, all but "run" in the master:

* validate: arguments, selectors and shapes, before any worker is involved;
* stage: numpy inputs are copied where the ranks can read them (``Data``);
* plan: which rows each rank takes (a ``CallPlan``);
* run: one command; every rank computes its share, the master its own meanwhile;
* collect: outputs reduced by their modes; updates committed on every rank only if every
  rank succeeded."""
import pickle
import sys
import time

import numpy as np

from . import shards, timeline
from .commands import worker_command
from .data import Data, array_ref, condition, owner, plan_key, resize
from .errors import BadArgument, OutOfRange
from .function_args import (as_list, check_collective_rows, check_collectives, parse_outputs, parse_updates,
                            sliced_givens)
from .plans import CallPlan, Rows, arrays_from_wire, arrays_to_wire, call_from_wire, call_needs, call_to_wire
from .progress import busy
from .reductions import combine
from .replica import Replica, follow_up, graph_items, solo_follow_ups
from .session import get_session

# ---- building ----------------------------------------------------------------------------


class Function:
    """A data-parallel function: call it like a PyTensor function, with ``Data`` or arrays.

    Scattered ``inputs`` are split along axis 0 over all ranks; ``bcast_inputs`` are used
    whole by every rank; outputs are reduced by their mode; updates apply in every rank
    (on all ranks or, if any rank fails, on none)."""

    def __init__(self, session, inputs, bcast_inputs, outputs, updates, givens, sliceable_shareds, kwargs,
                 sharded_shareds=None):
        from pytensor.compile.sharedvalue import SharedVariable
        self._session = session
        self._inputs = as_list(inputs, "inputs")
        self._bcast = as_list(bcast_inputs, "bcast_inputs")
        both = [v for v in self._bcast if any(v is i for i in self._inputs)]
        if both:
            raise ValueError(f"{', '.join(map(str, both))} is in both inputs and bcast_inputs: list each input "
                             "once (inputs are split over the ranks, bcast_inputs given whole to every rank; "
                             "a call takes the inputs, then the bcast_inputs)")
        self._all_inputs = self._inputs + self._bcast
        out_vars, self._output_modes, self._return_list = parse_outputs(outputs)
        ups = parse_updates(updates)
        self._update_modes = [m for _, _, m in ups]
        sliceable = as_list(sliceable_shareds, "sliceable_shareds")
        for v in sliceable:
            if not isinstance(v, SharedVariable):
                raise TypeError(f"sliceable_shareds must be shared variables, got {v!r}")
            if v.ndim == 0:
                raise ValueError(f"sliceable shared {v} is 0-d and cannot be sliced")
        self._kwargs = dict(kwargs)
        self._allow_downcast = bool(kwargs.get("allow_input_downcast"))
        all_out = out_vars + [u for _, u, _ in ups]
        device = session.device
        self._collective = check_collectives(all_out, givens, kwargs.get("mode"), device)
        f = device.compile(self._all_inputs, all_out, givens=givens, **kwargs)
        shared_of_f = f.get_shared()
        missing = [v for v in sliceable if not any(v is s for s in shared_of_f)]
        if missing:
            raise ValueError(f"sliceable_shareds {missing} are not used by this function")
        self._sharded = as_list(sharded_shareds, "sharded_shareds")
        bad = [v for v in self._sharded if not any(v is s for s in shared_of_f) or v.ndim == 0]
        if bad:
            raise ValueError(f"sharded_shareds {bad} must be shared variables of at least 1 dimension "
                             "that this function uses")
        f_s = None
        if sliceable:
            import pytensor.tensor as pt
            idx = pt.lvector("synk_batch_s_idx")
            f_s = device.compile(self._all_inputs + [idx], all_out, givens=sliced_givens(givens, sliceable, idx),
                                 **kwargs)
        if self._collective:      # rewrites may have removed them: then no constraint
            from .ops import uses_collectives
            self._collective = any(uses_collectives(fn.maker.fgraph.outputs) for fn in (f, f_s) if fn is not None)
        self._sliceable = sliceable
        self._updates_sliceable = False     # set by distribute()
        self._replica = Replica(len(session.functions), f, f_s, len(self._inputs), len(self._bcast), len(out_vars),
                                self._output_modes, [v for v, _, _ in ups], self._update_modes, sliceable)
        self._names = {v.name: i for i, v in enumerate(self._all_inputs) if v.name}
        self._staging = [None] * len(self._all_inputs)
        self._idx_stage = None
        self._plan_cache = None
        self._args_cache = None
        self._warm = set()
        self._types = [(np.dtype(v.type.dtype), v.type.ndim, getattr(v.type, "shape", None))
                       for v in self._all_inputs]

    # ---- documented properties -----------------------------------------------------------
    name = property(lambda self: self._kwargs.get("name"), doc="as in PyTensor functions")
    output_modes = property(lambda self: list(self._output_modes), doc="reduce mode of each output")
    sliceable_shareds = property(lambda self: list(self._sliceable),
                                 doc="the shared variables ``batch_s`` selects rows of (data shards)")
    sharded_shareds = property(lambda self: list(self._sliceable) + list(self._sharded),
                               doc="the shared variables whose rows are split over the ranks (the "
                                   "sliceable ones and those declared sharded): checkpoints store "
                                   "them whole and split them again")
    update_modes = property(lambda self: list(self._update_modes),
                            doc="how each update accumulates over slices")

    def get_shared(self):
        return self._replica.f.get_shared()

    def _what(self, i):
        return f"input {i} ({self._all_inputs[i]})"

    # ---- validate --------------------------------------------------------------------------
    def _order(self, args, kwargs):
        n = len(self._all_inputs)
        if not kwargs and len(args) == n:
            for a in args:
                if a is None:
                    break
            else:
                return args
        vals = list(args) + [None] * (n - len(args))
        if len(args) > n:
            raise TypeError(f"this function takes {n} data inputs ({len(self._inputs)} scattered + "
                            f"{len(self._bcast)} broadcast), got {len(args)} positional")
        for k, v in kwargs.items():
            i = self._names.get(k)
            if i is None:
                raise BadArgument(f"unknown input name {k!r}; inputs are named {list(self._names)}")
            if i < len(args) or vals[i] is not None:
                raise BadArgument(f"input {k!r} given twice")
            vals[i] = v
        missing = [i for i, v in enumerate(vals) if v is None]
        if missing:
            raise TypeError(f"this function takes {n} data inputs, missing input(s) at position(s) {missing}")
        return vals

    def _check_data(self, i, d):
        dtype, ndim, _ = self._types[i]
        if owner(d) is not self._session:
            raise RuntimeError(f"{self._what(i)} is a Data of another (closed) synkhronos session")
        if d.dtype != dtype:
            raise TypeError(f"{self._what(i)}: Data dtype {d.dtype} but the variable expects {dtype}")
        if d.ndim != ndim:
            raise TypeError(f"{self._what(i)}: Data has {d.ndim} dims but the variable expects {ndim}")

    def _check_static(self, i, shape):
        static = self._types[i][2]
        if static is None:
            return
        for ax, s in enumerate(static):
            if s is not None and (ax > 0 or i >= len(self._inputs)) and shape[ax] != s:
                raise ValueError(f"{self._what(i)}: shape {shape} does not match the variable's static "
                                 f"shape {static}")

    def _convert(self, i, value):
        """A numpy input as an array of the variable's dtype and ndim (not yet staged)."""
        dtype, ndim, _ = self._types[i]
        try:
            return condition(value, dtype, ndim, force_cast=self._allow_downcast)
        except TypeError as e:
            raise TypeError(f"{self._what(i)}: {e}") from None

    # ---- stage ------------------------------------------------------------------------------
    def _stage(self, i, value):
        """``value`` as a Data the ranks can read: a Data as it is, an array copied into this
        input's reusable staging Data."""
        if isinstance(value, Data):
            return value
        d = self._staging[i]
        if d is None:
            d = self._staging[i] = Data(value.dtype, value.ndim, name=f"staging{i}",
                                        _session=self._session, _scratch=True)
        resize(d, value.shape, 1.5 if value.size > d.alloc_size else 1, keep=False)
        np.copyto(d.data, value)
        return d

    def _stage_index(self, idx):
        st = self._idx_stage
        if st is None:
            st = self._idx_stage = Data(np.int64, 1, name="batch_idx", _session=self._session, _scratch=True)
        resize(st, idx.shape, 1.5 if idx.size > st.alloc_size else 1, keep=False)
        np.copyto(st.data, idx)
        return st

    # ---- calling -----------------------------------------------------------------------------
    def __call__(self, *args, output_subset=None, batch=None, batch_s=None, num_slices=1, **kwargs):
        """Run on all ranks and return the reduced outputs (see the user guide for selectors)."""
        return self._invoke(args, kwargs, output_subset, batch, batch_s, num_slices)

    def _invoke(self, args, kwargs, output_subset, batch, batch_s, num_slices, then=()):
        """A call; ``then``: steps every rank chains in the same command (``replica.follow_up``)."""
        session = self._session
        if session.closed:
            raise RuntimeError("synkhronos is closed; this function belongs to a closed session")
        with session.api(require_distributed=True):
            values, num_slices, wanted, sel, sel_s = self._validate(args, kwargs, output_subset, batch, batch_s,
                                                                     num_slices)
            solo = self._solo(values, then, sel, sel_s, num_slices == 1 and wanted is None)
            if solo:                # one rank, nothing to split: the function itself (one GPU's path)
                outs = self._replica.solo(session.device, *solo)
                return outs if self._return_list else (outs[0] if outs else [])
            datas = [self._stage(i, v) for i, v in enumerate(values)]
            plan, wire, total, idx_local = self._plan(datas, sel, sel_s, num_slices, wanted)
            try:
                mine, theirs, arrays = self._run(plan, wire, datas, total, idx_local, then)
                outs = self._collect(mine, theirs, wanted, arrays, plan)
                session.commit()
            except BaseException:       # not committed: what the call set ahead here goes back now
                session.me.drop()
                raise
            if self._updates_sliceable:
                session.lengths.clear()
            return outs

    def _solo(self, values, then, sel, sel_s, whole):
        """How a one-rank session makes this call itself (``Replica.solo``): its arrays (with
        ``batch``, the rows the rank would take), rows, follow-up replicas (``then``) and
        ``batch_s`` index (or None); None when it cannot: cold variant, an output subset or
        slices (``whole``: neither), in-graph collective, command in flight, debug or timeline,
        an extension's follow-up, sliceable shareds with scattered inputs, no rows.  ``batch``
        (``sel``) is checked here as a call plan checks it."""
        session = self._session
        variant = "s" if self._sliceable and sel_s is not None else "f"
        if (not whole or session.n != 1 or self._collective or variant not in self._warm or session.debug
                or session.inflight is not None or session.timeline_path is not None
                or (self._sliceable and self._inputs) or (sel_s is not None and not self._sliceable)):
            return None
        follow = solo_follow_ups(session.me, then) if then else ()
        arrays, ns = [v.data if isinstance(v, Data) else v for v in values], len(self._inputs)
        if self._sliceable:
            rows = shards.check_sliceable(self._sliceable_lengths(), sel_s, None)[0]
            idx = None if sel_s is None else self._replica.selection(sel_s[0], 0, session.device)
        elif sel is not None:
            mbs = [isinstance(v, Data) and v.minibatch for v in values[:ns]]
            rows, idx = shards.batch_rows([len(v) for v, mb in zip(values, mbs) if not mb],
                                          [len(v) for v, mb in zip(values, mbs) if mb], sel), None
            index = sel[1] if sel[0] == "index" else None
            taken = Rows("range", sel[1:], sel[1]) if index is None else Rows("index", (0, rows))
            arrays = [shards.take_rows(a, taken, 0, mb, index) for a, mb in zip(arrays, mbs)] + arrays[ns:]
        else:
            lens = {len(v) for v in values[:ns]}
            rows, idx = (lens.pop() if len(lens) == 1 else 0) if lens else 1, None
        return (arrays, rows, follow, idx) if rows and follow is not None else None

    def _validate(self, args, kwargs, output_subset, batch, batch_s, num_slices):
        values = []
        ns = len(self._inputs)
        for i, v in enumerate(self._order(args, kwargs)):
            if isinstance(v, Data):
                self._check_data(i, v)
            else:
                v = self._convert(i, v)
            self._check_static(i, v.shape)
            if i < ns and v.ndim == 0:
                raise ValueError("scattered inputs must have at least 1 dimension (axis 0 is split)")
            values.append(v)
        if (type(num_slices) is int and num_slices == 1 and output_subset is None and batch is None
                and batch_s is None):
            return values, 1, None, None, None        # (the commonest call: nothing more to check)
        if isinstance(num_slices, bool) or not isinstance(num_slices, (int, np.integer)) or num_slices < 1:
            raise ValueError(f"num_slices must be a positive integer, got {num_slices!r}")
        num_slices = int(num_slices)
        if num_slices > 1 and not ns and not self._sliceable:
            raise ValueError("num_slices > 1 but this function has nothing to slice "
                             "(no scattered inputs and no sliceable_shareds)")
        wanted = self._subset(output_subset)
        sel = shards.normalize_batch(batch)
        if sel is not None and not ns:
            raise ValueError("batch selects rows of scattered inputs, but this function has none "
                             "(use batch_s for sliceable shareds)")
        if batch_s is not None and not self._sliceable:
            raise BadArgument("batch_s given but this function has no sliceable_shareds")
        sel_s = shards.normalize_batch_s(batch_s, self._session.n)
        return values, num_slices, wanted, sel, sel_s

    def _plan(self, datas, sel, sel_s, num_slices, wanted):
        """-> (CallPlan, its wire form, total rows or None, the master's index array or None).

        A call like the previous one (same inputs in the same buffers with the same shapes,
        no selectors) reuses its plan: nothing in it can have changed."""
        key = None
        if sel is None and sel_s is None and not self._sliceable and not self._collective:
            key = (tuple(plan_key(d) for d in datas), num_slices, None if wanted is None else tuple(wanted))
            cached = self._plan_cache
            if cached is not None and cached[0] == key:
                return cached[1]
        made = self._make_plan(datas, sel, sel_s, num_slices, wanted)
        if key is not None:
            self._plan_cache = (key, made)
        return made

    def _make_plan(self, datas, sel, sel_s, num_slices, wanted):
        session = self._session
        n, ns = session.n, len(self._inputs)
        scat = datas[:ns]
        mbs = tuple(d.minibatch for d in scat)
        kind, base, idx_ref, idx_local, total = "range", 0, None, None, None
        if ns:
            full = [len(d) for d, mb in zip(scat, mbs) if not mb]
            mb_len = [len(d) for d, mb in zip(scat, mbs) if mb]
            if sel is None:
                lens = full + mb_len
                if len(set(lens)) > 1:
                    raise ValueError(f"scattered inputs have different lengths {lens}; without batch they "
                                     "must all be the same length")
                total = lens[0]
                bounds = shards.split(total, n)
            else:
                total = shards.batch_rows(full, mb_len, sel)
                if sel[0] == "range":
                    base = sel[1]
                    bounds = shards.split(total, n, base)
                else:
                    kind = "index"
                    bounds = shards.split(total, n)
                    st = self._stage_index(sel[1])
                    idx_ref, idx_local = array_ref(st), st.data
        else:
            bounds = (0,) * (n + 1)
        if self._sliceable and (sel_s is not None or num_slices > 1 or ns or self._collective):
            rows_of = shards.check_sliceable(self._sliceable_lengths(), sel_s, bounds if ns else None)
            if self._collective and not ns:
                check_collective_rows(rows_of, num_slices)
        if self._collective and ns:
            check_collective_rows([bounds[r + 1] - bounds[r] for r in range(n)], num_slices)
        send = self._send_mask(wanted, self._master_has_rows(ns, bounds, sel_s))
        plan = CallPlan(self._replica.fid, tuple(array_ref(d) for d in datas), Rows(kind, bounds, base, idx_ref, mbs),
                        sel_s, num_slices, send)
        return plan, call_to_wire(plan), total, idx_local

    def _variant(self, plan):
        return "s" if (self._sliceable and (plan.sel_s is not None or plan.num_slices > 1)) else "f"

    def _run(self, plan, wire, datas, total, idx_local, then=()):
        session = self._session
        me = session.me
        my_rank = session.rank
        arrays = [d.data for d in datas]
        ns = len(self._inputs)
        replica = self._replica

        def local():
            scat = [shards.take_rows(a, plan.rows, my_rank, mb, idx_local)
                    for a, mb in zip(arrays[:ns], plan.rows.minibatch)]
            return replica.run(me, scat, arrays[ns:], plan)

        variant = self._variant(plan)
        bounds = plan.rows.bounds
        master_first = variant not in self._warm and (total is None or bounds[my_rank + 1] > bounds[my_rank])
        if self._collective:     # in-graph collectives meet the other ranks: all start together
            master_first = False
        what = f"call of function {self.name or replica.fid}"
        cached = self._args_cache          # the same arguments object while nothing changes:
        if cached is None or cached[0] is not wire or cached[1] is not then:   # (control.send)
            cached = self._args_cache = (wire, then, (wire, then) if then else (wire,))
        args = cached[2]
        after = (lambda: follow_up(me, then)) if then else None     # they meet the other ranks
        needs = lambda: call_needs(plan, ns)  # noqa: E731
        if variant in self._warm:
            mine, theirs = session.execute("call", args, local, master_first, what=what, needs=needs, after=after)
        else:                    # the first call compiles (numba JIT: up to a minute): say so
            t0 = time.time()
            with busy(f"synkhronos: first {what}: compiling (JIT) or loading it from the cache"):
                mine, theirs = session.execute("call", args, local, master_first, what=what, patient=True,
                                          needs=needs, after=after)
            timeline.compile_span(f"{self.name or replica.fid} (first call: compile or cache load)", t0, time.time())
        self._warm.add(variant)
        return mine, theirs, arrays

    def _sliceable_lengths(self):
        """Every rank's lengths of the sliceable shareds (the master's as they are now)."""
        session = self._session
        key = tuple(session.shared_ids[id(v)] for v in self._sliceable)
        lens = session.lengths.get(key)
        if lens is None:
            from .collectives import shapes_of
            shapes = shapes_of(session, list(key))
            lens = [[s[r][0] for s in shapes] for r in range(session.n)]
            session.lengths.put(key, lens)
        lens = [list(per) for per in lens]
        lens[session.rank] = [len(session.device.get(v)) for v in self._sliceable]   # master may set_value locally
        return lens

    def _subset(self, output_subset):
        if output_subset is None:
            return None
        n_out = self._replica.n_out
        if not isinstance(output_subset, (list, tuple)) or not all(shards.is_int(i) for i in output_subset):
            raise TypeError(f"output_subset must be a list of output indices (ints), got {output_subset!r}")
        if len(set(output_subset)) != len(output_subset):
            raise ValueError(f"output_subset has repeated entries: {output_subset}")
        for i in output_subset:
            if not 0 <= i < n_out:
                raise OutOfRange(f"output_subset entry {i} is out of range for {n_out} outputs")
        return [int(i) for i in output_subset]

    def _master_has_rows(self, ns, bounds, sel_s):
        my_rank = self._session.rank
        if ns:
            return bounds[my_rank + 1] > bounds[my_rank]
        if self._sliceable:
            if sel_s is not None:
                return shards.sel_length(sel_s[my_rank], 0) > 0
            return self._replica.sliceable_length(self._session.device) > 0
        return True

    def _send_mask(self, wanted, master_has_rows):
        """Which outputs workers send back: the requested ones, except mode None outputs
        (the master's own result) unless the master has no rows."""
        chosen = None if wanted is None else set(wanted)
        mask = tuple((chosen is None or i in chosen) and (m is not None or not master_has_rows)
                     for i, m in enumerate(self._output_modes))
        return None if all(mask) else mask

    # ---- collect -----------------------------------------------------------------------------
    def _collect(self, mine, theirs, wanted, arrays, plan):
        session = self._session
        results = {r: None if rep is None else (arrays_from_wire(rep[0]), rep[1]) for r, rep in theirs.items()}
        results[session.rank] = mine
        order = [r for r in range(session.n) if results.get(r) is not None]
        if not order:           # no rank had rows: compute once on empty input, as serial would
            ns = len(self._inputs)
            results[session.rank] = self._replica.run_empty(arrays[:ns], arrays[ns:], self._variant(plan))
            order = [session.rank]
        idxs = range(self._replica.n_out) if wanted is None else wanted
        outs = []
        for i in idxs:
            mode = self._output_modes[i]
            if mode is None:
                src = session.rank if results.get(session.rank) is not None else order[0]
                outs.append(np.array(results[src][0][i], copy=True))
                continue
            outs.append(combine(mode, [results[r][0][i] for r in order], [results[r][1] for r in order]))
        if self._return_list or wanted is not None:
            return outs
        return outs[0] if outs else []

    # ---- master-only conveniences --------------------------------------------------------------
    def as_theano(self, *args, output_subset=None, **kwargs):
        """Call the function in the master only, as plain PyTensor (updates apply in the
        master).  ``output_subset`` as for a call."""
        wanted = self._subset(output_subset)
        vals = self._order(args, kwargs)
        f = self._replica.f
        f.trust_input = False
        try:
            outs = f(*vals)
        finally:
            f.trust_input = True
        n_out = self._replica.n_out
        for var, val in zip(self._replica.update_vars, outs[n_out:]):
            self._session.device.set(var, val)
        outs = outs[:n_out]
        if wanted is not None:
            return [outs[i] for i in wanted]
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
             sliceable_shareds=None, sharded_shareds=None, **kwargs):
    """Replacement for ``theano.function``: see ``Function``.  Call before ``distribute()``.

    ``sharded_shareds``: variables holding a block of rows per rank (sharded optimizer state):
    ``distribute()`` splits the master's whole value as ``synk.scatter``; checkpoints too.

    Outputs may be ``(var, mode)`` with mode in avg (default), sum, prod, max, min, gather,
    None; updates may be ``(var, new, mode)`` triples (the mode accumulates over slices)."""
    session = get_session()
    if session.distributed:
        raise RuntimeError("cannot make new functions after synk.distribute(): functions are replicated "
                           "once. Build every function before calling synk.distribute() (or call "
                           "synk.close() and synk.fork() to start a new session).")
    with session.api():
        f = Function(session, inputs, bcast_inputs, outputs, updates, givens, sliceable_shareds, kwargs,
                     sharded_shareds)
        session.functions.append(f)
        return f


# ---- what the training kit and the exchange strategies use (``synkhronos.extensions``) ----


def replica_of(f):
    """The ``Replica`` every rank holds of function ``f`` (its ``fid`` names it in steps)."""
    return f._replica


def compiled(f):
    """Whether ``f`` has been called (compiled) once already."""
    return bool(f._warm)


def call_then(f, data, kwargs, output_subset, batch, batch_s, num_slices, then):
    """Call ``f`` as ``f(*data, **kwargs)`` would, with follow-up steps ``then`` that every
    rank runs in the same command after its share (``replica.follow_up``)."""
    return f._invoke(data, kwargs, output_subset, batch, batch_s, num_slices, then)


def distribute(random_streams="per_rank"):
    """Replicate every function and its shared variables in all workers (once).
    Random generators (``RandomType`` shared variables): with ``random_streams="per_rank"``
    every rank draws its own stream (the master's keeps the generator's; see
    ``synkhronos.random_state``), with ``"same"`` every rank draws the master's numbers."""
    session = get_session()
    if session.distributed:
        raise RuntimeError("synk.distribute() was already called (it can be called once)")
    if random_streams not in ("per_rank", "same"):
        raise ValueError(f"random_streams must be 'per_rank' or 'same', got {random_streams!r}")
    with session.api():
        t0 = time.perf_counter()
        replicas = [f._replica for f in session.functions]
        shareds = list({id(v): v for c in replicas for v in c.shareds()}.values())   # first seen first
        print("Synkhronos distributing functions...", flush=True)
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 50000))
        try:
            payload = pickle.dumps((graph_items(replicas), replicas, shareds), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"synk.distribute() could not pickle the functions for the workers: {e!r}. "
                            "Every op and shared value must be picklable (ops defined in __main__ "
                            "must be importable by the workers: put them in a module).") from e
        finally:
            sys.setrecursionlimit(old)
        slc = {id(v) for f in session.functions for v in f._sliceable}
        for f in session.functions:
            f._updates_sliceable = any(id(u) in slc for u in f._replica.update_vars)
        me = session.me
        me.shareds = shareds
        me.replicas = replicas
        session.shared_ids = {id(v): i for i, v in enumerate(shareds)}
        n_keys, names = _keys(shareds)
        me.comm.setup(n_keys, names)   # before the workers attach to what it creates
        session.execute("distribute", (payload, n_keys), what="distribute", patient=True)
        session.distributed = True
    sharded = list({id(v): v for f in session.functions for v in f._sharded}.values())
    if sharded:             # each rank its block of what the master held whole
        from . import collectives
        collectives.scatter(sharded, [session.device.get(v) for v in sharded])
    if random_streams == "per_rank":
        from . import random_state
        random_state.spread(session)
    print(f"...distribution complete ({time.perf_counter() - t0:.1f} s).", flush=True)


def _keys(shareds):
    """The comm plane's number of keys and their names: the shared variables', then those
    of in-graph collectives (``synkhronos.ops`` needs PyTensor, which a session that made
    functions has imported anyway)."""
    from .ops import RESERVED_KEYS, reserved_names
    return len(shareds) + RESERVED_KEYS, {i: str(v) for i, v in enumerate(shareds)} | reserved_names(len(shareds))


# ---- every worker ------------------------------------------------------------------------


@worker_command("distribute")
def _w_distribute(me, payload, n_keys):
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 50000))
    _, replicas, shareds = pickle.loads(payload)
    for c in replicas:
        c.adopt(me.device)
    me.replicas, me.shareds = replicas, shareds
    me.comm.setup(*_keys(shareds))
    return None


@worker_command("call")
def _w_call(me, wire, then=()):
    # the last plan of each function, with its inputs: views of the master's buffers, valid
    # for as long as the buffers are (no batch index: its rows would be gathered copies)
    cached = me.call_cache.get(wire[0])
    if cached is not None and cached[0] == wire:
        _, plan, scat, bcast = cached
    else:
        plan = call_from_wire(wire)
        scat, bcast = me.inputs(plan.inputs, me.replicas[plan.fid].n_scatter, plan.rows)
        if plan.rows.kind == "range" and plan.sel_s is None:
            me.call_cache[plan.fid] = (wire, plan, scat, bcast)
    res = me.replicas[plan.fid].run(me, scat, bcast, plan)
    if then:
        follow_up(me, then)
    return None if res is None else (arrays_to_wire(res[0]), res[1])

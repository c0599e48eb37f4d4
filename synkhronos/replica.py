"""What every rank holds of one ``synk.function``, and how it computes its share of a call.

A replica has the function compiled into a variant that returns its outputs and its
update values (updates are applied by synkhronos, so that sliced calls can accumulate them
and a failed call applies none), plus, with ``sliceable_shareds``, a variant that reads
those shared variables through an index vector.  A rank computes on its rows, keeps its
new update values pending (``Rank.hold``) and returns its outputs with its row count."""
import functools

import numpy as np

from . import shards
from .errors import OutOfRange
from .reductions import combine
from .signals import deferred, restore_interrupt


class Replica:
    """Compiled variants and metadata of one function; pickled to every worker."""

    def __init__(self, fid, f, f_s, n_scatter, n_bcast, n_out, modes, update_vars, update_modes, sliceable):
        self.fid, self.f, self.f_s, self.sliceable = fid, f, f_s, sliceable
        self.n_scatter, self.n_bcast, self.n_out = n_scatter, n_bcast, n_out
        self.modes, self.update_vars, self.update_modes = modes, update_vars, update_modes
        # the update variables of mode "share": a rank's share of the batch's mean (``run``)
        self.shares = tuple(v for v, m in zip(update_vars, update_modes) if m == "share")

    def shareds(self):
        out = list(self.update_vars)
        for fn in (self.f, self.f_s):
            if fn is not None:
                out.extend(fn.get_shared())
        return out

    def adopt(self, device):
        """Prepare the compiled variants of an unpickled replica for ``device``."""
        self.f = device.adopt(self.f)
        if self.f_s is not None:
            self.f_s = device.adopt(self.f_s)

    def sliceable_length(self, device):
        lens = {len(device.get(v)) for v in self.sliceable}
        if len(lens) > 1:
            raise ValueError(f"sliceable shareds have different lengths {sorted(lens)} in this rank; "
                             "give batch_s or make them equal")
        return lens.pop()

    def run(self, me, scat, bcast, plan):
        """Compute rank ``me.rank``'s share from its rows ``scat`` of the scattered inputs and
        the broadcast inputs ``bcast``.  Returns ``(outputs, rows)``, or None without rows."""
        rank, device = me.rank, me.device
        ns = self.n_scatter
        rows = plan.rows.bounds[rank + 1] - plan.rows.bounds[rank] if ns else None
        sel = None if plan.sel_s is None else plan.sel_s[rank]
        num_slices = plan.num_slices
        if self.f_s is not None and (sel is not None or num_slices > 1):
            sel_idx = self.selection(sel, rank, device)
            if rows is not None and rows != len(sel_idx):
                raise ValueError(f"rank {rank}: scattered inputs give {rows} rows but batch_s selects "
                                 f"{len(sel_idx)} rows of the sliceable shareds; they must agree")
            rows = len(sel_idx)
        else:
            sel_idx = None
            if rows is None and self.sliceable:     # whole local sliceable shareds: weight by rows
                rows = self.sliceable_length(device)
        if rows == 0:
            if self.shares:             # no rows, no share of the batch's mean
                with deferred():        # (as a device's product below)
                    zeros = {var: _zeros(device, var) for var in self.shares}
                me.hold(me.seq, zeros)
            return None
        def compute():
            if num_slices <= 1 or rows is None:     # every input to the device at once (rows: this rank's)
                moved = device.call_inputs(list(scat) + list(bcast) + ([] if sel_idx is None else [sel_idx]))
                k = len(scat)
                return self._call(moved[:k], moved[k:k + len(bcast)], None if sel_idx is None else moved[-1])
            return self._sliced(scat, device.call_inputs(bcast), sel_idx, rows, num_slices, device)
        outs = self._computed(compute, device, rank, list(scat) + list(bcast))
        n_out = self.n_out
        news = outs[n_out:]
        if self.update_vars:
            scale = self._share_scale(me.n, plan, rows) if self.shares else 1.0
            if scale != 1.0:      # (a device's first product of a shape compiles: an interrupt waits)
                with deferred():
                    news = [v * v.dtype.type(scale) if m == "share" else v for v, m in zip(news, self.update_modes)]
            me.hold(me.seq, dict(zip(self.update_vars, news)))
        res = [device.to_host(o) for o in outs[:n_out]]
        if not me.is_master and plan.send is not None:      # outputs the master will not use
            res = [o if plan.send[i] else None for i, o in enumerate(res)]
        return res, (1 if rows is None else rows)

    @staticmethod
    def _share_scale(n, plan, rows):
        """What a ``"share"`` update value of a rank with ``rows`` of the call's rows is
        multiplied by: ``n * rows / (rows of every rank)``, so that the mean over the ranks
        (a training step's all-reduce) weighs each rank by its rows, as the mean over the
        whole batch does; 1 where the other ranks' rows are not known here (each rank's
        own whole sliceable shareds)."""
        if rows is None:
            return 1.0
        if plan.sel_s is not None and any(sel is not None for sel in plan.sel_s):
            if any(sel is None for sel in plan.sel_s):
                return 1.0
            total = sum(sel[2] - sel[1] if sel[0] == "range" else len(sel[1]) for sel in plan.sel_s)
        else:
            bounds = plan.rows.bounds
            total = bounds[-1] - bounds[0]
        return n * rows / total if total else 1.0

    def solo(self, device, arrays, rows, then=(), sel_idx=None):
        """The whole call of a one-rank session, on ``arrays`` (its inputs as they are, no
        staging, no command): the compiled function, the outputs combined as for a rank's
        share of ``rows`` rows, then, once every output is in hand, the updates (at once:
        a Ctrl-C lands before or after them).  ``then``: replicas of functions without
        inputs run after it on its new values (a training step's update rule: the
        all-reduce between them is the value itself on one rank); all or nothing.  The
        fast path of one GPU: with outputs it waits for them only, as a plain call reads
        them (the updates come from the same program, done with them).
        ``sel_idx``: the rows of the sliceable shareds (``batch_s``)."""
        n_out = self.n_out
        if sel_idx is None:
            run = lambda: self._call(device.call_inputs(arrays), (), None)     # noqa: E731
        else:
            run = lambda: self._call(*_split(device.call_inputs(list(arrays) + [sel_idx])))     # noqa: E731
        if then:
            return self._followed(device, run, arrays, rows, then)
        outs = self._computed(run, device, 0, arrays, n_wait=n_out or None)
        res = [combine(m, [device.to_host(o)], [rows]) for m, o in zip(self.modes, outs[:n_out])]
        with deferred():
            for var, value in zip(self.update_vars, outs[n_out:]):
                device.set(var, value)
        return res

    def _followed(self, device, run, arrays, rows, then):
        """``solo`` with follow-ups: ``run()`` (this function) dispatched, its new values
        set, each replica of ``then`` dispatched on them, all of it waited for once (the
        follow-ups depend on the call's values: no wait is needed between them, as a plain
        call of the two functions has none), then the follow-ups' new values set.  Until
        those are set, a failure (an error of the device, an interrupt) puts the values
        before the call back and raises."""
        n_out = self.n_out
        olds = [(var, device.get(var)) for var in self.update_vars]
        later, done = [], False

        def compute():
            outs = run()
            with deferred():
                for var, value in zip(self.update_vars, outs[n_out:]):
                    device.set(var, value)
            pending = list(outs)
            for rep in then:
                fo = rep._call(device.call_inputs([]), (), None)
                later.extend(zip(rep.update_vars, fo[rep.n_out:]))
                pending.extend(fo)
            return pending
        try:
            outs = self._computed(compute, device, 0, arrays)
            res = [combine(m, [device.to_host(o)], [rows]) for m, o in zip(self.modes, outs[:n_out])]
            with deferred():
                for var, value in later:
                    device.set(var, value)
                done = True
        except BaseException:
            if not done:
                with deferred():
                    for var, value in olds:
                        device.set(var, value)
            raise
        return res

    def run_empty(self, scat, bcast, variant):
        """Every shard is empty: compute once on the empty input, as serial PyTensor would
        (updates are not applied)."""
        scat = [x[:0] for x in scat]
        sel = np.zeros(0, np.int64) if variant == "s" else None
        return self._call(scat, bcast, sel)[:self.n_out], 0

    def selection(self, sel, rank, device):
        """The index vector of ``batch_s`` selector ``sel`` (None: every row) into this
        rank's sliceable shareds."""
        local_len = self.sliceable_length(device)
        if sel is None:
            return np.arange(local_len, dtype=np.int64)
        if sel[0] == "range":
            if sel[2] > local_len:
                raise OutOfRange(f"batch_s slice {sel[1]}:{sel[2]} is out of range for rank {rank}'s "
                                 f"sliceable shareds of length {local_len}")
            return np.arange(sel[1], sel[2], dtype=np.int64)
        idx = sel[1]
        if len(idx) and idx.max() >= local_len:
            raise OutOfRange(f"batch_s index {idx.max()} is out of range for rank {rank}'s "
                             f"sliceable shareds of length {local_len}")
        return idx

    def _computed(self, compute, device, rank, inputs, n_wait=None):
        """``compute()``'s values, ready on the device (the first ``n_wait`` of them, when
        given; its first ``n_out`` are outputs, read next); its failure as the device
        explains it (e.g. out of device memory, naming the rank and the inputs' sizes)."""
        try:
            outs = compute()
            device.wait(outs if n_wait is None else outs[:n_wait], reads=self.n_out)
            return outs
        except Exception as e:
            better = device.explain(e, rank, f"function {self.fid}", inputs)
            if better is None:
                raise
            raise better from e

    def _call(self, scat, bcast, sel_idx):
        try:
            if sel_idx is None:
                return self.f(*scat, *bcast)
            return self.f_s(*scat, *bcast, sel_idx)
        except SystemError as e:         # a Ctrl-C inside compiled code: keep it an interrupt
            restore_interrupt(e)
            raise

    def _sliced(self, scat, bcast, sel_idx, rows, num_slices, device):
        parts, weights = [], []
        for pa, pb in shards.pieces(rows, num_slices):
            s = device.call_inputs([x[pa:pb] for x in scat] + ([] if sel_idx is None else [sel_idx[pa:pb]]))
            parts.append(self._call(s[:len(scat)], bcast, None if sel_idx is None else s[-1]))
            weights.append(pb - pa)
        out = []
        for i, mode in enumerate(self.modes):             # outputs: combined on the host
            vals = [device.to_host(p[i]) for p in parts]
            out.append(vals[-1] if mode is None else combine(mode, vals, weights))
        for i, mode in enumerate(self.update_modes, self.n_out):    # new values: on the device
            vals = [p[i] for p in parts]
            out.append(vals[-1] if mode is None else device.combine("avg" if mode == "share" else mode, vals, weights))
        return out


def _zeros(device, var):
    """Zeros shaped as ``var``'s value on ``device``."""
    value = device.get(var)
    return device.to_device(np.zeros(np.shape(value), value.dtype))


@functools.lru_cache(maxsize=None)
def _no_input_plan(n):
    from .plans import CallPlan, Rows
    return CallPlan(-1, (), Rows("range", (0,) * (n + 1)), None, 1, None)


def _split(moved):
    """A solo call's moved inputs and index as ``_call``'s arguments."""
    return moved[:-1], (), moved[-1]


def solo_follow_ups(me, steps):
    """The replicas a one-rank call runs after its function for follow-up ``steps``
    (``follow_up``; ``Replica.solo``): an all-reduce of one rank is the value itself;
    None when a step needs the command path (an extension's step)."""
    reps = []
    for step in steps:
        if step[0] == "run":
            reps.append(me.replicas[step[1]])
        elif step[0] != "all_reduce":
            return None
    return reps


def follow_up(me, steps):
    """What a call chains in the same command on every rank, after the function's share:
    ``("all_reduce", var index, op)`` of a variable's new value (its pending update), then
    ``("run", function id)`` of a function without inputs, and ``("ext", name, *args)``:
    the function an extension registered as command ``name`` (``commands.handler``),
    called with ``(me, *args)``.  A training step is then one round trip: gradient,
    all-reduce, update rule.  Updates stay pending until the master commits (every rank
    succeeded), so the step is all-or-nothing."""
    for step in steps:
        if step[0] == "all_reduce":
            _, vid, op = step
            var = me.shareds[vid]
            value = me.pending_value(var)
            comm = me.comm.pick("all_reduce", var.type.dtype, op, me.device.placement)
            if me.device.placement == "host":
                value = np.asarray(value)
            # scratch: no vote of its own (nothing of the step applies before the master's
            # commit, once every rank succeeded), so a master waiting here stays interruptible
            [res] = comm.all_reduce([(vid, value)], op, fence=True, scratch=True)
            me.set_ahead(var, res)             # the next step reads it
        elif step[0] == "run":
            me.replicas[step[1]].run(me, [], [], _no_input_plan(me.n))
        elif step[0] == "ext":              # an extension's step: ("ext", command name, *args)
            from .commands import handler
            handler(step[1])(me, *step[2:])
        else:
            raise ValueError(f"unknown follow-up step {step!r}")


def graph_items(replicas):
    """Every variable and node of the compiled graphs in topological order.  Pickled ahead of
    the functions, so that each node finds its inputs already pickled: the pickler's
    recursion stays shallow however deep the graph (ResNet-50), instead of following one
    owner -> inputs -> owner chain to the bottom."""
    items = []
    for c in replicas:
        for fn in (c.f, c.f_s):
            if fn is not None:
                fg = fn.maker.fgraph
                items.extend(fg.inputs)
                for node in fg.toposort():
                    items.append(node)
                    items.extend(node.outputs)
    return items

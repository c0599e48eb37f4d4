"""The collectives on shared variables as every rank runs them (master included).

Each reads its variables' values from the device, calls the comm plane and installs the
results.  A change that must happen on every rank or on none is installed only after the
comm plane's vote (or a vote here), and in the master with signals held until the command
ends, so Ctrl-C cannot land between deciding and applying."""
import numpy as np

from . import shards
from .commands import worker_command

MAXD = 16


def value(ctx, var):
    """A shared variable's value on this rank, on the host, in the variable's dtype."""
    live = ctx.device.to_host(ctx.device.get(var))
    dtype = getattr(var.type, "numpy_dtype", None) or np.dtype(var.type.dtype)
    if live.dtype != dtype:
        tmp = np.empty(live.shape, dtype)
        np.copyto(tmp, live, casting="same_kind")
        live = tmp
    if live.ndim > MAXD:
        raise ValueError(f"collectives support up to {MAXD} dimensions, got {live.ndim}")
    return live


def _items(ctx, vids):
    return [(vid, ctx.device.get(ctx.shareds[vid])) if ctx.device.placement != "host"
            else (vid, value(ctx, ctx.shareds[vid])) for vid in vids]


def _impl(ctx, verb, vids, op=None):
    if len(vids) == 1:
        return ctx.comm.pick(verb, ctx.shareds[vids[0]].type.dtype, op, ctx.device.placement)
    impls = {ctx.comm.pick(verb, ctx.shareds[v].type.dtype, op, ctx.device.placement) for v in vids}
    if len(impls) > 1:
        raise TypeError(f"{verb} of variables of different dtypes served by different implementations; "
                        "call it once per dtype")
    return impls.pop()


def _install(ctx, vids, results):
    for vid, res in zip(vids, results):
        ctx.device.set(ctx.shareds[vid], res)


def check_static(var, shape, what):
    static = getattr(var.type, "shape", None)
    if static is None:
        return
    for ax, s in enumerate(static):
        if s is not None and shape[ax] != s:
            raise ValueError(f"{what}: {var} has static shape {static}, which a value of shape "
                             f"{tuple(shape)} does not fit")


def all_reduce(ctx, vids, op):
    comm = _impl(ctx, "all_reduce", vids, op)
    _install(ctx, vids, comm.all_reduce(_items(ctx, vids), op, fence=False))


def reduce(ctx, vids, op, in_place):
    comm = _impl(ctx, "reduce", vids, op)
    res = comm.reduce(_items(ctx, vids), op, ctx.master_rank, in_place=in_place, fence=False)
    if res is None:
        return None
    if in_place:
        _install(ctx, vids, res)
        return None
    return [ctx.device.to_host(r) for r in res]     # read once the command has ended (no fence)


def broadcast(ctx, vids, values=None):
    """``values`` (master only): arrays to broadcast instead of the master's values."""
    comm = _impl(ctx, "broadcast", vids)
    if ctx.is_master:
        arrs = [value(ctx, ctx.shareds[v]) if values is None else values[i] for i, v in enumerate(vids)]
    else:
        arrs = [None] * len(vids)
    items = [(vid, a, ctx.shareds[vid].type.dtype) for vid, a in zip(vids, arrs)]
    _install(ctx, vids, comm.broadcast(items, ctx.master_rank, fence=False))


def gather(ctx, vids):
    comm = _impl(ctx, "gatherv", vids)
    return comm.gatherv(_items(ctx, vids), ctx.master_rank, fence=False)


def all_gather(ctx, vids):
    comm = _impl(ctx, "all_gatherv", vids)
    results = comm.all_gatherv(_items(ctx, vids), fence=False)
    for vid, res in zip(vids, results):
        check_static(ctx.shareds[vid], res.shape, "all_gather")
    _vote_install(ctx, vids, results)


def _vote_install(ctx, vids, results):
    from .errors import Aborted
    results = [ctx.device.to_device(r) for r in results]
    if not ctx.control.vote(True, on_commit=lambda: _install(ctx, vids, results)):
        raise Aborted("another rank failed during this collective")


def scatter(ctx, vids, plan):
    """Every rank takes its rows of each value (``plans.ScatterPlan``)."""
    parts = []
    for ref, rows in zip(plan.values, plan.rows):
        index = None if rows.index is None else ctx.view(rows.index)
        parts.append(np.array(shards.take_rows(ctx.view(ref), rows, ctx.rank, False, index), copy=True))
    _vote_install(ctx, vids, parts)


def set_value(ctx, vids, plan):
    """Rank ``plan.rank`` takes the values (``plans.SetValuePlan``)."""
    if ctx.rank != plan.rank:
        return
    sel = plan.select
    index = None if sel is None or sel[0] != "index" else ctx.view(sel[1])
    for vid, ref in zip(vids, plan.values):
        src = shards.select(ctx.view(ref), sel, index)
        ctx.device.set(ctx.shareds[vid], ctx.device.to_device(np.array(src, copy=True)))


def get_value(ctx, vids, rank):
    if ctx.rank != rank:
        return None
    return [np.array(value(ctx, ctx.shareds[v]), copy=True) for v in vids]


def shapes(ctx, vids):
    return [tuple(np.shape(ctx.device.get(ctx.shareds[v]))) for v in vids]


OPS = {"all_reduce": all_reduce, "reduce": reduce, "broadcast": broadcast, "gather": gather,
       "all_gather": all_gather, "scatter": scatter, "set_value": set_value, "get_value": get_value,
       "shapes": shapes}


@worker_command("coll")
def _w_coll(ctx, op, vids, args):
    return OPS[op](ctx, vids, *args)

"""The collectives on shared variables as every rank runs them (master included).

Each reads its variables' values from the device, calls the comm plane and installs the
results.  A change that must happen on every rank or on none is installed only after the
comm plane's vote (or a vote here), and in the master with signals held until the command
ends, so Ctrl-C cannot land between deciding and applying."""
import numpy as np

from . import shards
from .commands import worker_command

MAXD = 16


def value(me, var):
    """A shared variable's value on this rank, on the host, in the variable's dtype."""
    live = me.device.to_host(me.device.get(var))
    dtype = getattr(var.type, "numpy_dtype", None) or np.dtype(var.type.dtype)
    if live.dtype != dtype:
        tmp = np.empty(live.shape, dtype)
        np.copyto(tmp, live, casting="same_kind")
        live = tmp
    if live.ndim > MAXD:
        raise ValueError(f"collectives support up to {MAXD} dimensions, got {live.ndim}")
    return live


def _items(me, vids):
    return [(vid, me.device.get(me.shareds[vid])) if me.device.placement != "host"
            else (vid, value(me, me.shareds[vid])) for vid in vids]


def _impl(me, verb, vids, op=None):
    get = me.device.get
    nbytes = sum(getattr(get(me.shareds[v]), "nbytes", 0) for v in vids)     # (for the flight recorder)
    if len(vids) == 1:
        return me.comm.pick(verb, me.shareds[vids[0]].type.dtype, op, me.device.placement, nbytes)
    impls = {me.comm.pick(verb, me.shareds[v].type.dtype, op, me.device.placement, nbytes) for v in vids}
    if len(impls) > 1:
        raise TypeError(f"{verb} of variables of different dtypes served by different implementations; "
                        "call it once per dtype")
    return impls.pop()


def _install(me, vids, results):
    for vid, res in zip(vids, results):
        me.device.set(me.shareds[vid], res)


def check_static(var, shape, what):
    static = getattr(var.type, "shape", None)
    if static is None:
        return
    for ax, s in enumerate(static):
        if s is not None and shape[ax] != s:
            raise ValueError(f"{what}: {var} has static shape {static}, which a value of shape "
                             f"{tuple(shape)} does not fit")


def all_reduce(me, vids, op):
    comm = _impl(me, "all_reduce", vids, op)
    _install(me, vids, comm.all_reduce(_items(me, vids), op, fence=False))


def reduce(me, vids, op, in_place):
    comm = _impl(me, "reduce", vids, op)
    res = comm.reduce(_items(me, vids), op, me.master_rank, in_place=in_place, fence=False)
    if res is None:
        return None
    if in_place:
        _install(me, vids, res)
        return None
    return [me.device.to_host(r) for r in res]     # read once the command has ended (no fence)


def broadcast(me, vids, values=None):
    """``values`` (master only): arrays to broadcast instead of the master's values."""
    comm = _impl(me, "broadcast", vids)
    if me.is_master:
        arrs = [value(me, me.shareds[v]) if values is None else values[i] for i, v in enumerate(vids)]
    else:
        arrs = [None] * len(vids)
    items = [(vid, a, me.shareds[vid].type.dtype) for vid, a in zip(vids, arrs)]
    _install(me, vids, comm.broadcast(items, me.master_rank, fence=False))


def gather(me, vids):
    comm = _impl(me, "gatherv", vids)
    return comm.gatherv(_items(me, vids), me.master_rank, fence=False)


def all_gather(me, vids):
    comm = _impl(me, "all_gatherv", vids)
    results = comm.all_gatherv(_items(me, vids), fence=False)
    for vid, res in zip(vids, results):
        check_static(me.shareds[vid], res.shape, "all_gather")
    _vote_install(me, vids, results)


def _vote_install(me, vids, results):
    from .errors import Aborted
    results = [me.device.to_device(r) for r in results]
    if not me.control.vote(True, on_commit=lambda: _install(me, vids, results)):
        raise Aborted("another rank failed during this collective")


def scatter(me, vids, plan):
    """Every rank takes its rows of each value (``plans.ScatterPlan``)."""
    parts = []
    for ref, rows in zip(plan.values, plan.rows):
        index = None if rows.index is None else me.view(rows.index)
        parts.append(np.array(shards.take_rows(me.view(ref), rows, me.rank, False, index), copy=True))
    _vote_install(me, vids, parts)


def set_value(me, vids, plan):
    """Rank ``plan.rank`` takes the values (``plans.SetValuePlan``)."""
    if me.rank != plan.rank:
        return
    sel = plan.select
    index = None if sel is None or sel[0] != "index" else me.view(sel[1])
    for vid, ref in zip(vids, plan.values):
        src = shards.select(me.view(ref), sel, index)
        me.device.set(me.shareds[vid], me.device.to_device(np.array(src, copy=True)))


def get_value(me, vids, rank):
    if me.rank != rank:
        return None
    return [np.array(value(me, me.shareds[v]), copy=True) for v in vids]


def shapes(me, vids):
    return [tuple(np.shape(me.device.get(me.shareds[v]))) for v in vids]


OPS = {"all_reduce": all_reduce, "reduce": reduce, "broadcast": broadcast, "gather": gather,
       "all_gather": all_gather, "scatter": scatter, "set_value": set_value, "get_value": get_value,
       "shapes": shapes}


@worker_command("coll")
def _w_coll(me, op, vids, args):
    return OPS[op](me, vids, *args)

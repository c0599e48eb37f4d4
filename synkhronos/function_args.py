"""What ``synk.function`` takes, checked and normalised in the master before anything is
compiled: outputs with their reduce modes, updates, the givens of the ``batch_s``
variant, and whether (and where) the graph's in-graph collectives can run."""
import sys
from collections import OrderedDict

from .reductions import OUTPUT_MODES, UPDATE_MODES, check_mode


def parse_outputs(outputs):
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


def parse_updates(updates):
    """-> list of (shared var, update expression, mode)."""
    from pytensor.compile.sharedvalue import SharedVariable
    if updates is None:
        return []
    if isinstance(updates, dict):
        items = [(k, v, "avg") for k, v in updates.items()]
    elif isinstance(updates, (list, tuple)):
        items = []
        for u in updates:
            if not isinstance(u, tuple) or len(u) not in (2, 3):
                raise TypeError(f"updates must be (shared_var, new_value[, reduce mode]) tuples; got {u!r}")
            if len(u) == 3 and u[2] in ("gather", "c_gather"):
                raise ValueError("an update cannot use reduce mode 'gather'")
            mode = check_mode(u[2], UPDATE_MODES, "update reduce mode") if len(u) == 3 else "avg"
            items.append((u[0], u[1], mode))
    else:
        raise TypeError("updates must be a list of (shared_var, new_value[, reduce mode]) tuples or a dict")
    out = []
    for var, upd, mode in items:
        if not isinstance(var, SharedVariable):
            raise TypeError(f"update targets must be shared variables, got {var!r}")
        if mode == "share" and var.type.dtype not in ("float16", "float32", "float64"):
            raise TypeError(f"update mode 'share' scales a rank's value by its share of the batch: "
                            f"{var} must be a float variable, got {var.type.dtype}")
        try:   # the same check (and safe conversion) plain PyTensor applies to updates
            out.append((var, var.type.filter_variable(upd, allow_convert=True), mode))
        except TypeError as e:
            raise TypeError(f"update of {var} must have the shared variable's type: {e}") from None
    return out


def as_list(x, what):
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    raise TypeError(f"{what} must be a list of variables, got {type(x).__name__}")


def sliced_givens(givens, sliceable, idx):
    """The givens of the ``batch_s`` variant: every sliceable shared read through ``idx``."""
    g = OrderedDict()
    user = list(givens.items()) if isinstance(givens, dict) else list(givens or [])
    for old, new in user:
        g[old] = new[idx] if any(new is v for v in sliceable) else new
    for v in sliceable:
        if not any(new is v for _, new in user) and v not in g:
            g[v] = v[idx]
    return list(g.items())


def check_collectives(outputs, givens, mode, device):
    """Whether the graph holds in-graph collectives (``synkhronos.ops``); TypeError, saying
    why, where they cannot run (``mode="JAX"``, a device off the host)."""
    if "synkhronos.ops" not in sys.modules:      # no collective can have been built
        return False
    ops = sys.modules["synkhronos.ops"]
    g = list(givens.values()) if isinstance(givens, dict) else [v for _, v in (givens or [])]
    outs = list(outputs) + g
    if not ops.uses_collectives(outs):
        return False
    ops.check_backend(mode, device, inner=ops.in_inner_graphs(outs))
    return True


def check_collective_rows(rows, num_slices):
    """In-graph collectives need every rank to run its graph the same number of times."""
    need = max(1, num_slices)
    if min(rows) < need:
        raise ValueError(f"this function holds in-graph collectives (synkhronos.ops), which every rank "
                         f"must run, {need} time(s) per call (num_slices); but the ranks get {list(rows)} "
                         f"rows (by rank). Give at least {need * len(rows)} rows, spread so that every "
                         "rank has at least num_slices of them.")

"""Checkpoints of a session: every shared variable its functions own, from every rank, in
one file that numpy alone can open, and back into a session of any size.

``synk.save(path, state=None)`` writes an ``.npz`` archive: one array per variable (and
per kind of value, below) and ``__manifest__``, a JSON document (as bytes) naming each
variable (its position in the session, name, dtype, shape, kind) with a SHA-256 of its
array, the number of ranks, and ``state``: whatever JSON the caller adds (epoch, position
in the data, seeds).  The file is written to a temporary name in the same folder (mode
0600), flushed to disk and renamed over ``path``: a crash leaves the old file or the new
one, never half of one.

Every variable is gathered from every rank and kept as one of three kinds:

* ``replicated``: every rank holds the same value (parameters, optimizer state of a
  data-parallel step): stored once; on load, broadcast to every rank.
* ``per_rank``: equal shapes, different values (batch-norm statistics, EASGD's local copies,
  error-feedback residuals): stored stacked, one row per rank.  Loaded into as many ranks:
  each gets its own; into another number of ranks: every rank gets the mean of the saved
  ranks' values (rounded for integers), the documented rule.
* ``sharded``: the ``sliceable_shareds`` and ``sharded_shareds`` of the session's functions
  (data shards, sharded optimizer state), the
  variables named in ``save(..., sharded=[...])``, and any whose shapes differ along axis 0
  between ranks: stored concatenated in rank order, with each rank's length; loaded by
  ``synk.scatter`` over the new ranks (even split, as ``scatter`` makes it).

``synk.load(path)`` checks the whole file first (format, checksums, that its variables are
this session's: same count, names, dtypes, and the shapes their values have now in the
master: whole, or per row for sharded variables) and changes nothing when one
check fails (``CheckpointError``, saying what); then it sets every variable and returns
``state``.  Variables are matched by their position in the session (the order the
functions were built in), and their names must agree where both have one.

Random generators (``RandomType`` shared variables, one ``numpy.random.Generator`` per
rank) are saved as each rank's bit generator state in the manifest (``random``); at
another number of ranks, rank r continues saved rank r's stream and a rank beyond them
gets a new independent one (``synkhronos.random_state``)."""
import hashlib
import json
import os
import secrets
import time

import numpy as np

from . import generators, random_state, signals

FORMAT = "synkhronos-checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this session (damaged, foreign, or of other
    variables); nothing was changed."""


# ---- save ----------------------------------------------------------------------------------

def save(path, state=None, sharded=()):
    """Write every shared variable of the session's functions, from every rank, and
    ``state`` (JSON-serialisable) to ``path`` atomically (see the module's docstring).
    ``sharded``: more variables that hold rows split over the ranks (beside the functions'
    sliceable shareds).  Returns the manifest (a dict)."""
    manifest, arrays = snapshot(state, sharded)
    blob = json.dumps(manifest, sort_keys=True).encode()
    _write_atomically(os.fspath(path), dict(arrays, __manifest__=np.frombuffer(blob, dtype=np.uint8)))
    return manifest


def snapshot(state=None, sharded=()):
    """``(manifest, {key: array})``: what ``save`` writes, in memory (``elastic`` keeps the
    last committed one)."""
    from . import collectives
    from .session import get_session
    session = get_session(True)
    try:
        state_json = json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise TypeError(f"synk.save state must be JSON-serialisable (numbers, strings, lists, dicts), "
                        f"got {type(state).__name__}: {e}") from None
    variables = _tensor_shareds(session)
    shards = {id(v) for f in session.functions for v in f.sharded_shareds}
    shards.update(id(v) for v in sharded)
    arrays, entries = {}, []
    if variables:
        gathered = collectives.gather([v for _, v in variables], nd_up=1)
        for (pos, var), parts in zip(variables, gathered):
            entry, arr = _classify(pos, var, parts, id(var) in shards)
            key = f"v{pos}"
            arrays[key] = arr
            entry.update(key=key, sha256=_digest(arr))
            entries.append(entry)
    rngs = random_state.random_shareds(session)
    per_var = random_state.states(session, [pos for pos, _ in rngs]) if rngs else []
    randoms = [{"position": pos, "name": var.name, "states": sts} for (pos, var), sts in zip(rngs, per_var)]
    manifest = {"format": FORMAT, "version": VERSION, "n_ranks": session.n, "created": time.time(),
                "variables": entries, "random": randoms, "state": state_json}
    return manifest, arrays


def _tensor_shareds(session):
    return [(i, v) for i, v in enumerate(session.shareds)
            if hasattr(v.type, "dtype") and hasattr(v.type, "ndim")]


def _classify(pos, var, parts, shard):
    """``(manifest entry, array to store)`` of one variable gathered from every rank."""
    entry = {"position": pos, "name": var.name, "dtype": str(var.type.dtype), "ndim": int(var.type.ndim)}
    if shard and not isinstance(parts, list) and var.type.ndim >= 1:
        parts = list(parts)
    if isinstance(parts, list):                      # rows split over the ranks
        lengths = [int(p.shape[0]) for p in parts]
        entry.update(kind="sharded", lengths=lengths, row_shape=list(parts[0].shape[1:]))
        return entry, np.concatenate(parts, axis=0)
    first = parts[0]
    if all(_same(first, p) for p in parts[1:]):
        entry.update(kind="replicated", shape=list(first.shape))
        return entry, np.array(first, order="C")
    entry.update(kind="per_rank", shape=list(first.shape))
    return entry, np.array(parts, order="C")


def _same(a, b):
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


def _digest(arr):
    h = hashlib.sha256()
    h.update(str(arr.dtype).encode() + repr(arr.shape).encode())
    h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1) if arr.size else b"")
    return h.hexdigest()


def _write_atomically(path, arrays):
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:                                  # the rename itself, on disk
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


# ---- load ----------------------------------------------------------------------------------

def read(path):
    """``(manifest, {key: array})`` of a checkpoint file, every checksum verified;
    ``CheckpointError`` for a damaged or foreign file.  Needs no session."""
    try:
        with np.load(os.fspath(path), allow_pickle=False) as z:     # (each array read once)
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except Exception as e:                          # noqa: BLE001 - a damaged or foreign file
        raise CheckpointError(f"{path} is not a readable checkpoint (an .npz archive written by "
                              f"synk.save): {type(e).__name__}: {e}") from None
    if "__manifest__" not in arrays:
        raise CheckpointError(f"{path} is an .npz archive but not a synkhronos checkpoint (no __manifest__)")
    try:
        manifest = json.loads(arrays.pop("__manifest__").tobytes().decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: its manifest is damaged ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
                              f"this synkhronos reads {FORMAT!r} version {VERSION}")
    for e in manifest["variables"]:
        arr = arrays.get(e["key"])
        if arr is None:
            raise CheckpointError(f"{path}: the array of variable {_label(e)} is missing")
        if _digest(arr) != e["sha256"]:
            raise CheckpointError(f"{path}: variable {_label(e)} fails its checksum (the file is damaged)")
    return manifest, arrays


def load(path):
    """Set every shared variable of the session's functions from the checkpoint at
    ``path`` (written by ``save``, at any number of ranks) and return its ``state``.
    Everything is checked before anything is set (``CheckpointError``), and a Ctrl-C
    either lands before anything is set or after everything is; a rank lost meanwhile
    closes the session (``WorkerDied``: fork again and load again)."""
    return restore(*read(path), where=path)


def restore(manifest, arrays, where="the snapshot"):
    """Set every shared variable of the session's functions from ``snapshot``'s result (of
    any number of ranks); returns its ``state``.  Checked before anything is set."""
    from .session import get_session
    session = get_session(True)
    plan = _plan(where, manifest, arrays, _tensor_shareds(session))
    randoms = _plan_random(where, manifest, random_state.random_shareds(session), session.n)
    with signals.deferred():        # a Ctrl-C lands after every variable is set, never between
        _apply(session, plan)
        if randoms:
            random_state.set_states(session, *zip(*randoms))
    return manifest.get("state")


def _plan_random(path, manifest, variables, n):
    """``[(position, states of the n ranks)]`` of the generators; [] for a checkpoint
    written before generators were saved (they are left as they are)."""
    if "random" not in manifest:
        return []
    entries = manifest["random"]
    if len(entries) != len(variables):
        raise CheckpointError(f"{path} holds {len(entries)} random generators, this session's functions own "
                              f"{len(variables)}: not a checkpoint of these functions")
    plan = []
    for e, (pos, var) in zip(entries, variables):
        if e.get("name") and var.name and e["name"] != var.name:
            raise CheckpointError(f"{path}: random generator {_label(e)} is {var.name!r} in this session")
        try:
            states = random_state.resized(e["states"], n)
            for st in states:
                generators.generator(st)
        except (ValueError, TypeError, IndexError) as err:
            raise CheckpointError(f"{path}: random generator {_label(e)}: {err}") from None
        plan.append((pos, states))
    return plan


def _label(e):
    return f"#{e['position']}" + (f" ({e['name']})" if e.get("name") else "")


def _plan(path, manifest, arrays, variables):
    """``[(variable, kind, array)]``, every entry checked against this session's variables."""
    entries = manifest["variables"]
    if len(entries) != len(variables):
        raise CheckpointError(f"{path} holds {len(entries)} shared variables, this session's functions own "
                              f"{len(variables)}: not a checkpoint of these functions")
    plan = []
    for e, (pos, var) in zip(entries, variables):
        arr = arrays[e["key"]]
        where = f"{path}: variable {_label(e)}"
        if e.get("name") and var.name and e["name"] != var.name:
            raise CheckpointError(f"{where} is {var.name!r} in this session (variables are matched by "
                                  "the order the functions were built in)")
        if e["dtype"] != str(var.type.dtype) or e["ndim"] != var.type.ndim:
            raise CheckpointError(f"{where}: saved {e['dtype']} with {e['ndim']} dimension(s), this session's "
                                  f"{var} is {var.type.dtype} with {var.type.ndim}")
        now = tuple(np.shape(var.get_value(borrow=True)))          # (the master's value)
        if e["kind"] == "sharded":
            saved, have = tuple(arr.shape[1:]), now[1:]
        else:
            saved, have = tuple(arr.shape[1:]) if e["kind"] == "per_rank" else tuple(arr.shape), now
        if saved != have:
            what = "rows of shape" if e["kind"] == "sharded" else "shape"
            raise CheckpointError(f"{where}: saved {what} {saved}, this session's {var} has {what} {have} "
                                  "(not a checkpoint of this model)")
        plan.append((var, e["kind"], arr))
    return plan


def _apply(session, plan):
    from . import collectives
    n = session.n
    replicated = [(v, a) for v, k, a in plan if k == "replicated"]
    if replicated:
        collectives.broadcast([v for v, _ in replicated], [a for _, a in replicated])
    sharded = [(v, a) for v, k, a in plan if k == "sharded"]
    if sharded:
        collectives.scatter([v for v, _ in sharded], [a for _, a in sharded])
    for var, kind, arr in plan:
        if kind != "per_rank":
            continue
        if arr.shape[0] == n:
            for r in range(n):
                collectives.set_value(r, var, np.array(arr[r], order="C"))
        else:                                          # another world size: the mean of the saved ranks
            mean = arr.astype(np.float64).mean(axis=0)
            value = (np.rint(mean) if arr.dtype.kind in "iub" else mean).astype(arr.dtype)
            collectives.broadcast(var, value)

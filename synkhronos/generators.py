"""Random generators as JSON: the state of a numpy bit generator (and, on JAX ranks, the
key JAX draws from) in a form a checkpoint manifest holds, and the one rule for a stream
that no saved state continues: a new stream of the same bit generator, seeded from a
saved state and a number (the same seed every time, so that a run is repeatable).

Plain numpy, no session: the devices (``generator_state``/``set_generator_state``) and
``synkhronos.random_state`` build on it."""
import hashlib
import json

import numpy as np

__all__ = ["to_json", "from_json", "state_of", "generator", "derived"]


def to_json(x, dtypes=False):
    """``x`` (nested dicts of ints and arrays, numpy's or JAX's) with arrays as
    ``{"ndarray": [...], "dtype": ...}`` and numbers as Python ints (``dtypes``: numbers
    too as 0-d arrays, keeping their dtype)."""
    if isinstance(x, dict):
        return {k: to_json(v, dtypes) for k, v in x.items()}
    if isinstance(x, (int, str, float)) or x is None:
        return x
    arr = np.asarray(x)
    if arr.ndim == 0 and arr.dtype.kind in "iub" and not dtypes:
        return int(arr)
    return {"ndarray": arr.tolist(), "dtype": str(arr.dtype)}


def from_json(x):
    if isinstance(x, dict):
        if set(x) == {"ndarray", "dtype"}:
            return np.asarray(x["ndarray"], dtype=x["dtype"])
        return {k: from_json(v) for k, v in x.items()}
    return x


def state_of(gen):
    """The JSON state of numpy Generator ``gen``."""
    return to_json(gen.bit_generator.state)


def _kind(state):
    try:
        name = state["bit_generator"]
        kind = getattr(np.random, name)
    except (AttributeError, KeyError, TypeError) as e:
        raise ValueError(f"not the state of a numpy bit generator: {e!r}") from None
    if not (isinstance(kind, type) and issubclass(kind, np.random.BitGenerator)):
        raise ValueError(f"not the state of a numpy bit generator: {name!r}")
    return kind


def derived(state, salt):
    """A new Generator of ``state``'s bit generator seeded from ``state`` and the int
    ``salt``: a stream of its own, independent of ``state``'s and of other salts'."""
    kind = _kind(state)
    digest = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).digest()
    words = [int(w) for w in np.frombuffer(digest, np.uint32)]
    return np.random.Generator(kind(np.random.SeedSequence(words + [int(salt)])))


def generator(state):
    """A numpy Generator continuing ``state`` (one of ``state_of``'s); a state drawn by JAX
    (it has a ``jax_state``, which numpy cannot continue) gives ``derived(state, 0)``.
    ValueError if ``state`` is not a bit generator's state."""
    kind = _kind(state)
    if "jax_state" in state:
        try:
            key = np.asarray(from_json(state["jax_state"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a JAX generator state: {e!r}") from None
        if key.shape != (2,) or key.dtype.kind not in "iu":
            raise ValueError(f"not a JAX generator state: jax_state {key.dtype}{list(key.shape)}, "
                             "expected 2 integers")
        return derived(state, 0)
    try:
        bit_gen = kind()
        bit_gen.state = from_json(state)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not the state of a numpy bit generator: {e!r}") from None
    return np.random.Generator(bit_gen)

"""JAX's persistent compilation cache, shared by a session's processes: a graph is
compiled once, not once per rank.

A function's first call runs in the master before the workers start (``master_first``):
the master's XLA compile writes the program to the cache and every rank then loads it
instead of compiling it again (on CPU ranks the n compiles shared the cores; on GPUs each
took seconds for a large model).  The next session, and the next run, load it too.

Where (decided in the master, the same for every rank):

* the user's own cache (``jax_compilation_cache_dir``, or env ``JAX_COMPILATION_CACHE_DIR``)
  with the user's settings, when one is set;
* else ``SYNK_JAX_CACHE`` (a directory; ``off`` turns the cache off), by default
  ``jax_cache`` in PyTensor's compiledir (the user's own, where the numba cache is too),
  created private (0700).  There every program that took ``MIN_COMPILE_S`` (or
  ``SYNK_JAX_CACHE_MIN_S``) seconds or more to compile is kept (JAX's default keeps those
  over 1 s only; faster ones are not worth a file: JAX scans the folder at every write),
  and the least recently used go beyond ``CACHE_BYTES``.  Bounding the size makes JAX lock
  the cache (``filelock``) around every read and write, so that a rank never reads a
  program another process is still writing; without ``filelock`` (or with a JAX that
  cannot bound its cache) the cache stays off.

The master creates the folder when it plans the session (a path it cannot use is refused
before any process starts); a rank of another host that cannot create it compiles for
itself."""
import os
import sys

CACHE_BYTES = 1 << 30
MIN_COMPILE_S = 0.1
_OFF = ("0", "off", "none", "false", "no")
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")


def plan():
    """The cache every rank of a new session uses: ``{"dir", "own", "settings"}``, or None
    (off)."""
    raw = os.environ.get("SYNK_JAX_CACHE", "").strip()
    if raw.lower() in _OFF:
        return None
    theirs = _users_dir()
    if theirs:
        import jax
        return {"dir": theirs, "own": False, "settings": {k: getattr(jax.config, k) for k in _SETTINGS}}
    try:
        import filelock  # noqa: F401  (JAX's lock around the bounded cache)
    except ImportError:
        return None
    import jax
    if not hasattr(jax.config, "jax_compilation_cache_max_size"):     # (a JAX without a bounded cache)
        return None
    if raw:
        path = os.path.abspath(os.path.expanduser(raw))
    else:
        import pytensor
        path = os.path.join(str(pytensor.config.compiledir), "jax_cache")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(f"SYNK_JAX_CACHE: cannot use {path!r} for JAX's compiled programs ({e.strerror}); "
                         "name a folder of yours, or 'off'") from None
    return {"dir": path, "own": True,
            "settings": {"jax_compilation_cache_dir": path,
                         "jax_persistent_cache_min_compile_time_secs": _min_compile_s(),
                         "jax_persistent_cache_min_entry_size_bytes": -1,
                         "jax_compilation_cache_max_size": CACHE_BYTES}}


def _min_compile_s():
    raw = os.environ.get("SYNK_JAX_CACHE_MIN_S", "").strip()
    try:
        value = float(raw) if raw else MIN_COMPILE_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"SYNK_JAX_CACHE_MIN_S must be a number of seconds >= 0, got {raw!r}")
    return value


def _users_dir():
    if "jax" in sys.modules:
        import jax
        return jax.config.jax_compilation_cache_dir
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or None


def use(cache):
    """Turn ``cache`` (``plan()``'s) on in this process; returns what to give ``restore``."""
    if cache is None:
        return None
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    if cache["own"]:
        try:               # (the master made it; another host may lack it)
            os.makedirs(cache["dir"], mode=0o700, exist_ok=True)
        except OSError:
            return None
    saved = {k: getattr(jax.config, k) for k in _SETTINGS}
    for k, v in cache["settings"].items():
        jax.config.update(k, v)
    # a compile before this one (the user's, in the master) found no cache and keeps
    # finding none until the cache's state is reset
    compilation_cache.reset_cache()
    return saved


def restore(saved):
    """The settings as they were before ``use`` (the master, when its session closes)."""
    if saved is None:
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()

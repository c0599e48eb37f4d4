"""The names of the implementations of every plane, and the contracts each one keeps.

``implementation(plane, name)`` imports a class on first use (JAX and MPI are imported only
by the sessions that use them); the composition root (``synkhronos.backends``) wires a
session from these names, and the conformance tests check every entry against its
contracts."""
import importlib

_P = "synkhronos.backends."
REGISTRY = {
    "launcher": {"subprocess": _P + "host.launcher:SubprocessLauncher",
                 "mpi": _P + "mpi.launcher:MpiLauncher"},
    "control": {"shm": _P + "shm.control:ShmControl",
                "mpi": _P + "mpi.control:HierControl"},
    "comm": {"shm": _P + "shm.comm:ShmComm",
             "hier": _P + "mpi.comm:HierComm",
             "staged": _P + "jax.staged_comm:StagedComm",
             "xla": _P + "jax.xla_comm:XlaComm"},
    "device": {"cpu": _P + "host.device:CpuDevice",
               "jax": _P + "jax.device:JaxDevice"},
    "channel": {"shm": _P + "shm.channel:Channel",
                "mpi": _P + "mpi.channel:HostsChannel"},
}

# the protocols each implementation keeps (``plane:name`` -> protocols); the default is the plane's
CONTRACTS = {
    "launcher": ("synkhronos.launcher:Launcher",),
    "control": ("synkhronos.control:MasterControl", "synkhronos.control:WorkerControl"),
    "comm": ("synkhronos.comm:Comm",),
    "device": ("synkhronos.device:Device",),
    "channel": ("synkhronos.channel:Channel", "synkhronos.channel:WorkerChannel"),
    "control:mpi": ("synkhronos.control:MasterControl",),      # the master's side only (workers use shm)
    "channel:mpi": ("synkhronos.channel:Channel",),            # likewise
    "comm:shm": ("synkhronos.comm:Comm", "synkhronos.comm:ReadsAll"),   # (an optional capability: see there)
}


def _load(path):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def implementation(plane, name):
    """The class registered as ``name`` for ``plane``."""
    try:
        return _load(REGISTRY[plane][name])
    except KeyError:
        known = {p: sorted(v) for p, v in REGISTRY.items()}
        raise ValueError(f"no {plane} implementation named {name!r}; registered: {known}") from None


def name_of(obj):
    """The registry name of ``obj``'s class (whatever its plane), or its class name."""
    path = f"{type(obj).__module__}:{type(obj).__name__}"
    for names in REGISTRY.values():
        for name, p in names.items():
            if p == path:
                return name
    return type(obj).__name__


def contracts(plane, name):
    """The protocol classes implementation ``name`` of ``plane`` keeps."""
    return tuple(_load(p) for p in CONTRACTS.get(f"{plane}:{name}", CONTRACTS[plane]))


def make_device(config, n):
    """The device described by ``config`` (``Device.config()``) for ``n`` ranks: how a
    worker (or a host's agent) rebuilds the master's."""
    settings = dict(config)
    return implementation("device", settings.pop("kind"))(n, **settings)

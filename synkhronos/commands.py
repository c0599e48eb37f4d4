"""Registry of the commands a worker understands.

Modules register their worker-side half with ``@worker_command("name")``; the master
sends ``(name, args)`` through the transport and the worker looks the handler up here.

A module that a worker does not import at start (an extension, e.g.
``synkhronos.extensions.exchange``) names its commands ``"<module>:<name>"``: ``handler``
imports the module (it must be part of synkhronos) the first time a worker meets one of
them, which registers its commands.  The same functions can also run as follow-up steps
of a call (``replica.follow_up``, step ``("ext", name, *args)``)."""
import importlib

HANDLERS = {}


def worker_command(name):
    def register(fn):
        HANDLERS[name] = fn
        return fn
    return register


def handler(name):
    """The function registered for command ``name`` (importing its module first for a
    ``"synkhronos.<module>:<name>"`` command); KeyError for an unknown command."""
    fn = HANDLERS.get(name)
    if fn is None and isinstance(name, str) and ":" in name:
        module = name.split(":", 1)[0]
        if module == "synkhronos" or module.startswith("synkhronos."):
            importlib.import_module(module)
            fn = HANDLERS.get(name)
    if fn is None:
        raise KeyError(f"unknown synkhronos command {name!r}")
    return fn

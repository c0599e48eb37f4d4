"""Registry of the commands a worker understands.

Modules register their worker-side half with ``@worker_command("name")``; the master
sends ``(name, args)`` through the transport and the worker looks the handler up here."""

HANDLERS = {}


def worker_command(name):
    def register(fn):
        HANDLERS[name] = fn
        return fn
    return register

"""A worker's side of a parameter-server run (``ParameterServer.run``): take the newest
weights, compute a gradient on a batch of its own rows, send it, wait for the answer."""
import time

import numpy as np

from synkhronos.backends import attach_channel
from synkhronos.channel import FAILED, FINISHED, RUNNING, float_bits
from synkhronos.commands import worker_command


COMMAND = __name__ + ":ps"


@worker_command(COMMAND)
def ps_worker(me, spec):
    """A worker's loop of one parameter-server run (``spec``: see ``ParameterServer.run``)."""
    dtype = np.dtype(spec["dtype"])
    size = spec["nbytes"] // dtype.itemsize
    ch = attach_channel(me.control, spec["channel"], me.rank)
    try:
        dev = me.device
        f = me.replicas[spec["grad_fid"]].f
        arrays = [me.view(ref) for ref in spec["data"]]
        j = list(spec["workers"]).index(me.rank)
        w = len(spec["workers"])
        lo, hi = (j * spec["rows"]) // w, ((j + 1) * spec["rows"]) // w
        batch = spec["batch"]
        rng = np.random.default_rng([spec["seed"], me.rank])
        params = [me.shareds[v] for v in spec["params"]]
        shapes = [np.shape(dev.to_host(dev.get(p))) for p in params]
        bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        order, pos = rng.permutation(np.arange(lo, hi)), 0
        sent = 0
        t_compute = 0.0
        ch.set_state(RUNNING)
        while True:
            meta = ch.wait_answer("the parameter server's weights")
            if meta is None:
                break
            version = meta[0]
            down = ch.down(me.rank, dtype, size)
            for p, a, b, s in zip(params, bounds[:-1], bounds[1:], shapes):
                dev.set(p, dev.to_device(np.array(down[a:b], copy=True).reshape(s)))
            if pos + batch > len(order):
                order, pos = rng.permutation(np.arange(lo, hi)), 0
            idx = np.sort(order[pos:pos + batch])
            pos += batch
            t = time.perf_counter()
            loss, g = f(*[a[idx] for a in arrays])
            t_compute += time.perf_counter() - t
            np.copyto(ch.up(me.rank, dtype, size), np.asarray(dev.to_host(g)).reshape(-1), casting="same_kind")
            ch.send((version, batch, float_bits(float(np.asarray(dev.to_host(loss)))), 0))
            sent += 1
        ch.set_state(FINISHED)
        return dict(sent=sent, compute_seconds=t_compute)
    except BaseException:
        try:
            ch.set_state(FAILED)
        except Exception:
            pass
        raise
    finally:
        ch.close()

"""The master's side of a parameter-server run (``ParameterServer.run``): apply each
worker's gradient as it arrives, answer with the newest weights, drop gradients that are
too stale, report dead and slow workers without waiting for them."""
import sys
import time

import numpy as np

from synkhronos.channel import bits_float
from synkhronos.function import replica_of


class Server:
    """The master's side of one run."""

    def __init__(self, ps, session, ch, workers, result, steps, max_seconds, slow_after, verbose):
        self.ps, self.session, self.ch, self.workers, self.res = ps, session, ch, workers, result
        self.steps = None if steps is None else int(steps)
        self.max_seconds = max_seconds
        self.slow_after = slow_after
        self.verbose = verbose
        dev = session.device
        self.dev = dev
        self.rep = replica_of(ps.update_function)
        g = dev.get(ps.grad_shared)
        if not (isinstance(g, np.ndarray) and g.flags.writeable and g.flags.c_contiguous and g.size == ps.size):
            g = np.zeros(ps.size, ps.dtype)
            dev.set(ps.grad_shared, g)
        # a gradient arrives into the variable's own memory where the device keeps host
        # arrays as they are; a device that copies (JAX) is given each gradient instead
        self.grad = g if dev.get(ps.grad_shared) is g else None
        self.pieces = []
        off = 0
        for p in ps.params:
            size = int(np.prod(np.shape(p.get_value(borrow=True))))
            self.pieces.append((p, off, off + size))
            off += size

    def _say(self, text):
        if self.verbose:
            print(f"synkhronos: parameter server: {text}", file=sys.stderr, flush=True)

    def _weights_to(self, rank):
        down = self.ch.down(rank, self.ps.dtype, self.ps.size)
        for p, a, b in self.pieces:
            down[a:b] = np.asarray(self.dev.to_host(self.dev.get(p))).reshape(-1)

    def serve(self):
        ch, res, ps = self.ch, self.res, self.ps
        live = set(self.workers)
        stats = {r: dict(sent=0, applied=0, dropped=0, max_staleness=0, staleness_sum=0) for r in self.workers}
        last_seen = {r: None for r in self.workers}
        reported_slow = set()
        version = res.version
        for r in self.workers:                     # the first weights
            self._weights_to(r)
            ch.answer(r, (version, 0, 0, 0), consumed=False)
        t0 = time.monotonic()
        next_check = t0
        order = list(self.workers)
        try:
            while live:
                now = time.monotonic()
                if self.steps is not None and res.applied >= self.steps:
                    break
                if self.max_seconds is not None and now - t0 >= self.max_seconds:
                    break
                if ch.control.aborted():
                    break
                if now >= next_check:              # liveness and slowness, 4 times a second
                    next_check = now + 0.25
                    for r in sorted(live):
                        st = ch.status(r)
                        if st in ("dead", "failed"):
                            live.discard(r)
                            how = "is gone" if st == "dead" else "failed"
                            res.dead.append((r, now - t0, st))
                            self._say(f"worker rank {r} {how} after {now - t0:.2f} s; going on with "
                                      f"rank(s) {sorted(live) or 'none'}")
                        elif self.slow_after is not None and r not in reported_slow:
                            since = last_seen[r] if last_seen[r] is not None else t0
                            if now - since > self.slow_after:
                                reported_slow.add(r)
                                what = "is stopped" if st == "stopped" else "sent nothing"
                                res.slow.append((r, now - t0, st))
                                self._say(f"worker rank {r} {what} for {now - since:.1f} s (slow); "
                                          "the others go on")
                    if not live:
                        break
                ready = [r for r in ch.pending() if r in live]
                if not ready:
                    ch.wait_any(0.02)
                    continue
                ready.sort(key=order.index)        # round-robin: served ones go to the back
                for r in ready:
                    order.remove(r)
                    order.append(r)
                    v_used, rows, loss_bits, _ = ch.message(r)
                    staleness = version - v_used
                    s = stats[r]
                    s["sent"] += 1
                    last_seen[r] = time.monotonic()
                    reported_slow.discard(r)
                    apply = staleness <= ps.max_staleness and (self.steps is None or res.applied < self.steps)
                    if apply:
                        if self.grad is not None:
                            np.copyto(self.grad, ch.up(r, ps.dtype, ps.size))
                        else:
                            self.dev.set(ps.grad_shared, ch.up(r, ps.dtype, ps.size))    # (a copy)
                        new = self.rep.f()
                        for var, val in zip(self.rep.update_vars, new):
                            self.dev.set(var, val)
                        version += 1
                        res.applied += 1
                        res.staleness.append(staleness)
                        s["applied"] += 1
                        s["max_staleness"] = max(s["max_staleness"], staleness)
                        s["staleness_sum"] += staleness
                    else:
                        res.dropped += 1
                        s["dropped"] += 1
                    res.events.append((time.monotonic() - t0, version, r, staleness,
                                       bits_float(loss_bits), apply))
                    self._weights_to(r)
                    ch.answer(r, (version, 0, 0, 0))
        finally:
            ch.stop()
            res.version = version
            res.seconds = time.monotonic() - t0
            for r, s in stats.items():
                n_app = s["applied"]
                res.per_rank[r] = dict(sent=s["sent"], applied=n_app, dropped=s["dropped"],
                                       max_staleness=s["max_staleness"],
                                       mean_staleness=s["staleness_sum"] / n_app if n_app else 0.0)
        return None

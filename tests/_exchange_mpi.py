"""Run under ``mpiexec -n HOSTS``: the exchange strategies across hosts (tests/test_exchange.py).

Prints ``SYNK-RESULT {json}`` in the master: the float16 all-reduce (float16 on the wire
between hosts) against numpy, the fp16 exchange against float32, EASGD's center equal on
every rank, and the parameter server (workers of other groups through their agent)."""
import json
import sys

import numpy as np


def main(n):
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import exchange, updates
    synk.fork(n)
    out = {"n": n, "failed": [], "checks": 0}

    def check(ok, what):
        out["checks"] += 1
        if not ok:
            out["failed"].append(what)
    try:
        size = 10_001
        h = pytensor.shared(np.zeros(size, np.float16), name="h")
        a = pytensor.shared(np.zeros(size, np.float32), name="a")
        a32 = pytensor.shared(np.zeros(size, np.float32), name="a32")
        exchange.prepare([a], error_feedback=True)
        synk.function([], outputs=[T.sum(h), T.sum(a32)])
        W = pytensor.shared(np.ones((3, 2), np.float32), name="W")
        x = T.matrix("x", dtype="float32")
        loss = T.mean((x @ W) ** 2)
        easgd = exchange.make_train_function(loss, [W], [x], updates.sgd, learning_rate=0.01,
                                             exchange=exchange.EASGD(tau=1, alpha=0.1))
        ps = exchange.ParameterServer(loss, [W], [x], updates.sgd, learning_rate=0.01)
        synk.distribute()
        sizes = synk.session_info().resources.get("hosts")
        out["hosts"] = sizes
        rng = np.random.default_rng(0)
        vals = [(rng.standard_normal(size) * 30).astype(np.float16) for _ in range(n)]
        for op in ("sum", "avg"):
            for r in range(n):
                synk.set_value(r, h, vals[r])
            synk.all_reduce(h, op=op)
            exact = np.sum(np.float64(vals), axis=0) / (n if op == "avg" else 1)
            got = [synk.get_value(r, h).astype(np.float64) for r in range(n)]
            check(all(np.array_equal(g, got[0]) for g in got), f"float16 {op}: ranks differ")
            mag = np.sum(np.abs(np.float64(vals)), axis=0) / (n if op == "avg" else 1)
            # each host's partial rounded once more (several ranks on a host): 2 roundings
            bound = 2 ** -11 * (mag + np.abs(exact)) * 1.01 + 2 ** -23
            check(bool((np.abs(got[0] - exact) <= bound).all()), f"float16 {op}: beyond the bound")
        v32 = [(rng.standard_normal(size)).astype(np.float32) for _ in range(n)]
        for r in range(n):
            synk.set_value(r, [a, a32], [v32[r], v32[r]])
        exchange.all_reduce(a, op="avg", compress="fp16")
        synk.all_reduce(a32, op="avg")
        ref = synk.get_value(0, a32)
        got = [synk.get_value(r, a) for r in range(n)]
        check(all(np.array_equal(g, got[0]) for g in got), "fp16 exchange: ranks differ")
        mag = np.mean(np.abs(np.float64(v32)), axis=0)
        check(bool((np.abs(got[0] - ref) <= 2 ** -11 * (2 * mag + np.abs(ref)) * 1.01 + 2 ** -22).all()),
              "fp16 exchange: beyond the bound")
        # beyond float16's range: 40000 from every rank sums to 40000 n (never inf), and with
        # error feedback 1e5 per rank arrives in full over a few exchanges
        for r in range(n):
            synk.set_value(r, a, np.full(size, 40000, np.float32))
        exchange.all_reduce(a, op="sum", compress="fp16")
        got = [synk.get_value(r, a) for r in range(n)]
        check(all(np.array_equal(g, got[0]) for g in got), "fp16 beyond float16: ranks differ")
        check(bool((np.abs(got[0] - 40000.0 * n) <= 40000.0 * n * 2 ** -10).all()),
              f"fp16 beyond float16: {got[0][:3]} for {40000 * n}")
        total = 0.0
        for _ in range(4):
            synk.broadcast(a, np.full(size, 1e5, np.float32))
            exchange.all_reduce(a, op="sum", compress="fp16")
            total += synk.get_value(n - 1, a).astype(np.float64)
        check(bool((np.abs(total - 4e5 * n) <= 1e5 * n * 2 ** -9).all()), f"fp16 error feedback: {total[:3]}")
        X = synk.data(rng.standard_normal((4 * n, 3)).astype(np.float32))
        for _ in range(3):
            easgd(X)
        centers = [synk.get_value(r, easgd.center) for r in range(n)]
        check(all(np.array_equal(c, centers[0]) for c in centers), "EASGD: centers differ")
        check(easgd.exchanges == 3, "EASGD: exchanges")
        # the parameter server across the groups: workers of the other groups exchange
        # through their group's agent (backends.mpi.channel)
        Xn = np.asarray(X.data, np.float64)
        before = float(np.mean((Xn @ W.get_value().astype(np.float64)) ** 2))
        res = ps.run(X, max_seconds=1.0, batch_size=2, verbose=False)   # (no worker is sure to send in N steps)
        after = float(np.mean((Xn @ W.get_value().astype(np.float64)) ** 2))
        check(res.applied > 10 and sum(p["applied"] for p in res.per_rank.values()) == res.applied,
              f"PS: applied {res.applied}, per rank {res.per_rank}")
        check(all(0 <= s <= ps.max_staleness for s in res.staleness) and len(res.staleness) == res.applied,
              f"PS: staleness {res.staleness}")
        check(all(p["sent"] >= 1 for p in res.per_rank.values()) and sorted(res.per_rank) == list(range(1, n)),
              f"PS: every worker sent: {res.per_rank}")
        check(after < before, f"PS: loss {before} -> {after}")
        check(all(np.array_equal(synk.get_value(r, W), W.get_value()) for r in range(n)), "PS: weights differ")
        check(ps.run(X, steps=5, batch_size=2, verbose=False).applied == 5, "PS: a second run")
    finally:
        synk.close()
    print("SYNK-RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))

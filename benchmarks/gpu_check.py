"""Checks and measurements of the JAX device (GPU ranks, or CPU ranks where there is no GPU),
run by ``benchmarks/gpu_check.sh``.  Every measurement runs in its own master process (XLA's
collectives need ``jax.distributed`` set up before any JAX use in the master).

* ``overhead``: function throughput, synkhronos n=1 against plain PyTensor JAX on the same
  device: a tiny function (per-call overhead) and an MLP training step at batch 256 and
  4096, with batches from host memory (goal >= 0.95x) and with the data set resident on
  the device (``batch_s`` over sliceable shareds, against plain PyTensor indexing a shared
  variable; goal >= 0.98x).
* ``allreduce``: ``synk.all_reduce`` (float32, sum) from 1 MB up to ``--max-mb`` (and 4 KB
  latency): n=1; n=2 through XLA's collectives (NCCL; on the CPU gloo) where each rank has
  its own device; n=2 through the host (staged), on one GPU (``SYNK_GPUS=0,0``) or the CPU,
  adding on the device and on the host (``SYNK_STAGED_REDUCE``).
  Bus bandwidth as nccl-tests: bytes * 2(n-1)/n / time.
* ``profile``: where a call's time goes (cProfile of the master, both sides): the tiny
  function and the MLP step at batch 256 from host memory, synkhronos n=1 against plain
  PyTensor JAX; the functions with the most own time, per call.
* ``demos``: training-step time of the CNN and ResNet demos' models (``demos/layers.py``),
  synkhronos n=1 against the same compiled graphs called as plain PyTensor JAX in the master
  (``TrainFunction.serial``), on the same device.

Usage: python benchmarks/gpu_check.py [all|overhead|allreduce|demos|profile] [--quick] [--max-mb N]
Prints tables and, at the end, every figure beside its goal; writes
benchmarks/results/gpu_check_<gpu|cpu>.json."""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from common import RESULTS, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KB, MB = 1 << 10, 1 << 20
OUT = os.environ.get("GPU_CHECK_RESULTS") or RESULTS     # (gpu_check.sh sets it: one folder for the run)


# ---- helpers ----------------------------------------------------------------------------------

def platform():
    sys.path.insert(0, ROOT)
    from synkhronos.backends.host.gpus import gpu_backend_missing, gpu_count, visible_gpus
    n = gpu_count()
    return ("gpu" if n else "cpu"), n, visible_gpus(), gpu_backend_missing()


def median_time(fn, reps, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def best_of_rounds(fns, reps, rounds):
    """Per function, the best over ``rounds`` of its median call time; each round runs the
    functions in turn, in alternating order (ABBA: drift from other programs' load on a
    shared machine hits both alike; the best round is the least disturbed)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    out = {k: float("inf") for k in fns}
    keys = list(fns)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            out[k] = min(out[k], median_time(fns[k], reps, warm=1))
    return out


def child(what, args, env=None, timeout=1800):
    """Run ``what`` in a fresh master process; returns its RESULT dict (or an error dict)."""
    e = dict(os.environ)
    e.pop("SYNK_MODE", None)
    e.update(env or {})
    cmd = [sys.executable, os.path.abspath(__file__), "_child", what, json.dumps(args)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or "").strip().splitlines()[-15:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


def fork(n, plat):
    import synkhronos as synk
    return synk.fork(n, mode="JAX", use_gpu=(plat == "gpu"))


# ---- children (one master process each) ------------------------------------------------------------

def c_overhead(a):
    import jax
    import pytensor
    import pytensor.tensor as pt
    import synkhronos as synk
    plat = a["platform"]
    fork(1, plat)
    dev = synk.session_info()
    # tiny: the per-call overhead
    x = pt.fmatrix("x")
    y = pt.fvector("y")
    z = pt.mean(x.dot(y), axis=0)
    f = synk.function([x], z, bcast_inputs=[y])
    f_plain = pytensor.function([x, y], z, mode="JAX")
    # MLP training step (SGD updates, loss out): batches from host memory, and the data set
    # resident on the device (sliceable shareds, batch_s: the original's fast path for GPUs)
    rng = np.random.default_rng(0)
    sys.path.insert(0, os.path.join(ROOT, "demos"))  # the demos' folder: the demo's model builder
    from losses import picked                   # demos/losses.py
    from mnist_mlp import mlp_params            # the demo's MLP (demos/mnist_mlp.py)
    xm = pt.fmatrix("xm")
    ym = pt.ivector("ym")
    params, forward = mlp_params([a["n_in"], a["hidden"], a["hidden"], 10], 0)
    loss = -pt.mean(picked(pt.special.log_softmax(forward(xm), axis=1), ym, 10))
    grads = pytensor.grad(loss, params)
    ups = [(p, p - np.float32(0.01) * g) for p, g in zip(params, grads)]
    rows = max(a["batches"]) * 4
    XS = rng.standard_normal((rows, a["n_in"])).astype("float32")
    YS = rng.integers(0, 10, rows).astype("int32")
    X_s, Y_s = pytensor.shared(XS, name="X_s"), pytensor.shared(YS, name="Y_s")
    step = synk.function([xm, ym], loss, updates=ups)
    step_s = synk.function([], loss, updates=ups, givens=[(xm, X_s), (ym, Y_s)], sliceable_shareds=[X_s, Y_s])
    step_plain = pytensor.function([xm, ym], loss, updates=ups, mode="JAX")
    idx = pt.lvector("idx")
    step_plain_s = pytensor.function([idx], loss, updates=ups, givens=[(xm, X_s[idx]), (ym, Y_s[idx])],
                                     mode="JAX")
    synk.distribute()
    synk.scatter([X_s, Y_s], [XS, YS])             # the data set goes to the device once
    X = rng.standard_normal((8, 4)).astype("float32")
    Y = rng.standard_normal(4).astype("float32")
    Xd, Yd = synk.data(X), synk.data(Y)
    Xj, Yj = jax.device_put(X), jax.device_put(Y)
    reps, rounds = a["reps"], a["rounds"]
    tiny = best_of_rounds({
        "plain_numpy": lambda: float(f_plain(X, Y)),
        "plain_device": lambda: float(f_plain(Xj, Yj)),
        "synk_data": lambda: float(f(Xd, Yd)),
        "synk_numpy": lambda: float(f(X, Y)),
    }, reps, rounds)
    mlp = {}
    for B in a["batches"]:
        XM, YM = XS[:B].copy(), YS[:B].copy()
        XMd, YMd = synk.data(XM), synk.data(YM)
        sel = np.arange(B, dtype=np.int64)
        mlp[str(B)] = best_of_rounds({
            "plain_numpy": lambda: float(step_plain(XM, YM)),
            "synk_data": lambda: float(step(XMd, YMd)),
            "plain_resident": lambda: float(step_plain_s(sel)),
            "synk_resident": lambda: float(step_s(batch_s=sel)),
        }, max(5, reps // 20), rounds)
    device = str(jax.devices()[0])
    from synkhronos.backends.jax import pinning
    pinned = pinning.status()
    synk.close()
    return {"device": device, "ranks": [r.rank for r in dev.ranks], "tiny": tiny, "mlp": mlp,
            "mlp_shape": [a["n_in"], a["hidden"], a["hidden"], 10], "pinning": pinned}


def c_allreduce(a):
    import jax
    import pytensor
    import synkhronos as synk
    from synkhronos import session
    n, plat = a["n"], a["platform"]
    fork(n, plat)
    v = pytensor.shared(np.zeros(1, "float32"), name="v")
    synk.function([], v.sum())                  # (registers v)
    synk.distribute()
    me = session.get_session().me
    comm = me.comm.pick("all_reduce", "float32", "sum", me.device.placement).name
    rows = []
    for size in a["sizes"]:
        count = size // 4
        synk.scatter(v, np.ones(count * n, "float32"))          # every rank: `count` elements
        reps = 50 if size <= MB else (20 if size <= 64 * MB else 5)
        if a.get("quick"):
            reps = max(3, reps // 5)

        def once():
            synk.all_reduce(v, "sum")
        t = median_time(once, reps, warm=2)
        busbw = size * 2 * (n - 1) / n / t if n > 1 else None
        rows.append({"bytes": size, "seconds": t, "algbw": size / t, "busbw": busbw})
    val = float(np.asarray(synk.get_value(0, v))[0])
    assert np.isfinite(val)
    out = {"n": n, "comm": comm, "device": str(jax.devices()[0]), "rows": rows,
           "storage": type(v.container.storage[0]).__name__}
    synk.close()
    return out


def c_demo(a):
    sys.path.insert(0, os.path.join(ROOT, "demos"))  # the demos' folder: their model builders
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    import layers                           # demos/layers.py (pytensor-ml)
    from losses import picked               # demos/losses.py
    n, plat = a["n"], a["platform"]
    fork(n, plat)
    h = w = a["image"]
    B = a["batch"]
    # one rank's rows as static shapes (the demos themselves compile without them: JAX traces
    # every shape anyway)
    x = pt.tensor("x", dtype="float32", shape=(B // n, h * w))
    y = pt.tensor("y", dtype="int32", shape=(B // n,))
    if a["model"] == "cnn":
        model = layers.cnn(x, h, w)
    else:
        model = layers.resnet(x, h, w)
    logp = pt.special.log_softmax(model.logits, axis=-1)
    loss = -pt.mean(picked(logp, y, 10))
    stat_updates = list(getattr(model, "stat_updates", []))

    def rule(loss_, params_, **kw):
        g_upd, p_upd, g_shared = updates.adam(loss_, params_, **kw)
        return list(g_upd) + stat_updates, p_upd, g_shared
    step = train.make_train_function(loss, model.params, [x, y], rule, learning_rate=1e-3)
    synk.distribute()
    rng = np.random.default_rng(0)
    X = rng.uniform(0, 1, (B, h * w)).astype("float32")
    Y = rng.integers(0, 10, B).astype("int32")
    Xd, Yd = synk.data(X), synk.data(Y)
    t_first = time.perf_counter()
    step(Xd, Yd)
    step.serial(X, Y)
    t_first = time.perf_counter() - t_first
    times = best_of_rounds({"synk": lambda: float(step(Xd, Yd)),
                            "plain": lambda: float(step.serial(X, Y))}, a["reps"], a["rounds"])
    import jax
    out = {"model": model.description, "n": n, "batch": B, "image": h, "device": str(jax.devices()[0]),
           "step_s": times, "first_calls_s": t_first}
    synk.close()
    return out


def c_profile(a):
    import cProfile
    import pstats

    import pytensor
    import pytensor.tensor as pt
    import synkhronos as synk
    fork(1, a["platform"])
    sys.path.insert(0, os.path.join(ROOT, "demos"))  # the demos' folder: the demo's model builder
    from losses import picked                   # demos/losses.py
    from mnist_mlp import mlp_params            # the demo's MLP (demos/mnist_mlp.py)
    x, y = pt.fmatrix("x"), pt.fvector("y")
    z = pt.mean(x.dot(y), axis=0)
    f = synk.function([x], z, bcast_inputs=[y])
    f_plain = pytensor.function([x, y], z, mode="JAX")
    xm, ym = pt.fmatrix("xm"), pt.ivector("ym")
    params, forward = mlp_params([784, 1024, 1024, 10], 0)
    loss = -pt.mean(picked(pt.special.log_softmax(forward(xm), axis=1), ym, 10))
    ups = [(p, p - np.float32(0.01) * g) for p, g in zip(params, pytensor.grad(loss, params))]
    step = synk.function([xm, ym], loss, updates=ups)
    step_plain = pytensor.function([xm, ym], loss, updates=ups, mode="JAX")
    synk.distribute()
    rng = np.random.default_rng(0)
    X, Y = rng.standard_normal((8, 4)).astype("float32"), rng.standard_normal(4).astype("float32")
    XM = rng.standard_normal((256, 784)).astype("float32")
    YM = rng.integers(0, 10, 256).astype("int32")
    Xd, Yd, XMd, YMd = synk.data(X), synk.data(Y), synk.data(XM), synk.data(YM)
    cases = {"tiny, synk (Data)": lambda: float(f(Xd, Yd)), "tiny, plain (numpy)": lambda: float(f_plain(X, Y)),
             "MLP B=256, synk (Data)": lambda: float(step(XMd, YMd)),
             "MLP B=256, plain (numpy)": lambda: float(step_plain(XM, YM))}
    out = {}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        calls = a["calls"]
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        wall = (time.perf_counter() - t) / calls
        st = pstats.Stats(prof)
        rows = []
        for (file, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
            where = f"{os.path.relpath(file, ROOT) if file.startswith(ROOT) else os.path.basename(file)}:{line}"
            rows.append((tt / calls, ct / calls, nc / calls, f"{func} ({where})"))
        rows.sort(reverse=True)
        out[name] = {"per_call_s": wall, "top": rows[:a["top"]]}
    synk.close()
    return out


CHILDREN = {"overhead": c_overhead, "allreduce": c_allreduce, "demo": c_demo, "profile": c_profile}


# ---- the parent: runs, tables, results ------------------------------------------------------------

def fmt_t(s):
    return f"{s * 1e6:8.1f} us" if s < 1e-3 else f"{s * 1e3:8.2f} ms"


def fmt_bw(b):
    return "       -" if b is None else f"{b / 1e9:8.2f}"


GOALS = []       # (figure, measured, goal, met): the summary table at the end


def goal(figure, measured, target, fmt="{:.3f}x", higher=True):
    met = measured >= target if higher else measured <= target
    GOALS.append((figure, fmt.format(measured), ("\u2265 " if higher else "\u2264 ") + fmt.format(target), met))
    return "OK" if met else "BELOW GOAL"


def torch_python():
    """The interpreter of the PyTorch contender: ``$TORCH_PYTHON``, else this one when it
    has PyTorch, else ``benchmarks/.torch-venv``'s (``bench_training.py --torch`` makes it);
    None when there is none."""
    import importlib.util
    if os.environ.get("TORCH_PYTHON"):
        return os.environ["TORCH_PYTHON"]
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    venv = os.path.join(HERE, ".torch-venv", "bin", "python")
    return venv if os.path.exists(venv) else None


def run_torch(shape, batches, quick):
    """The MLP step in PyTorch on this machine's GPU (else its CPU), batches from host
    memory (``_torch_train.py device``): {batch: seconds a step} and what ran, or an error."""
    py = torch_python()
    if py is None:
        return {"error": "PyTorch not installed (pip install torch, or TORCH_PYTHON=an interpreter that has it)"}
    cmd = [py, os.path.join(HERE, "_torch_train.py"), "device", "--sizes", ",".join(map(str, shape)),
           "--batches", ",".join(map(str, batches)), "--rule", "sgd", "--lr", "0.01",
           "--reps", "3" if quick else "7", "--steps", "20" if quick else "50"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: " + " | ".join((p.stderr or "").strip().splitlines()[-5:])}
    return json.loads(lines[-1])


def run_overhead(plat, quick):
    args = {"platform": plat, "n_in": 784, "hidden": 1024, "batches": [256, 4096],
            "reps": 200 if quick else 1000, "rounds": 2 if quick else 3}
    r = child("overhead", args)
    print("\n== function throughput: synkhronos n=1 vs plain PyTensor JAX, same device")
    if "error" in r:
        print("  FAILED:", r["error"])
        return r
    t = r["tiny"]
    print(f"  device {r['device']}; shared memory page-locked for the GPU: {r.get('pinning')}")
    print(f"  tiny function  plain (numpy in) {fmt_t(t['plain_numpy'])}   plain (device in) {fmt_t(t['plain_device'])}")
    print(f"                 synk (Data)      {fmt_t(t['synk_data'])}   synk (numpy)      {fmt_t(t['synk_numpy'])}")
    print(f"                 added per call: {1e6 * (t['synk_data'] - t['plain_numpy']):.1f} us (Data), "
          f"{1e6 * (t['synk_numpy'] - t['plain_numpy']):.1f} us (numpy)")
    shape = "-".join(map(str, r["mlp_shape"]))
    for B, m in r["mlp"].items():
        ratio = m["plain_numpy"] / m["synk_data"]
        res = m["plain_resident"] / m["synk_resident"]
        print(f"  MLP {shape} SGD step, batch {B}, batch from host memory: plain {fmt_t(m['plain_numpy'])}"
              f"  synk {fmt_t(m['synk_data'])}  ratio {ratio:.3f}x (goal >= 0.95x)  "
              f"{goal(f'MLP step B={B}, host batches: synk n=1 / plain JAX', ratio, 0.95)}")
        print(f"  {' ' * len(shape)}      batch {B}, data set on the device (batch_s): plain "
              f"{fmt_t(m['plain_resident'])}  synk {fmt_t(m['synk_resident'])}  ratio {res:.3f}x (goal >= 0.98x)  "
              f"{goal(f'MLP step B={B}, data on the device: synk n=1 / plain JAX', res, 0.98)}")
    t = r["torch"] = run_torch(r["mlp_shape"], [int(B) for B in r["mlp"]], quick)
    if "error" in t:
        print(f"  PyTorch: not measured ({t['error']})")
        return r
    where = t["gpu"] or "the CPU"
    print(f"  PyTorch {t['torch']} on {where} ({'TF32 matmuls, ' if t['tf32'] else ''}page-locked host batches, "
          f"the loss read every step), same MLP and SGD step:")
    for row in t["rows"]:
        m = r["mlp"].get(str(row["batch"]))
        if m is None:
            continue
        print(f"    batch {row['batch']}: PyTorch {fmt_t(row['s_per_step'])}   synk / PyTorch throughput "
              f"{row['s_per_step'] / m['synk_data']:.3f}x   plain PyTensor JAX / PyTorch "
              f"{row['s_per_step'] / m['plain_numpy']:.3f}x" + ("" if t["gpu"] or plat == "cpu" else
                                                                "  (PyTorch on the CPU: not comparable)"))
    return r


def run_allreduce(plat, n_gpus, quick, max_mb):
    sizes = [4 * KB] + [s * MB for s in (1, 4, 16, 64, 256, 1024) if s <= max_mb]
    configs = [("n=1", 1, {}, False)]           # (label, ranks, environment, held to the 10 GB/s goal)
    if plat == "gpu":
        if n_gpus >= 2:
            configs.append(("n=2 XLA/NCCL", 2, {"SYNK_JAX_COMM": "xla"}, False))
            configs.append(("n=2 host-staged", 2, {"SYNK_JAX_COMM": "staged"}, True))
        else:
            configs.append(("n=2 on one GPU, host-staged (NCCL refuses one GPU twice), adding on the GPU", 2,
                            {"SYNK_GPUS": "0,0"}, True))
            configs.append(("same, into the slots by JAX's read and a host copy (SYNK_STAGED_COPY=jax)", 2,
                            {"SYNK_GPUS": "0,0", "SYNK_STAGED_COPY": "jax"}, False))
            configs.append(("same, adding on the host (SYNK_STAGED_REDUCE=host)", 2,
                            {"SYNK_GPUS": "0,0", "SYNK_STAGED_REDUCE": "host"}, False))
    else:
        configs.append(("n=2 host-staged (default on CPU)", 2, {"SYNK_JAX_COMM": "staged"}, True))
        configs.append(("same, adding on the device (SYNK_STAGED_REDUCE=device, the GPUs' default)", 2,
                        {"SYNK_JAX_COMM": "staged", "SYNK_STAGED_REDUCE": "device"}, False))
        configs.append(("n=2 XLA gloo (SYNK_JAX_COMM=xla)", 2, {"SYNK_JAX_COMM": "xla"}, False))
    print(f"\n== all_reduce float32 sum ({plat})")
    out = {}
    for label, n, env, held in configs:
        r = child("allreduce", {"n": n, "platform": plat, "sizes": sizes, "quick": quick}, env)
        out[label] = r
        if "error" in r:
            print(f"  {label}: FAILED: {r['error']}")
            continue
        print(f"  {label}: comm '{r['comm']}', device {r['device']}, storage {r['storage']}")
        print("        size        time   algbw GB/s  busbw GB/s")
        for row in r["rows"]:
            size = row["bytes"]
            s = f"{size // KB} KB" if size < MB else f"{size // MB} MB"
            print(f"    {s:>8}  {fmt_t(row['seconds'])}    {fmt_bw(row['algbw'])}    {fmt_bw(row['busbw'])}")
        if held:
            at = {row["bytes"]: row for row in r["rows"]}
            if 64 * MB in at and at[64 * MB]["busbw"]:
                goal(f"all_reduce 64 MB, {label}: busbw GB/s", at[64 * MB]["busbw"] / 1e9, 10.0, fmt="{:.2f}")
            if 4 * KB in at:
                GOALS.append((f"all_reduce 4 KB, {label}: latency", fmt_t(at[4 * KB]["seconds"]).strip(),
                              "(reported)", True))
    return out


def run_demos(plat, quick):
    batch = 256 if plat == "gpu" else 64
    print("\n== demo models: training step, synkhronos n=1 vs plain PyTensor JAX (same graphs, same device)")
    out = {}
    for model, image in (("cnn", 8), ("resnet", 8)):
        r = child("demo", {"model": model, "n": 1, "platform": plat, "batch": batch, "image": image,
                           "reps": 5 if quick else 20, "rounds": 2 if quick else 3})
        out[model] = r
        if "error" in r:
            print(f"  {model}: FAILED: {r['error']}")
            continue
        s = r["step_s"]
        ratio = s["plain"] / s["synk"]
        r["ratio"] = ratio
        print(f"  {r['model']}, batch {r['batch']}: plain {fmt_t(s['plain'])}  synk {fmt_t(s['synk'])}  "
              f"ratio {ratio:.3f}x (goal >= 0.95x)  {goal(f'{model} step: synk n=1 / plain JAX', ratio, 0.95)}  "
              f"({r['device']}; first calls {r['first_calls_s']:.1f} s)")
    return out


def run_profile(plat, quick):
    r = child("profile", {"platform": plat, "calls": 300 if quick else 1000, "top": 18})
    print("\n== where a call's time goes (cProfile of the master; per call, profiled: slower than unprofiled)")
    if "error" in r:
        print("  FAILED:", r["error"])
        return r
    for name, c in r.items():
        print(f"  {name}: {fmt_t(c['per_call_s'])} a call")
        print("        own        total   calls  function")
        for own, total, calls, func in c["top"]:
            print(f"    {fmt_t(own)}  {fmt_t(total)}  {calls:6.1f}  {func}")
    return r


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        res = CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="all", choices=("all", "overhead", "allreduce", "demos", "profile"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-mb", type=int, default=None,
                    help="largest all_reduce (default: 1024 on GPUs, 256 on the CPU)")
    a = ap.parse_args()
    plat, n_gpus, visible, missing = platform()
    if plat == "gpu":
        print(f"GPU mode: {n_gpus} GPU(s) visible ({', '.join(visible)})")
    else:
        why = "no GPU visible" if not visible else f"{len(visible)} GPU(s) visible but {missing}"
        print(f"CPU mode ({why}): PyTensor's JAX backend on CPU ranks; GPU figures need a GPU machine")
    max_mb = a.max_mb or (1024 if plat == "gpu" else 256)
    results = {"platform": plat, "gpus": visible, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    name = f"gpu_check_{plat}{'_profile' if a.what == 'profile' else ''}.json"
    parts = {"overhead": lambda: run_overhead(plat, a.quick),
             "allreduce": lambda: run_allreduce(plat, n_gpus, a.quick, max_mb),
             "demos": lambda: run_demos(plat, a.quick)}
    for part, run in parts.items():
        if a.what in ("all", part):
            results[part] = run()
            write_results(results, name, OUT)     # (each part as it ends: a run stopped later keeps it)
    if a.what == "profile":
        results["profile"] = run_profile(plat, a.quick)
    if GOALS:
        print("\n== goals (issue 21)")
        w = max(len(g[0]) for g in GOALS)
        for figure, measured, target, met in GOALS:
            print(f"  {figure:<{w}}  {measured:>10}  goal {target:<10} {'OK' if met else 'BELOW GOAL'}")
        results["goals"] = [dict(zip(("figure", "measured", "goal", "met"), g)) for g in GOALS]
    path = write_results(results, name, OUT)
    print(f"\nresults: {os.path.relpath(path, ROOT)}")
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Function-call benchmarks for synkhronos on CPU workers (issue 2).

1. Per-call overhead: a tiny function at n=2 against calling the PyTensor function directly.
2. Speedup of a compute-bound function (gradient of an MLP, float32, batch 4096) at n=2
   against one plain PyTensor process with one BLAS thread and with all cores.
3. Start-up: distribute() + first call against one process's compile + first call, cold
   (empty PyTensor/numba cache) and warm.

Prints tables (ratios taken in one run: these machines are noisy) and saves
benchmarks/results/function.png.  Usage: python benchmarks/bench_function.py [--quick]"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from common import RESULTS, call_times, pyplot, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
# the demos' folder: mlp_graph builds the demo's MLP (demos/mnist_mlp.py)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "demos"))


def median_time(fn, reps, inner=1):
    return float(np.median(call_times(fn, reps, inner)))


def mlp_graph(n_in, hidden, n_out):
    import pytensor
    import pytensor.tensor as pt
    from mnist_mlp import mlp_params            # the demo's MLP (demos/mnist_mlp.py)
    x = pt.fmatrix("x")
    y = pt.ivector("y")
    params, forward = mlp_params([n_in, hidden, hidden, n_out], 0)
    h = forward(x)
    p = pt.special.softmax(h, axis=1)
    loss = -pt.mean(pt.log(p[pt.arange(y.shape[0]), y] + 1e-7))
    grads = pytensor.grad(loss, params)
    flat = pt.concatenate([g.flatten() for g in grads])
    return x, y, loss, flat


def overhead(args):
    import pytensor
    import pytensor.tensor as pt
    import synkhronos as synk
    x = pt.fmatrix("x")
    y = pt.fvector("y")
    z = pt.mean(x.dot(y), axis=0)
    f_th = pytensor.function([x, y], z)
    f = synk.function([x], bcast_inputs=[y], outputs=z)
    return f, f_th


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller MLP")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--n-in", type=int, default=256)
    ap.add_argument("--skip-startup", action="store_true")
    args = ap.parse_args()
    if "--child" in sys.argv:
        return
    from threadpoolctl import threadpool_limits
    from tqdm import tqdm
    import synkhronos as synk
    cores = len(os.sched_getaffinity(0))
    reps = 5 if args.quick else 15
    hidden = 256 if args.quick else args.hidden
    rows = {}
    prog = tqdm(total=4 + (0 if args.skip_startup else 4), desc="bench_function")
    n = synk.fork(2)
    f_tiny, f_tiny_th = overhead(args)
    x, y, loss, flat = mlp_graph(args.n_in, hidden, 10)
    f_grad = synk.function([x, y], outputs=[loss, flat])
    synk.distribute()
    xt = np.random.default_rng(1).standard_normal((8, 4)).astype("float32")
    yt = np.random.default_rng(2).standard_normal(4).astype("float32")
    xd, yd = synk.data(xt), synk.data(yt)
    f_tiny(xd, yd), f_tiny_th(xt, yt)
    inner = 2000
    t_synk = median_time(lambda: f_tiny(xd, yd), reps, inner)
    t_np = median_time(lambda: f_tiny(xt, yt), reps, inner // 4)
    t_th = median_time(lambda: f_tiny_th(xt, yt), reps, inner)
    prog.update()
    rows["overhead"] = dict(pytensor_us=t_th * 1e6, synk_data_us=t_synk * 1e6, synk_numpy_us=t_np * 1e6,
                            added_us=(t_synk - t_th) * 1e6, added_numpy_us=(t_np - t_th) * 1e6)

    rng = np.random.default_rng(3)
    X = rng.standard_normal((args.batch, args.n_in)).astype("float32")
    Y = rng.integers(0, 10, args.batch).astype("int32")
    Xd, Yd = synk.data(X), synk.data(Y)
    f_grad(Xd, Yd)                      # JIT (master first), workers load from cache
    f_grad.as_theano(X, Y)
    r_reps = max(3, reps // 3)
    t_par = median_time(lambda: f_grad(Xd, Yd), r_reps)
    prog.update()
    with threadpool_limits(limits=1):
        t_1 = median_time(lambda: f_grad.as_theano(X, Y), r_reps)
    prog.update()
    with threadpool_limits(limits=cores):
        t_all = median_time(lambda: f_grad.as_theano(X, Y), r_reps)
    prog.update()
    out_par = f_grad(Xd, Yd)
    out_ser = f_grad.as_theano(X, Y)
    err = float(np.max(np.abs(out_par[1] - out_ser[1])) / (np.max(np.abs(out_ser[1])) + 1e-12))
    rows["speedup"] = dict(batch=args.batch, hidden=hidden, n=n, synk_s=t_par, serial_1thread_s=t_1,
                           serial_allcores_s=t_all, speedup_vs_1thread=t_1 / t_par,
                           speedup_vs_allcores=t_all / t_par, max_rel_err=err, cores=cores)
    synk.close()

    if not args.skip_startup:
        rows["startup"] = startup(args, hidden, prog)
    prog.close()
    report(rows)


STARTUP_CHILD = r"""
import sys, time, json, numpy as np
t0 = time.perf_counter()
sys.path.insert(0, {here!r})
from bench_function import mlp_graph
import pytensor
mode = sys.argv[1]
x, y, loss, flat = mlp_graph({n_in}, {hidden}, 10)
X = np.random.default_rng(3).standard_normal(({batch}, {n_in})).astype("float32")
Y = np.random.default_rng(4).integers(0, 10, {batch}).astype("int32")
t1 = time.perf_counter()
if mode == "serial":
    f = pytensor.function([x, y], [loss, flat])
    f(X, Y)
else:
    import synkhronos as synk
    synk.fork(2)
    t1 = time.perf_counter()
    f = synk.function([x, y], outputs=[loss, flat])
    synk.distribute()
    f(synk.data(X), synk.data(Y))
t2 = time.perf_counter()
print(json.dumps(dict(total=t2 - t0, build_and_first_call=t2 - t1)))
"""


def startup(args, hidden, prog):
    code = STARTUP_CHILD.format(here=HERE, n_in=args.n_in, hidden=hidden, batch=min(args.batch, 1024))
    out = {}
    with tempfile.TemporaryDirectory(prefix="synk_bench_cache_") as cold_dir:
        for cache in ("cold", "warm"):
            for mode in ("serial", "synk"):
                env = dict(os.environ)
                # a fresh, empty PyTensor/numba cache for each cold run; then the warm re-run
                d = os.path.join(cold_dir, mode)
                env["PYTENSOR_FLAGS"] = f"base_compiledir={d}"
                r = subprocess.run([sys.executable, "-c", code, mode], env=env, capture_output=True,
                                   text=True, timeout=900)
                if r.returncode != 0:
                    raise RuntimeError(r.stderr[-2000:])
                out[f"{mode}_{cache}"] = json.loads(r.stdout.strip().splitlines()[-1])["build_and_first_call"]
                prog.update()
    return out


def report(rows):
    o, s = rows["overhead"], rows["speedup"]
    print("\nPer-call overhead, tiny function (8x4 matrix . vector, mean), n=2")
    print(f"  {'plain PyTensor call':34s} {o['pytensor_us']:8.1f} us")
    print(f"  {'synk call, Data inputs':34s} {o['synk_data_us']:8.1f} us   (+{o['added_us']:.1f} us)")
    print(f"  {'synk call, numpy inputs':34s} {o['synk_numpy_us']:8.1f} us   (+{o['added_numpy_us']:.1f} us)")
    print(f"\nCompute-bound MLP gradient, float32, batch {s['batch']}, hidden {s['hidden']}, "
          f"n={s['n']} on {s['cores']} cores")
    print(f"  {'synk (n=2, 1 thread each)':34s} {s['synk_s'] * 1e3:8.1f} ms")
    print(f"  {'plain PyTensor, 1 thread':34s} {s['serial_1thread_s'] * 1e3:8.1f} ms   "
          f"speedup {s['speedup_vs_1thread']:.2f}x")
    print(f"  {'plain PyTensor, all cores':34s} {s['serial_allcores_s'] * 1e3:8.1f} ms   "
          f"speedup {s['speedup_vs_allcores']:.2f}x")
    print(f"  max relative difference of the gradient vs serial: {s['max_rel_err']:.2e}")
    if "startup" in rows:
        st = rows["startup"]
        print("\nStart-up: build + first call (s)      cold cache   warm cache")
        print(f"  {'one PyTensor process':34s} {st['serial_cold']:8.2f}   {st['serial_warm']:8.2f}")
        print(f"  {'synk n=2 (function+distribute+call)':34s} {st['synk_cold']:8.2f}   {st['synk_warm']:8.2f}")
    write_results(rows, "function.json")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    ax[0].bar(["PyTensor", "synk Data", "synk numpy"],
              [o["pytensor_us"], o["synk_data_us"], o["synk_numpy_us"]], color=["gray", "C0", "C1"])
    ax[0].set_ylabel("µs per call")
    ax[0].set_title("per-call time, tiny function, n=2")
    ax[1].bar(["PyTensor 1 thr", "PyTensor all cores", "synk n=2"],
              [s["serial_1thread_s"] * 1e3, s["serial_allcores_s"] * 1e3, s["synk_s"] * 1e3],
              color=["gray", "silver", "C0"])
    ax[1].set_ylabel("ms per call")
    ax[1].set_title(f"MLP gradient, batch {s['batch']}")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "function.png"), dpi=110)
    print(f"\nsaved {os.path.join(RESULTS, 'function.png')}")


if __name__ == "__main__":
    main()

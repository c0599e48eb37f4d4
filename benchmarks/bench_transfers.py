"""Host <-> device copies of one JAX device, by every mechanism at hand: what bounds the
host-staged collectives of GPU ranks (device -> host shared memory -> device).

Mechanisms (each one tried, skipped with its error where it does not work):

* ``jax``: ``jax.device_put`` of a numpy array / ``np.asarray`` of a device array (pageable
  host memory: what a plain PyTensor JAX call does);
* ``pinned_host``: through JAX's ``pinned_host`` memory kind (a device_put to pinned host
  memory, then a numpy view of it: DLPack, else ``np.asarray``);
* ``driver``: the CUDA driver API on host memory registered with ``cuMemHostRegister``
  (what a shared-memory slot can be), copying straight from/to the JAX array's device buffer;
* ``torch``: PyTorch pinned/pageable copies, the reference where PyTorch is installed.

Usage: python benchmarks/bench_transfers.py [--sizes-mb 64,256] ; prints a table, writes
benchmarks/results/transfers_<gpu|cpu>.json."""
import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

from common import call_times, write_results

from synkhronos.backends.shm.parallel import split_run

MB = 1 << 20


def best(fn, reps=5):
    fn()                             # (warm)
    return min(call_times(fn, reps))


def try_(rows, name, nbytes, fn, check=None):
    try:
        t = best(fn)
        ok = check() if check else True
        rows.append({"how": name, "bytes": nbytes, "seconds": t, "GBps": nbytes / t / 1e9, "ok": bool(ok)})
    except Exception as e:             # noqa: BLE001 - reported
        rows.append({"how": name, "bytes": nbytes, "error": f"{type(e).__name__}: {str(e)[:300]}"})


def driver():
    """The CUDA driver API (libcuda), with this process's primary context current."""
    cu = ctypes.CDLL("libcuda.so.1")

    def chk(r, what):
        if r != 0:
            s = ctypes.c_char_p()
            cu.cuGetErrorString(r, ctypes.byref(s))
            raise RuntimeError(f"{what}: CUDA error {r} {s.value}")
    chk(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    chk(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    chk(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    chk(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cu.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cu.chk = chk
    return cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="64,256")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding
    dev = jax.devices()[0]
    plat = dev.platform
    info = {"device": str(dev), "platform": plat, "jax": jax.__version__,
            "memories": [str(m) for m in dev.addressable_memories()]}
    print(json.dumps(info))
    rows = []
    dsh = SingleDeviceSharding(dev)
    sizes = [4 << 10] + [int(s) * MB for s in a.sizes_mb.split(",")]
    cu = None
    try:
        cu = driver() if plat == "gpu" else None
    except Exception as e:             # noqa: BLE001
        info["driver_error"] = repr(e)
    for nbytes in sizes:
        n = nbytes // 4
        host = np.arange(n, dtype=np.float32)
        d = jax.device_put(host, dev).block_until_ready()
        try_(rows, "jax device_put H2D (pageable)", nbytes, lambda: jax.device_put(host, dev).block_until_ready())
        # a D2H of a device array is cached on the array: each timed copy gets a fresh one
        fresh = [(d + 1).block_until_ready() for _ in range(14)]
        try_(rows, "jax np.asarray D2H (pageable)", nbytes, lambda: np.asarray(fresh.pop()))
        try_(rows, "jax device_get D2H", nbytes, lambda: jax.device_get(fresh.pop()))
        del fresh
        # pinned_host memory kind
        try:
            psh = SingleDeviceSharding(dev, memory_kind="pinned_host")
            box = {}

            def d2p():
                box["p"] = jax.device_put(d, psh).block_until_ready()
            try_(rows, "pinned_host D2H (device_put to pinned)", nbytes, d2p)
            p = box["p"]
            ps = [jax.device_put(d, psh).block_until_ready() for _ in range(7)]
            try_(rows, "pinned_host -> numpy np.asarray", nbytes, lambda: np.asarray(ps.pop()))
            try:
                v = np.from_dlpack(p)
                info[f"dlpack_zero_copy_{nbytes}"] = bool(v.ctypes.data == p.unsafe_buffer_pointer())
                info[f"dlpack_writeable_{nbytes}"] = bool(v.flags.writeable)
                info[f"dlpack_ok_{nbytes}"] = bool(np.array_equal(v[:100], host[:100]))
                try_(rows, "pinned_host -> numpy from_dlpack", nbytes, lambda: np.from_dlpack(p))
            except Exception as e:      # noqa: BLE001
                info["dlpack_error"] = f"{type(e).__name__}: {e}"
            try_(rows, "numpy -> pinned_host device_put", nbytes, lambda: jax.device_put(host, psh).block_until_ready())
            try_(rows, "pinned_host -> device device_put", nbytes,
                 lambda: jax.device_put(p, dsh).block_until_ready(),
                 lambda: bool(np.array_equal(np.asarray(jax.device_put(p, dsh))[-5:], host[-5:])))
        except Exception as e:          # noqa: BLE001
            rows.append({"how": "pinned_host", "bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
        # driver API on registered (page-locked) host memory, straight to/from JAX's buffers
        if cu is not None:
            try:
                import mmap
                buf = mmap.mmap(-1, nbytes)
                hv = np.frombuffer(buf, np.float32)
                ptr = hv.ctypes.data
                t = time.perf_counter()
                cu.chk(cu.cuMemHostRegister_v2(ptr, nbytes, 0), "register")
                info[f"register_s_{nbytes}"] = time.perf_counter() - t
                src = d.unsafe_buffer_pointer()
                try_(rows, "driver D2H into registered", nbytes,
                     lambda: cu.chk(cu.cuMemcpyDtoH_v2(ptr, src, nbytes), "DtoH"),
                     lambda: bool(np.array_equal(hv, host)))
                hv[:] = host * 2
                fresh = {}

                def h2d():  # noqa: E306
                    z = jnp.zeros_like(d).block_until_ready()
                    cu.chk(cu.cuMemcpyHtoD_v2(z.unsafe_buffer_pointer(), ptr, nbytes), "HtoD")
                    fresh["z"] = z
                try_(rows, "driver H2D from registered (fresh zeros + copy)", nbytes, h2d,
                     lambda: bool(np.array_equal(np.asarray(fresh["z"]), host * 2)))
                zz = jnp.zeros_like(d).block_until_ready()
                try_(rows, "jnp.zeros_like alone", nbytes, lambda: jnp.zeros_like(d).block_until_ready())
                try_(rows, "driver H2D only", nbytes,
                     lambda: cu.chk(cu.cuMemcpyHtoD_v2(zz.unsafe_buffer_pointer(), ptr, nbytes), "HtoD"))
                try_(rows, "jax device_put H2D from registered (page-locked)", nbytes,
                     lambda: jax.device_put(hv, dev).block_until_ready())
                cu.chk(cu.cuMemHostUnregister(ptr), "unregister")
                del hv
                buf.close()
            except Exception as e:      # noqa: BLE001
                rows.append({"how": "driver", "bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
        # numpy reduction speed (the host side of a staged all_reduce)
        other = host.copy()
        out = np.empty_like(host)
        try_(rows, "numpy add (host reduction, per input byte)", nbytes, lambda: np.add(host, other, out=out))
        for k in (2, 4, 8):             # a rank's share on k threads (backends/shm/parallel.py)
            if k <= (os.cpu_count() or 1):
                try_(rows, f"numpy add on {k} threads (split_run)", nbytes,
                     lambda k=k: split_run(lambda a, b: np.add(host[a:b], other[a:b], out=out[a:b]), 0, n, 4, k))
        try_(rows, "numpy copy (memcpy)", nbytes, lambda: np.copyto(out, host))
        try:
            import torch
            if torch.cuda.is_available():
                tp = torch.empty(n, dtype=torch.float32, pin_memory=True)
                tg = torch.empty(n, dtype=torch.float32, device="cuda")
                tq = torch.from_numpy(host)
                try_(rows, "torch H2D pinned", nbytes, lambda: (tg.copy_(tp), torch.cuda.synchronize()))
                try_(rows, "torch D2H pinned", nbytes, lambda: (tp.copy_(tg), torch.cuda.synchronize()))
                try_(rows, "torch H2D pageable", nbytes, lambda: (tg.copy_(tq), torch.cuda.synchronize()))
                try_(rows, "torch D2H pageable", nbytes, lambda: (tq.copy_(tg), torch.cuda.synchronize()))
        except Exception as e:          # noqa: BLE001
            info["torch_error"] = repr(e)[:200]
    for r in rows:
        if "error" in r:
            print(f"  {r['bytes'] // 1024:>8} KB  {r['how']:<50} ERROR {r['error']}")
        else:
            print(f"  {r['bytes'] // 1024:>8} KB  {r['how']:<50} {r['seconds'] * 1e3:9.3f} ms "
                  f"{r['GBps']:8.2f} GB/s {'' if r['ok'] else 'WRONG VALUES'}")
    print(json.dumps(info))
    out = os.environ.get("OUT")
    res = {"info": info, "rows": rows}
    write_results(res, f"transfers_{plat}.json")
    if out:
        write_results(res, f"transfers_{plat}.json", folder=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

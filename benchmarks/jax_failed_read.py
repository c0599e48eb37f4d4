"""Does reading the result of a failed JAX computation raise, or hang?  Run on a GPU machine.

A synkhronos rank waits for a call's results (``jax.block_until_ready``) before it reads
them, because reading a failed computation's buffer hung on JAX's CPU device (JAX 0.12: an
out-of-memory product, read: no return in 120 s; waited for: ``RESOURCE_EXHAUSTED`` at
once).  That wait is one synchronisation with the device more than a plain call's read.
This probe says, for the device JAX picks here, where an out-of-memory computation fails:
at its dispatch, at the wait, or at the read, and whether the read returns at all.

    python benchmarks/jax_failed_read.py [--gib N]   (default: 2x the device's memory)

Prints one line per case; exits 0.  Only for accelerators: on a CPU the allocation could
succeed lazily and the kernel's OOM killer end the machine's programs instead."""
import argparse
import os
import sys
import threading
import time


def attempt(fn, timeout):
    """``fn()`` in a thread: ("ok", value) | ("raised", text) | ("hung", seconds)."""
    box = {}

    def run():
        try:
            box["ok"] = fn()
        except BaseException as e:     # noqa: BLE001 - reported
            box["raised"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return "hung", f"no return in {timeout} s"
    return ("raised", box["raised"]) if "raised" in box else ("ok", "returned")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None)
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        print("jax_failed_read: no accelerator (CPU device): not run (see the docstring)")
        return 0
    stats = dev.memory_stats() or {}
    limit = stats.get("bytes_limit", 80 << 30)
    gib = a.gib or 2 * limit / 2 ** 30
    n = int(np.sqrt(gib * 2 ** 30 / 4))
    print(f"device {dev} ({dev.device_kind}), JAX {jax.__version__}; memory limit {limit / 2 ** 30:.1f} GiB; "
          f"outer product of {n} float32: {4 * n * n / 2 ** 30:.1f} GiB")
    x = jnp.ones(n, jnp.float32)
    x.block_until_ready()
    cases = {
        "big output": jax.jit(lambda v: jnp.outer(v, v) + 1.0),
        "small output of a big temporary": jax.jit(lambda v: jnp.sort((jnp.outer(v, v) + v[0]).ravel())[:4]),
    }
    for name, f in cases.items():
        for how in ("wait, then read", "read"):
            t0 = time.perf_counter()
            try:
                y = f(x)
            except Exception as e:     # noqa: BLE001 - reported
                print(f"  {name}, {how}: raised at dispatch ({time.perf_counter() - t0:.2f} s): "
                      f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}")
                continue
            if how == "wait, then read":
                kind, text = attempt(lambda: jax.block_until_ready(y), a.timeout)
                print(f"  {name}, {how}: wait {kind} ({time.perf_counter() - t0:.2f} s): {text}")
                if kind != "ok":
                    continue
            kind, text = attempt(lambda: np.asarray(y), a.timeout)
            print(f"  {name}, {how}: read {kind} ({time.perf_counter() - t0:.2f} s): {text}")
            if kind == "hung":
                print("  (a read hung: the device may be unusable; stopping)")
                sys.stdout.flush()
                os._exit(0)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

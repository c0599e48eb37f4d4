"""Choosing a session's device and number of ranks from ``fork()``'s arguments (validated
here, in the master, before anything starts): CPU cores (numba or JAX) or one GPU per rank."""
import os

import numpy as np

from .host.device import usable_cores
from .host import gpus as host_gpus
from .registry import implementation


def _count_arg(n_parallel):
    if n_parallel is None:
        return None
    if isinstance(n_parallel, (bool, np.bool_)) or not isinstance(n_parallel, (int, np.integer)):
        raise TypeError(f"n_parallel must be a positive int or None, got {n_parallel!r}")
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be at least 1, got {n_parallel}")
    return int(n_parallel)


PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")


def select_device(n_parallel, use_gpu, mode=None, local_n=None, matmul_precision=None):
    """Pick the device and the number of ranks, validating the request in the master.

    ``mode``: PyTensor's compile mode for the ranks; None is numba on CPU cores, "JAX"
    runs PyTensor's JAX backend (on the CPU unless GPUs are used).  ``matmul_precision``:
    JAX's float32 matmul precision in every rank (JAX ranks only)."""
    n_parallel = _count_arg(n_parallel)
    if matmul_precision is not None and matmul_precision not in PRECISIONS:
        raise ValueError(f"matmul_precision must be None (JAX's own setting) or one of {list(PRECISIONS)}, "
                         f"got {matmul_precision!r}")
    if mode is not None and (not isinstance(mode, str) or mode.upper() not in ("JAX", "NUMBA")):
        raise ValueError(f"mode must be None, 'NUMBA' or 'JAX', got {mode!r}")
    jax_mode = mode is not None and mode.upper() == "JAX"
    if use_gpu is None:
        use_gpu = host_gpus.gpu_count() > 0 and (mode is None or jax_mode)
    if use_gpu:
        if mode is not None and not jax_mode:
            raise ValueError(f"use_gpu=True runs PyTensor's JAX backend on the GPUs; mode={mode!r} cannot "
                             "run there (leave mode unset or use 'JAX')")
        return _gpu_device(n_parallel, matmul_precision)
    if matmul_precision is not None and not jax_mode:
        raise ValueError(f"matmul_precision={matmul_precision!r} sets JAX's matmul precision; these ranks run "
                         "numba (use mode='JAX' or GPUs, or leave it unset)")
    if jax_mode and not host_gpus.jax_installed():
        raise RuntimeError("mode='JAX' runs PyTensor's JAX backend, but JAX is not installed: "
                           "pip install 'synkhronos[jax]' (or 'synkhronos[gpu]' for GPUs)")
    cls = implementation("device", "jax" if jax_mode else "cpu")
    if n_parallel is None:
        n_parallel = usable_cores()
    kw = {} if local_n is None else {"local_n": local_n}
    if jax_mode:
        kw["matmul_precision"] = matmul_precision
    return cls(n_parallel, **kw)


def _gpu_device(n_parallel, matmul_precision=None):
    """The GPU device for ``n_parallel`` ranks (one GPU each), or an error saying what is
    missing and how to get it."""
    gpus = host_gpus.visible_gpus()
    missing = host_gpus.gpu_backend_missing()
    problems = []
    if not gpus:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        problems.append("no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={env!r})" if env is not None else
                                               " (no NVIDIA driver: /proc/driver/nvidia/gpus and "
                                               "nvidia-smi found none)"))
    if missing:
        problems.append(f"{missing}; install the GPU extra: {host_gpus.GPU_EXTRA}")
    if problems:
        raise RuntimeError("use_gpu=True but " + " and ".join(problems) +
                           ". Use use_gpu=None or False for CPU ranks.")
    ranks = os.environ.get("SYNK_GPUS")
    if ranks:                  # explicit GPU per rank (may repeat: then collectives go through the host)
        chosen = [t.strip() for t in ranks.split(",") if t.strip()]
        unknown = [g for g in chosen if g not in gpus]
        if unknown:
            raise ValueError(f"SYNK_GPUS={ranks!r} names GPU(s) {unknown} that are not visible; visible: "
                             f"{gpus}")
        if n_parallel is not None and n_parallel != len(chosen):
            raise ValueError(f"n_parallel={n_parallel} but SYNK_GPUS={ranks!r} gives {len(chosen)} rank(s)")
    else:
        n = len(gpus) if n_parallel is None else n_parallel
        if n > len(gpus):
            limited = "; CUDA_VISIBLE_DEVICES limits them" if "CUDA_VISIBLE_DEVICES" in os.environ else ""
            raise ValueError(f"n_parallel={n} asks for {n} GPUs (one per rank) but {len(gpus)} "
                             f"{'is' if len(gpus) == 1 else 'are'} visible ({', '.join(gpus)}"
                             f"{limited}). "
                             f"Use n_parallel <= {len(gpus)}, or use_gpu=False for CPU ranks.")
        chosen = gpus[:n]
    return implementation("device", "jax")(len(chosen), platform="gpu", gpus=chosen, visible=gpus,
                                           matmul_precision=matmul_precision)

"""The GPUs of this host and whether the GPU backend (JAX with CUDA) is installed, found
without importing JAX or initialising CUDA (a forked session must choose before any of it)."""
import os
import shutil
import subprocess

GPU_EXTRA = "pip install 'synkhronos[gpu]'  (JAX with its CUDA 12 wheels: jax[cuda12])"


def visible_gpus():
    """The GPUs this process may use, as the ids a worker's ``CUDA_VISIBLE_DEVICES`` takes,
    found without initialising CUDA here: the driver's GPUs (``/proc/driver/nvidia/gpus``,
    else ``nvidia-smi -L``), restricted by ``CUDA_VISIBLE_DEVICES`` when it is set.  Empty
    when there are none."""
    physical = _driver_gpu_count()
    if physical == 0:
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(physical)]
    ids = []
    for tok in env.split(","):
        tok = tok.strip()
        if tok.isdigit():
            if int(tok) >= physical or tok in ids:
                break                    # CUDA ignores the list from the first invalid entry on
        elif not tok.startswith(("GPU-", "MIG-")):
            break
        ids.append(tok)
    return ids


def _driver_gpu_count():
    try:
        return len([e for e in os.listdir("/proc/driver/nvidia/gpus") if not e.startswith(".")])
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def jax_installed():
    import importlib.util
    try:
        return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None
    except (ImportError, ValueError):
        return False


def gpu_backend_missing():
    """None when JAX with CUDA support is installed, else what is missing (no import of
    JAX, no CUDA initialisation)."""
    import importlib.util

    def have(mod):
        try:
            return importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            return False
    if not have("jax") or not have("jaxlib"):
        return "JAX is not installed"
    if not (have("jax_cuda12_plugin") or have("jax_plugins.xla_cuda12") or have("jax_cuda13_plugin")
            or have("jax_plugins.xla_cuda13")):
        return "JAX is installed without its CUDA plugin (jax[cuda12])"
    return None


def gpu_count():
    """Number of GPUs the GPU backend can use: the visible GPUs, or 0 when there are none or
    the backend (JAX with CUDA) is not installed.  Never initialises CUDA."""
    if gpu_backend_missing() is not None:
        return 0
    return len(visible_gpus())

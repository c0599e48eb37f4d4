"""Choosing GPUs without a GPU: the count (never initialising CUDA), the errors of
``fork(use_gpu=True)`` (no GPU, no GPU extra, more ranks than GPUs), what each GPU rank's
process is started with, and how collectives are routed (NCCL through XLA, or the host with
a one-time warning saying why).  GPUs are simulated by monkeypatching the driver's count."""
import numpy as np
import pytest

import synkhronos as synk
from synkhronos import backends as dv
from synkhronos.backends.host import gpus as host_gpus


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(k, backend=True)``: the driver shows ``k`` GPUs; JAX's CUDA plugin installed or not."""
    def set_(k, backend=True):
        monkeypatch.setattr(host_gpus, "_driver_gpu_count", lambda: k)
        monkeypatch.setattr(host_gpus, "gpu_backend_missing",
                            lambda: None if backend else "JAX is installed without its CUDA plugin (jax[cuda12])")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SYNK_GPUS", raising=False)
    monkeypatch.delenv("SYNK_GPU_MEM_FRACTION", raising=False)
    monkeypatch.delenv("SYNK_JAX_COMM", raising=False)
    for v in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
              "XLA_PYTHON_CLIENT_ALLOCATOR"):
        monkeypatch.delenv(v, raising=False)
    return set_


def test_get_n_gpu_is_exported_and_counts(gpus):
    gpus(3)
    assert synk.get_n_gpu() == 3 == host_gpus.gpu_count()
    gpus(3, backend=False)
    assert synk.get_n_gpu() == 0          # not usable without the backend
    gpus(0)
    assert synk.get_n_gpu() == 0


def test_count_follows_cuda_visible_devices(gpus, monkeypatch):
    gpus(4)
    for env, want in [("", []), ("2", ["2"]), ("3,1", ["3", "1"]), ("0,7,1", ["0"]), ("-1", []),
                      ("1,1", ["1"]), ("GPU-8f2a,GPU-77c1", ["GPU-8f2a", "GPU-77c1"])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert host_gpus.visible_gpus() == want, env
    gpus(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert host_gpus.visible_gpus() == []                # no driver: the variable alone is no GPU


def test_count_does_not_start_cuda_or_jax(monkeypatch):
    """The real count on this machine: it reads the driver, never JAX's backend."""
    import sys
    had = "jax" in sys.modules
    host_gpus.gpu_count()
    host_gpus.visible_gpus()
    assert had or "jax" not in sys.modules


def test_use_gpu_without_a_gpu_says_so(gpus):
    gpus(0)
    with pytest.raises(RuntimeError) as e:
        synk.fork(use_gpu=True)
    msg = str(e.value)
    assert "no GPU is visible" in msg and "use_gpu=None or False" in msg
    assert "pip install" not in msg
    assert synk.session_info() is None


def test_use_gpu_without_the_extra_says_how_to_install(gpus):
    gpus(2, backend=False)
    with pytest.raises(RuntimeError) as e:
        synk.fork(use_gpu=True)
    msg = str(e.value)
    assert "CUDA plugin" in msg and "pip install 'synkhronos[gpu]'" in msg and "no GPU" not in msg


def test_use_gpu_with_neither_names_both(gpus):
    gpus(0, backend=False)
    with pytest.raises(RuntimeError) as e:
        synk.fork(use_gpu=True)
    assert "no GPU is visible" in str(e.value) and "synkhronos[gpu]" in str(e.value)


def test_more_ranks_than_gpus(gpus, monkeypatch):
    gpus(1)
    with pytest.raises(ValueError) as e:
        synk.fork(n_parallel=2, use_gpu=True)
    assert "asks for 2 GPUs" in str(e.value) and "1 is visible" in str(e.value)
    gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    with pytest.raises(ValueError) as e:
        synk.fork(n_parallel=3, use_gpu=True)
    assert "2 are visible (1, 3" in str(e.value) and "CUDA_VISIBLE_DEVICES" in str(e.value)
    assert synk.session_info() is None


def test_gpu_and_numba_mode_conflict(gpus):
    gpus(2)
    with pytest.raises(ValueError, match="JAX backend"):
        synk.fork(use_gpu=True, mode="NUMBA")


def test_jax_mode_without_jax_says_how_to_install(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setattr(host_gpus, "jax_installed", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'synkhronos\[jax\]'"):
        synk.fork(2, mode="JAX")
    assert synk.session_info() is None


def test_default_falls_back_to_cpu_without_backend(gpus):
    gpus(2, backend=False)
    d = dv.select_device(2, None)
    assert d.kind == "cpu"
    gpus(0)
    assert dv.select_device(2, None, "JAX").platform == "cpu"


def test_gpu_ranks_environment(gpus, monkeypatch):
    gpus(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    d = dv.select_device(None, True)
    assert d.kind == "jax" and d.platform == "gpu" and d.n == 2 and d.gpus == ["2", "3"]
    env = d.worker_env(1)
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["JAX_PLATFORMS"].startswith("cuda")
    cfg = d.config()
    again = dv.make_device(cfg, 2)
    assert again.config() == cfg
    monkeypatch.setenv("SYNK_GPU_MEM_FRACTION", "0.45")
    env = dv.select_device(2, True).worker_env(0)
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.45"
    monkeypatch.setenv("SYNK_GPU_MEM_FRACTION", "2")
    with pytest.raises(ValueError, match="SYNK_GPU_MEM_FRACTION"):
        dv.select_device(2, True)
    monkeypatch.delenv("SYNK_GPU_MEM_FRACTION")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".3")      # the user's own setting stands
    env = dv.select_device(2, True).worker_env(0)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env and "XLA_CLIENT_MEM_FRACTION" not in env


def test_collectives_route_nccl_or_host(gpus, monkeypatch):
    from synkhronos.backends.jax import runtime as jd
    gpus(2)
    d = dv.select_device(2, True)
    monkeypatch.setattr(jd, "jax_started", lambda: False)
    assert d.plan_comm(0) is True
    assert d.xla["address"].startswith("127.0.0.1:") and d.xla["master_rank"] == 0
    assert d.worker_env(1)["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == "1"
    assert d.process_id(0) == 0 and d.process_id(1) == 1
    d = dv.select_device(2, True)
    assert d.plan_comm(1) is True and d.process_id(1) == 0     # the master is process 0
    # two ranks on one GPU: NCCL cannot, the host path serves, saying why
    monkeypatch.setenv("SYNK_GPUS", "0,0")
    d = dv.select_device(None, True)
    assert d.gpus == ["0", "0"] and d.plan_comm(0) is False and "share a GPU" in d.why_staged
    monkeypatch.setenv("SYNK_JAX_COMM", "xla")
    with pytest.raises(RuntimeError, match="share a GPU"):
        dv.select_device(None, True).plan_comm(0)
    monkeypatch.setenv("SYNK_GPUS", "0,5")
    with pytest.raises(ValueError, match="not visible"):
        dv.select_device(None, True)
    monkeypatch.delenv("SYNK_GPUS")
    monkeypatch.delenv("SYNK_JAX_COMM")
    # JAX already running in the master: host path on GPUs
    monkeypatch.setattr(jd, "jax_started", lambda: True)
    d = dv.select_device(2, True)
    assert d.plan_comm(0) is False and "before synk.fork()" in d.why_staged
    # on the CPU the host path is the default; SYNK_JAX_COMM=xla selects XLA's
    monkeypatch.setattr(jd, "jax_started", lambda: False)
    d = dv.select_device(2, False, "JAX")
    assert d.plan_comm(0) is False and "faster" in d.why_staged


def test_staged_path_warns_once_on_gpus(capsys):
    from synkhronos.backends.jax import staged_comm

    class Host:
        n = 2

        def accepts(self, verb, dtype, op=None, placement="host"):
            return placement == "host"

    class Dev:
        platform = "gpu"
        placement = "device"
    staged_comm._warned.clear()
    c = staged_comm.StagedComm(Host(), Dev(), why="ranks share a GPU (GPUs by rank: 0,0)")
    assert c.accepts("all_reduce", np.float32, "sum", "device")
    assert c.accepts("broadcast", np.float32, None, "device")
    assert not c.accepts("all_reduce", np.float32, "sum", "host")
    err = capsys.readouterr().err
    assert err.count("not NCCL") == 1 and "share a GPU" in err
    Dev.platform = "cpu"
    c = staged_comm.StagedComm(Host(), Dev(), why="x")
    staged_comm._warned.clear()
    c.accepts("all_reduce", np.float32, "sum", "device")
    assert capsys.readouterr().err == ""

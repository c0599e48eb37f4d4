"""The planes' written contracts (``synkhronos.launcher``, ``control``, ``comm``,
``device``, ``channel``) against every implementation in ``backends.registry``:

* every method of every contract exists with exactly the contract's signature;
* the behaviour checks of ``synkhronos.conformance`` pass on every rank under every wiring
  (one host with numba ranks, JAX ranks through the host, JAX ranks through XLA's own
  collectives, and two MPI processes under ``mpiexec``), and between them every registered
  implementation was checked;
* the ``subprocess`` launcher reports a killed and a stopped process (the ``mpi``
  launcher's reports are tested across hosts in ``test_mpi.py``)."""
import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import synk_testutil as tu
from synkhronos import backends as registry      # (the composition root re-exports the registry)
from synkhronos.launcher import RankGone

from mpi_testutil import HERE, MPIEXEC, mpi_env

SCRIPT = os.path.join(HERE, "_contract_script.py")

IMPLEMENTATIONS = [(plane, name) for plane, names in registry.REGISTRY.items() for name in names]


def _members(protocol):
    """The methods a protocol declares (its own and its bases'), with their signatures."""
    out = {}
    for klass in reversed(protocol.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            if isinstance(value, staticmethod):
                out[name] = inspect.signature(value.__func__)
            elif callable(value):
                out[name] = inspect.signature(value)
    return out


def _same(want, got):
    """Parameter names, kinds and defaults alike (``self`` aside; annotations not compared)."""
    def strip(sig):
        return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]
    return strip(want) == strip(got)


@pytest.mark.parametrize("plane,name", IMPLEMENTATIONS)
def test_signatures_keep_the_contract(plane, name):
    cls = registry.implementation(plane, name)
    problems = []
    for protocol in registry.contracts(plane, name):
        for member, sig in _members(protocol).items():
            impl = inspect.getattr_static(cls, member, None)
            if impl is None:
                problems.append(f"{protocol.__name__}.{member} is missing")
                continue
            fn = impl.__func__ if isinstance(impl, (staticmethod, classmethod)) else impl
            if isinstance(impl, property):
                continue
            if not _same(sig, inspect.signature(fn)):
                problems.append(f"{protocol.__name__}.{member}{sig} but {cls.__name__}.{member}"
                                f"{inspect.signature(fn)}")
    assert not problems, "\n".join(problems)


# ---- behaviour, under every wiring -----------------------------------------------------------

WIRINGS = {
    "numba": dict(env={}, n=3),
    "jax-staged": dict(env={"SYNK_MODE": "JAX", "SYNK_JAX_COMM": "staged"}, n=2),
    "jax-xla": dict(env={"SYNK_MODE": "JAX", "SYNK_JAX_COMM": "xla"}, n=2),
    "mpi": dict(env={}, n=3, mpi=2),
}


@functools.cache
def wiring(name):
    """The contract checks' result under wiring ``name`` (run once per test session)."""
    w = WIRINGS[name]
    env = {k: v for k, v in os.environ.items() if k not in ("SYNK_MODE", "SYNK_JAX_COMM")}
    env.update(w["env"])
    cmd = [sys.executable, SCRIPT, str(w["n"])]
    if w.get("mpi"):
        if not os.path.exists(MPIEXEC):
            pytest.skip("no mpiexec next to the interpreter (pip install 'synkhronos[mpi]')")
        env = mpi_env(env)
        cmd = [MPIEXEC, "-n", str(w["mpi"])] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=HERE)
    lines = [ln.split("CONTRACT ", 1)[1] for ln in p.stdout.splitlines() if "CONTRACT " in ln]
    assert p.returncode == 0 and lines, f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", list(WIRINGS))
def test_every_check_passes(name):
    if name.startswith("jax"):
        pytest.importorskip("jax")
    result = wiring(name)
    failed = [row for row in result["checks"] if row[4] is not None]
    assert result["checks"] and not failed, "\n".join(f"{p}/{i} {c} on rank {r}: {x}" for p, i, c, r, x in failed)
    ranks = {row[3] for row in result["checks"]}
    assert ranks == set(range(WIRINGS[name]["n"])), f"checks ran on ranks {ranks}"


def test_every_implementation_is_checked():
    pytest.importorskip("jax")
    seen = {plane: set() for plane in registry.REGISTRY}
    checked = {plane: set() for plane in registry.REGISTRY}
    for name in WIRINGS:
        result = wiring(name)
        for plane, names in result["implementations"].items():
            seen[plane] |= set(names)
        for plane, impl, *_ in result["checks"]:
            checked[plane].add(impl)
    for plane, names in registry.REGISTRY.items():
        assert seen[plane] == set(names), f"{plane}: wired {sorted(seen[plane])}, registered {sorted(names)}"
        assert checked[plane] >= set(names), f"{plane}: checked {sorted(checked[plane])}, registered {sorted(names)}"


# ---- the subprocess launcher's reports -------------------------------------------------------------


def test_subprocess_launcher_excuses_only_a_clean_exit_of_a_leaving_rank():
    """``check(leaving)``: a rank told to quit that exited with status 0 is not a loss; one
    that exited otherwise is, and so is a clean exit of a rank not told to quit."""
    launcher = registry.implementation("launcher", "subprocess")()
    code = {1: "0", 2: "3"}
    launcher.start([1, 2], lambda r: [sys.executable, "-c", f"raise SystemExit({code[r]})"],
                   lambda r: dict(os.environ))
    try:
        pids = {r: p for r, _, p in launcher.info()}
        tu.wait_until(lambda: all(not tu.pid_running(p) for p in pids.values()), 10.0)
        with pytest.raises(RankGone) as gone:
            launcher.check(leaving={1})
        assert gone.value.rank == 2 and gone.value.returncode == 3
        with pytest.raises(RankGone) as gone:
            launcher.check(leaving={2})
        assert gone.value.rank == 1 and gone.value.returncode == 0
    finally:
        launcher.stop(graceful=False)


def test_subprocess_launcher_reports_dead_and_stopped():
    launcher = registry.implementation("launcher", "subprocess")()
    argv = lambda r: [sys.executable, "-c", "import time; time.sleep(60)"]  # noqa: E731
    launcher.start([1, 2], argv, lambda r: dict(os.environ))
    try:
        info = launcher.info()
        assert [r for r, _, _ in info] == [1, 2] and all(h == launcher.host and p > 0 for _, h, p in info)
        launcher.check()                                     # both alive
        pids = {r: p for r, _, p in info}
        os.kill(pids[2], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankGone) as gone:
            while time.monotonic() - t0 < 5:
                launcher.check()
                time.sleep(0.05)
        assert gone.value.rank == 2 and gone.value.stopped >= 1.0 and gone.value.returncode is None
        os.kill(pids[2], signal.SIGCONT)
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(RankGone) as gone:
            launcher.check()
        assert gone.value.rank == 1 and gone.value.returncode == -signal.SIGKILL
    finally:
        launcher.stop(graceful=False)
    assert all(not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z"
               for p in pids.values())

#!/usr/bin/env bash
# Set up (scripts/setup.sh test docs demos jax mpi), lint (ruff) and run the test suite. Extra args go to
# pytest. Slow tests are deselected unless -m is given or SYNK_SLOW=1.
# Then the functional tests (marker "functional", see tests/conftest.py) run a second time
# on PyTensor's JAX backend (SYNK_MODE=JAX); SYNK_JAX_PASS=0 skips that pass, and it is
# skipped when -m is given.
# Both passes run in parallel processes (pytest-xdist, one test module per process at a time):
# SYNK_TEST_PROCS of them (default: the usable cores, at most 4; 1: none).
# Shared memory or processes left behind by the sessions of this run fail it.
# numba compiles at NUMBA_OPT=1 (default here), with caches of the run's own (see below).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1

bash scripts/setup.sh test docs demos jax mpi   # demos, docs, JAX and several machines are tested too

# the linter first (its configuration: pyproject.toml, [tool.ruff]); a finding fails the run
if ! .venv/bin/ruff check --quiet .; then
    echo "synkhronos test: ruff found problems (see above; 'ruff check --fix .' fixes some)" >&2
    exit 1
fi

args=("$@")
have_m=0
for a in "$@"; do
    case "$a" in
        -m|-m*) have_m=1 ;;
    esac
done
if [[ $have_m -eq 0 && "${SYNK_SLOW:-0}" != "1" ]]; then
    args=(-m "not slow" "${args[@]}")
fi

# numba compiles the tests' many small graphs at LLVM level 1, not 3: the same results, about
# a fifth less time on a cold cache (measured: 55 against 70 s for test_updates +
# test_collectives, 114 against 134 s for the numba demo tests), and speed is never asserted.
# Such code must not land in your own cache (the numba cache does not key on the level):
# the run keeps its caches in a compiledir of its own, unless you chose one.
export NUMBA_OPT="${NUMBA_OPT:-1}"
if [[ "${PYTENSOR_FLAGS:-}" != *base_compiledir* ]]; then
    export PYTENSOR_FLAGS="${PYTENSOR_FLAGS:+$PYTENSOR_FLAGS,}base_compiledir=${HOME}/.pytensor/synk-tests-O${NUMBA_OPT}"
fi

# every session this run makes (here and in the programs it starts) logs its prefix here,
# so that the leak check below looks at this run only, not at other programs of this user
SYNK_PREFIX_LOG="$(mktemp -t synk-test-prefixes.XXXXXXXX)"
export SYNK_PREFIX_LOG
trap 'rm -f "$SYNK_PREFIX_LOG" "$SYNK_PREFIX_LOG".*' EXIT

procs="${SYNK_TEST_PROCS:-$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
par=()
if [[ "$procs" -gt 1 ]]; then
    par=(-n "$procs" --dist loadfile)
fi

rc=0
start=$SECONDS
.venv/bin/python -m pytest ${par[@]+"${par[@]}"} --durations=25 "${args[@]}" || rc=$?
echo "synkhronos test: main pass took $((SECONDS - start)) s ($procs process(es))"
if [[ $rc -eq 5 ]]; then
    echo "synkhronos test: pytest collected no tests (exit 5) -- treating as failure" >&2
    rc=1
fi

# second pass: the functional tests on PyTensor's JAX backend (CPU ranks)
if [[ "${SYNK_JAX_PASS:-1}" != "0" && $have_m -eq 0 ]]; then
    jmark="functional and not slow"
    [[ "${SYNK_SLOW:-0}" == "1" ]] && jmark="functional"
    echo "synkhronos test: functional tests again with SYNK_MODE=JAX (-m \"$jmark\")"
    jstart=$SECONDS
    jrc=0
    SYNK_MODE=JAX .venv/bin/python -m pytest ${par[@]+"${par[@]}"} -m "$jmark" "$@" || jrc=$?
    echo "synkhronos test: JAX pass took $((SECONDS - jstart)) s"
    if [[ $jrc -ne 0 && $jrc -ne 5 ]]; then   # 5: the arguments selected no functional test
        rc=$jrc
    fi
fi

if ! .venv/bin/python scripts/leakcheck.py "$SYNK_PREFIX_LOG"; then
    echo "synkhronos test: resource leak detected -- failing" >&2
    exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# One command to check the GPU backend (PyTensor's JAX backend, one GPU per rank, collectives
# through NCCL) on a machine with a GPU; without one it runs in CPU mode and says so.
#
#   benchmarks/gpu_check.sh [--quick] [--max-mb N] [--no-tests] [--no-jax-suite] [--no-measure]
#                            [--demos] [--gpu-demos] [--profile] [--budget SECONDS] [--out DIR]
#
# 1. the backend's tests: the GPU tests (tests/test_jax_gpu.py, skipped without a GPU), the
#    JAX device and XLA-collective tests on CPU ranks, and the functional suite with
#    SYNK_MODE=JAX on CPU ranks (GPUs hidden for those);
# 2. benchmarks/gpu_check.py: function throughput synkhronos n=1 vs plain PyTensor JAX on the
#    same device, all_reduce bus bandwidth 1 MB .. 1 GB (n=1; n=2 through NCCL with two GPUs,
#    else n=2 on one GPU through the host), the CNN and ResNet demo models' step times.
# Prints tables; results in benchmarks/results/gpu_check_<gpu|cpu>.json and
# benchmarks/results/gpu_check_<gpu|cpu>.log (another folder: GPU_CHECK_RESULTS=DIR).
# 3. --demos: every bundled demo with its default arguments; --gpu-demos: the MLP, CNN and
#    ResNet demos with --gpu-size, and ResNet-50 for a few steps; their RESULT lines, warnings
#    and times (each demo's whole output in benchmarks/results/gpu_check_<gpu|cpu>_demos.log);
# 4. --profile: where a call's time goes, synkhronos n=1 against plain PyTensor JAX (cProfile),
#    and whether reading a failed computation raises or hangs (benchmarks/jax_failed_read.py).
# --no-jax-suite leaves out the tests on JAX CPU ranks (CI runs them) but the GPU selection's;
# --no-measure leaves out step 2.
#
# Order: the measurements first (the goals table), then the tests, the demos, the profile and
# the --gpu-demos workloads.  --budget SECONDS: a stage starts only while time is left for it
# and is stopped when the budget runs out (for a lent machine whose time is short: what did
# not run is listed at the end); --out DIR: the results and logs of this run are copied to DIR
# after every stage, so that a run stopped from outside still leaves what it measured.
#
# Python: $PYTHON, else .venv/bin/python (scripts/setup.sh test demos jax [gpu]), else python3.
# It needs synkhronos' dependencies (pytensor, numpy, posix_ipc, threadpoolctl, tqdm), jax
# (with its CUDA plugin on a GPU machine: the 'gpu' extra, or jax-cuda13-plugin), pytest,
# pytest-timeout and hypothesis, and pytensor-ml for the demo models.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1

run_tests=1
jax_suite=1
measure=1
run_demos=0
gpu_demos=0
run_profile=0
budget=0
out_dir=""
args=()
while [[ $# -gt 0 ]]; do
    a="$1"
    shift
    case "$a" in
        --budget|--out)
            if [[ $# -eq 0 ]]; then echo "gpu_check: $a needs a value" >&2; exit 2; fi
            if [[ "$a" == --budget ]]; then budget="$1"; else out_dir="$1"; fi
            shift ;;
        --no-tests) run_tests=0 ;;
        --no-jax-suite) jax_suite=0 ;;
        --no-measure) measure=0 ;;
        --demos) run_demos=1 ;;
        --gpu-demos) gpu_demos=1 ;;
        --profile) run_profile=1 ;;
        *) args+=("$a") ;;
    esac
done
if ! [[ "$budget" =~ ^[0-9]+$ ]]; then
    echo "gpu_check: --budget takes whole seconds, got '$budget'" >&2
    exit 2
fi

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi

missing="$("$PY" - <<'EOF'
import importlib.util as u
need = ["numpy", "pytensor", "posix_ipc", "threadpoolctl", "tqdm", "jax", "pytest", "pytest_timeout",
        "hypothesis", "pytensor_ml"]
print(" ".join(m for m in need if u.find_spec(m) is None))
EOF
)"
if [[ -n "$missing" ]]; then
    echo "gpu_check: $PY lacks: $missing" >&2
    echo "gpu_check: install them (scripts/setup.sh test demos jax gpu, or pip install from wheels where the machine is offline) or set PYTHON" >&2
    exit 2
fi

mode="$("$PY" - <<'EOF'
import sys
sys.path.insert(0, ".")
from synkhronos.backends.host.gpus import gpu_backend_missing, gpu_count, visible_gpus
n, vis, miss = gpu_count(), visible_gpus(), gpu_backend_missing()
if n:
    print(f"GPU mode: {n} GPU(s) ({', '.join(vis)})")
elif vis:
    print(f"CPU mode: {len(vis)} GPU(s) visible but {miss}: install the gpu extra to check them")
else:
    print("CPU mode: no GPU visible; the GPU paths are not exercised (only their CPU counterparts)")
EOF
)"
echo "gpu_check: $mode (python: $PY)"
plat=cpu
[[ "$mode" == GPU* ]] && plat=gpu
RESULTS="${GPU_CHECK_RESULTS:-benchmarks/results}"      # (where this run writes; gpu_check.py too)
export GPU_CHECK_RESULTS="$RESULTS"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check_${plat}.log"
: > "$LOG"

SYNK_PREFIX_LOG="$(mktemp -t synk-gpucheck-prefixes.XXXXXXXX)"
export SYNK_PREFIX_LOG
STARTED="$(mktemp -t synk-gpucheck-start.XXXXXXXX)"     # (what this run wrote is newer)
trap 'rm -f "$SYNK_PREFIX_LOG" "$STARTED"' EXIT

rc=0
T_START=$SECONDS
skipped=()
if [[ -n "$out_dir" ]]; then
    mkdir -p "$out_dir" || { echo "gpu_check: cannot make $out_dir" >&2; exit 2; }
fi

# Seconds left of --budget (a large number without one).
left() {
    if [[ $budget -eq 0 ]]; then echo 1000000; else echo $((budget - (SECONDS - T_START))); fi
}

# The results and logs of this run into --out (after every stage).
save() {
    [[ -z "$out_dir" ]] && return 0
    local f
    for f in "$RESULTS"/gpu_check_"${plat}"*; do
        [[ -f "$f" && "$f" -nt "$STARTED" ]] && cp -p "$f" "$out_dir/"
    done
    return 0
}

# stage NAME SECONDS FUNCTION: run FUNCTION when at least SECONDS of the budget are left,
# stopped (TERM, then KILL) when the budget runs out; else note it as skipped.
stage() {
    local name="$1" need="$2" fn="$3" t0=$SECONDS remaining
    remaining="$(left)"
    if [[ $remaining -lt $need ]]; then
        skipped+=("$name (needs ~${need} s, ${remaining} s left)")
        echo "== $name: skipped, ${remaining} s of the budget left (needs ~${need} s)" | tee -a "$LOG"
        return 0
    fi
    if [[ $budget -eq 0 ]]; then
        "$fn" || rc=1
    else
        export -f "$fn"
        timeout -k 10 "$remaining" bash -o pipefail -c "$fn" || { local c=$?; rc=1
            [[ $c -eq 124 || $c -eq 137 ]] && echo "== $name: stopped, the budget ran out" | tee -a "$LOG"; }
    fi
    echo "   ($name: $((SECONDS - t0)) s)" | tee -a "$LOG"
    save
}

do_measure() {
    echo "== measurements" | tee -a "$LOG"
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_check.py all $CHECK_ARGS 2>&1 | tee -a "$LOG"
}

do_tests() {
    local bad=0 start
    echo "== tests: GPU ranks" | tee -a "$LOG"
    "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_jax_gpu.py 2>&1 | tee -a "$LOG" || bad=1
    if [[ $jax_suite -eq 1 ]]; then
        echo "== tests: JAX device and XLA collectives on CPU ranks" | tee -a "$LOG"
        CUDA_VISIBLE_DEVICES= "$PY" -m pytest -q -p no:cacheprovider tests/test_jax_backend.py \
            tests/test_jax_xla_comm.py tests/test_gpu_selection.py 2>&1 | tee -a "$LOG" || bad=1
        echo "== tests: functional suite with SYNK_MODE=JAX (CPU ranks)" | tee -a "$LOG"
        start=$SECONDS
        CUDA_VISIBLE_DEVICES= SYNK_MODE=JAX "$PY" -m pytest -q -p no:cacheprovider -m "functional and not slow" \
            2>&1 | tail -n 15 | tee -a "$LOG" || bad=1
        echo "   ($((SECONDS - start)) s)" | tee -a "$LOG"
    else
        echo "== tests: GPU selection" | tee -a "$LOG"
        "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_selection.py 2>&1 | tail -n 3 | tee -a "$LOG" || bad=1
    fi
    return $bad
}

do_profile() {
    local bad=0
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_check.py profile $CHECK_ARGS 2>&1 | tee -a "$LOG" || bad=1
    echo "== reading a failed computation: raises or hangs? (why a call waits before it reads)" | tee -a "$LOG"
    timeout 120 "$PY" benchmarks/jax_failed_read.py 2>&1 | grep -v '^[IWE]0000' | tee -a "$LOG"
    return $bad
}

# run_demos DEMO...: each bundled demo with its arguments; RESULT line, warnings, time.
run_demos() {
    local demo start out code result warned bad=0 limit
    for demo in "$@"; do
        start=$SECONDS
        limit="${DEMO_TIMEOUT:-300}"
        echo "-- python demos/$demo" >> "$DEMO_LOG"
        # shellcheck disable=SC2086
        out="$(timeout "$limit" "$PY" demos/$demo 2>&1)"
        code=$?
        printf '%s\n' "$out" >> "$DEMO_LOG"
        result="$(printf '%s\n' "$out" | grep -m1 '^RESULT' || true)"
        if [[ -z "$result" ]]; then
            result="(no RESULT line; last: $(printf '%s\n' "$out" | grep -v '^\s*$' | tail -n 1))"
        fi
        warned="$(printf '%s\n' "$out" | grep -ci 'warning')"
        [[ $code -eq 124 ]] && result="(timed out after $limit s) $result"
        [[ $code -ne 0 ]] && bad=1
        printf 'demos/%s: exit %s, %s s, %s warning line(s)\n    %s\n' "$demo" "$code" "$((SECONDS - start))" \
            "$warned" "$result" | tee -a "$LOG"
    done
    return $bad
}

do_demos() {
    echo "== demos" | tee -a "$LOG"
    run_demos "mnist_mlp.py --no-progress" "mnist_cnn.py --no-progress" "resnet.py --no-progress" "partial_fc.py" \
        "exchange_strategies.py --plot $RESULTS/gpu_check_${plat}_exchange.png"
}

do_gpu_demos() {
    echo "== demos: --gpu-size workloads and ResNet-50" | tee -a "$LOG"
    run_demos "mnist_mlp.py --no-progress --gpu-size" "mnist_cnn.py --no-progress --gpu-size" \
        "resnet.py --no-progress --gpu-size" "resnet.py --no-progress --resnet50 --epochs 1 --max-steps 5"
}

DEMO_LOG="$RESULTS/gpu_check_${plat}_demos.log"
if [[ $run_demos -eq 1 || $gpu_demos -eq 1 ]]; then
    : > "$DEMO_LOG"
fi
CHECK_ARGS="${args[*]:-}"       # (gpu_check.py's options: plain words)
export PY LOG DEMO_LOG plat jax_suite CHECK_ARGS
export -f run_demos
# (the least time each stage needs to say something useful, measured on the H200: the
# measurements ~100 s, the tests ~130 s, the five demos ~140 s)
[[ $measure -eq 1 ]] && stage measurements 60 do_measure
[[ $run_tests -eq 1 ]] && stage tests 60 do_tests
[[ $run_demos -eq 1 ]] && stage demos 60 do_demos
[[ $run_profile -eq 1 ]] && stage profile 30 do_profile
[[ $gpu_demos -eq 1 ]] && stage gpu-demos 60 do_gpu_demos
if [[ $run_demos -eq 1 || $gpu_demos -eq 1 ]]; then
    echo "   (each demo's whole output: $DEMO_LOG)" | tee -a "$LOG"
fi

if ! "$PY" scripts/leakcheck.py "$SYNK_PREFIX_LOG" >/dev/null 2>&1; then
    echo "gpu_check: shared memory or processes were left behind" | tee -a "$LOG"
    rc=1
fi
if [[ ${#skipped[@]} -gt 0 ]]; then
    echo "gpu_check: not run for lack of time (--budget $budget):" | tee -a "$LOG"
    printf '    %s\n' "${skipped[@]}" | tee -a "$LOG"
fi
echo "gpu_check: $mode; $((SECONDS - T_START)) s; log: $LOG; exit $rc" | tee -a "$LOG"
save
exit $rc

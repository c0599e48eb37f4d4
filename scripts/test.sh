#!/usr/bin/env bash
# Set up (scripts/setup.sh test docs demos) and run the test suite. Extra args go to
# pytest. Slow tests are deselected unless -m is given or SYNK_SLOW=1.
# Leftover /dev/shm/synk* segments or synkhronos.worker processes fail the run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1

bash scripts/setup.sh test docs demos   # demos and docs are tested too

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

rc=0
.venv/bin/python -m pytest "${args[@]}" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "synkhronos test: pytest collected no tests (exit 5) -- treating as failure" >&2
    rc=1
fi

leak=0
shm="$(find /dev/shm -maxdepth 1 \( -name 'synk*' -o -name 'sem.synk*' \) -user "$(id -u)" 2>/dev/null || true)"
if [[ -n "$shm" ]]; then
    echo "synkhronos test: leaked shared memory entries:" >&2
    ls -l $shm >&2 || true
    leak=1
fi
procs="$(pgrep -a -u "$(id -u)" -f 'synkhronos\.worker' 2>/dev/null || true)"
if [[ -n "$procs" ]]; then
    echo "synkhronos test: leftover worker processes:" >&2
    echo "$procs" >&2
    leak=1
fi

if [[ $leak -ne 0 ]]; then
    echo "synkhronos test: resource leak detected -- failing" >&2
    exit 1
fi
exit "$rc"

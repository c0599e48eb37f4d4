#!/usr/bin/env bash
# Set up (scripts/setup.sh test docs demos) and run the test suite. Extra args go to
# pytest. Slow tests are deselected unless -m is given or SYNK_SLOW=1.
# Shared memory or processes left behind by the sessions of this run fail it.
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

# every session this run makes (here and in the programs it starts) logs its prefix here,
# so that the leak check below looks at this run only, not at other programs of this user
SYNK_PREFIX_LOG="$(mktemp -t synk-test-prefixes.XXXXXXXX)"
export SYNK_PREFIX_LOG
trap 'rm -f "$SYNK_PREFIX_LOG"' EXIT

rc=0
.venv/bin/python -m pytest "${args[@]}" || rc=$?
if [[ $rc -eq 5 ]]; then
    echo "synkhronos test: pytest collected no tests (exit 5) -- treating as failure" >&2
    rc=1
fi

if ! .venv/bin/python scripts/leakcheck.py "$SYNK_PREFIX_LOG"; then
    echo "synkhronos test: resource leak detected -- failing" >&2
    exit 1
fi
exit "$rc"

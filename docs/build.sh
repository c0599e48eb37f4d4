#!/usr/bin/env bash
# Build the HTML docs into docs/_build/html with warnings as errors.
# Uses the repository's .venv (install Sphinx with: .venv/bin/pip install -e ".[docs]").
# Extra arguments go to sphinx-build (e.g. -E to rebuild everything).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
if ! "$PY" -c 'import sphinx' >/dev/null 2>&1; then
    echo "docs/build.sh: Sphinx is not installed in $PY; run: .venv/bin/pip install -e \".[docs]\"" >&2
    exit 1
fi
exec "$PY" -m sphinx -W --keep-going -n -b html "$@" "$ROOT/docs" "$ROOT/docs/_build/html"

#!/usr/bin/env bash
# Set up a Python >= 3.12 virtual environment in <repo>/.venv and install
# synkhronos (editable) with the extras given as arguments.
#   scripts/setup.sh            -> pip install -e .
#   scripts/setup.sh test demos -> pip install -e ".[test,demos]"
# Fast no-op when nothing changed (stamp file .venv/.synk-stamp); otherwise it says
# what it installs and shows pip's output (progress bars only in a terminal).
# Interpreter: $PYTHON, python3.13, python3.12, python3 (if >= 3.12), then
# pyenv versions (${PYENV_ROOT:-~/.pyenv}/versions/3.12+), newest first.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1

die() { echo "synkhronos setup: $*" >&2; exit 1; }

# True if "$1" runs and is Python >= 3.12 (pyenv shims may exist but fail).
py_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
    local cand
    if [[ -n "${PYTHON:-}" ]]; then
        if py_ok "$PYTHON"; then echo "$PYTHON"; return 0; fi
        die "PYTHON=$PYTHON is not a working Python >= 3.12."  # checked above too
    fi
    for cand in python3.13 python3.12 python3; do
        if command -v "$cand" >/dev/null 2>&1 && py_ok "$cand"; then
            command -v "$cand"; return 0
        fi
    done
    local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
    # Newest first: 3.2x before 3.1x, version-sorted descending.
    local -a found=()
    shopt -s nullglob
    found=("$pyenv_root"/versions/3.2[0-9]*/bin/python "$pyenv_root"/versions/3.1[2-9]*/bin/python)
    shopt -u nullglob
    if ((${#found[@]})); then
        while IFS= read -r cand; do
            if py_ok "$cand"; then echo "$cand"; return 0; fi
        done < <(printf '%s\n' "${found[@]}" | sort -r -V)
    fi
    return 1
}

venv_ok() {
    [[ -x "$VENV/bin/python" ]] && py_ok "$VENV/bin/python"
}

# Extras from arguments (accepts "test demos" or "test,demos").
EXTRAS="$(IFS=,; echo "$*" | tr ' ' ',' | tr -s ',' | sed 's/^,//; s/,$//')"
if [[ -n "$EXTRAS" ]]; then SPEC=".[${EXTRAS}]"; else SPEC="."; fi

# An explicit PYTHON must be usable even when an existing .venv is reused
# (to switch interpreters, delete .venv).
if [[ -n "${PYTHON:-}" ]] && ! py_ok "$PYTHON"; then
    die "PYTHON=$PYTHON is not a working Python >= 3.12 (unset PYTHON or point it to python3.12+)."
fi

if venv_ok; then
    PY="$VENV/bin/python"
else
    if ! BASE="$(find_python)"; then
        cat >&2 <<'MSG'
synkhronos setup: no Python >= 3.12 found.
  synkhronos needs Python >= 3.12. Either:
    - point to one:        PYTHON=/path/to/python3.12 scripts/setup.sh ...
    - install with pyenv:  pyenv install 3.12
    - or with apt:         apt-get install python3.12 python3.12-venv
MSG
        exit 1
    fi
    if [[ -e "$VENV" ]]; then
        echo "synkhronos setup: existing .venv is broken or too old; recreating" >&2
        rm -rf "$VENV"
    fi
    "$BASE" -m venv "$VENV" || die "could not create venv with $BASE"
    PY="$VENV/bin/python"
fi

BASE_EXE="$("$PY" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
VER="$("$PY" -c 'import platform; print(platform.python_version())')"
echo "synkhronos setup: using $BASE_EXE ($VER), venv .venv"

STAMP="$VENV/.synk-stamp"
WANT="$( { cat pyproject.toml; echo "extras=$EXTRAS"; echo "py=$VER"; } | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0            # nothing changed since the last install
fi

rm -f "$STAMP"
if [[ -n "$EXTRAS" ]]; then WHAT="synkhronos (editable) and extras ${EXTRAS}"; else WHAT="synkhronos (editable)"; fi
echo "synkhronos setup: installing $WHAT with pip (this takes ~30 s the first time)..."
START=$SECONDS
if [[ -t 1 ]]; then
    # a terminal: pip's own output and progress bars
    "$PY" -m pip install -e "$SPEC" || die "pip install -e \"$SPEC\" failed"
else
    # a log or a pipe: pip's lines without progress bars (carriage returns) and without the
    # long list of requirements that are already satisfied
    "$PY" -m pip install --progress-bar off -e "$SPEC" 2>&1 \
        | sed -u '/^Requirement already satisfied/d' || die "pip install -e \"$SPEC\" failed"
fi
echo "$WANT" > "$STAMP"
echo "synkhronos setup: installed $WHAT in $((SECONDS - START)) s"

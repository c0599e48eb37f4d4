#!/usr/bin/env bash
# Set up (scripts/setup.sh demos) and run the main job: the CNN demo on real handwritten digits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1

bash scripts/setup.sh demos
exec .venv/bin/python demos/mnist_cnn.py "$@"

#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite in it (CPU; GPU-only tests
# skip without CUDA). Extra arguments go to pytest. On a 2-core machine it takes about twenty
# minutes; the progress line shows how far it is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q "$@"

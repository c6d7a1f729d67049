#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite in it (CPU; GPU-only tests
# skip without CUDA), one test file at a time on each of up to four cores (pytest-xdist; a
# file's fixtures, such as a started server, stay in one process). Extra arguments go to
# pytest (`-n 0` runs it in one process). On a 2-core machine it takes about twelve minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile "$@"

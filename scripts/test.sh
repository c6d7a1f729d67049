#!/usr/bin/env bash
# Sets up and runs the whole test suite (CPU; GPU-only tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"

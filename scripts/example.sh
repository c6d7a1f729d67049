#!/usr/bin/env bash
# Sets up and runs an example generation (GPU if there is one, else CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/generate.py "$@"

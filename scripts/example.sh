#!/usr/bin/env bash
# Sets up and runs an example generation with the bundled demo model (GPU if there is
# one, else CPU). Extra arguments go to `nanovllm generate` (e.g. --model PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m nanovllm generate --max-tokens 48 --temperature 0.8 "$@" \
    "def fibonacci(n):" "import os" "class Stack:"

#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs an example generation with the bundled demo
# model (GPU if there is one, else CPU). Extra arguments go to `nanovllm generate` (e.g.
# --model PATH). A second run skips the set-up and starts in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m nanovllm generate --echo --max-tokens 48 --temperature 0.8 "$@" \
    "def fibonacci(n):" "import os" "class Stack:"

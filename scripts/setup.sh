#!/usr/bin/env bash
# Installs nanovllm and its test tools into the current Python. Safe to run again.
# Without a usable torch, it installs one first: pinned to 2.13.0 so that a machine
# without a GPU does not pull a multi-GB CUDA build through another package's range.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q -e ".[test]"

#!/usr/bin/env bash
# Installs nanovllm into the project's virtual environment, .venv (created if missing,
# reused if present), never into the system Python; it prints one line when it installs.
#   bash scripts/setup.sh           # nanovllm alone
#   bash scripts/setup.sh test      # with extras: test, serve, structured, ray, bench (comma-separated)
# Without a torch in .venv it installs one first: on a machine without an NVIDIA GPU the
# CPU build from PyTorch's CPU index (a version pin alone pulls the multi-GB CUDA build),
# falling back to the default index where that one cannot be reached. pip runs only when
# pyproject.toml or this script changed since the last run, or an extra is asked for that
# no run since then has installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NANOVLLM_VENV:-.venv}
EXTRAS=${1:-}
TORCH=torch==2.13.0
stamp="$VENV/.nanovllm-setup"  # "<hash of pyproject.toml and this script> <extras installed, comma-separated>"
hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
stamp_hash="" have=""
[ -f "$stamp" ] && read -r stamp_hash have < "$stamp" || true
[ "$stamp_hash" = "$hash" ] || have=""
missing=""
for extra in ${EXTRAS//,/ }; do
    case ",$have," in *",$extra,"*) ;; *) missing="$missing,$extra" ;; esac
done
[ "$stamp_hash" = "$hash" ] && [ -z "$missing" ] && exit 0
PY="$VENV/bin/python"
echo "setup: installing nanovllm${EXTRAS:+[$EXTRAS]} into $VENV (a minute or two the first time)" >&2
if ! "$PY" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install -q "$TORCH"
    else
        # One try per file: where PyTorch's index cannot be reached, pip goes on to the others at once.
        "$PY" -m pip install -q "$TORCH" --index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 15 \
            || "$PY" -m pip install -q "$TORCH"
    fi
fi
"$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
have="$have$missing"
echo "$hash ${have#,}" > "$stamp"

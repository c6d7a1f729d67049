#!/usr/bin/env bash
# Downloads the server's packages that the GPU machine's image lacks (fastapi, uvicorn,
# pydantic, httptools and their own needs; it has uvloop) and xgrammar (structured
# outputs, with apache-tvm-ffi; jsonschema for its tests) as Python 3.12 wheels into .whl/, which git ignores
# through .git/info/exclude. `bash scripts/gpu_check.sh serving` installs them there.
# With --serve-only: the server's packages alone (it starts without xgrammar), small enough
# to carry beside .whl-transformers within a call's 64 MiB (`gpu_check.sh startup`).
set -euo pipefail
cd "$(dirname "$0")/.."
# With --transformers: also the newest transformers and what it needs above the image's
# versions, into .whl-transformers/ (`gpu_check.sh startup`). The image's 5.17
# imports GenerationMixin (torch.distributed.tensor, sklearn, sympy) with any model's config
# class, a large part of each engine's start-up there (benchmarks/RESULTS.md, session 17);
# later releases do not.
case ${1:-} in
    ""|--transformers|--serve-only) ;;
    *) echo "usage: bash scripts/fetch_gpu_wheels.sh [--transformers | --serve-only]" >&2; exit 2 ;;
esac
if [[ ${1:-} == --transformers ]]; then
    rm -rf .whl-transformers
    grep -qx "/.whl-transformers/" .git/info/exclude 2>/dev/null || echo "/.whl-transformers/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl-transformers transformers "huggingface-hub>=1.31,<2" tokenizers
    ls .whl-transformers
    exit 0
fi
packages=(fastapi uvicorn pydantic pydantic_core starlette annotated-types annotated-doc typing-inspection
          typing_extensions opentelemetry-api httptools)
if [[ ${1:-} != --serve-only ]]; then
    packages+=(xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py attrs)
fi
rm -rf .whl  # a fresh set: two versions of one package would not install together
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "${packages[@]}"
ls .whl

"""`python -m nanovllm ...` is the `nanovllm` command."""
from nanovllm.entrypoints.cli import main

main()

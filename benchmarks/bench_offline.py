"""nano-vllm's offline benchmark; the code lives in nanovllm/entrypoints/bench.py
(also `nanovllm bench`). Run `python benchmarks/bench_offline.py --help`."""
from nanovllm.entrypoints.bench import main

if __name__ == "__main__":
    main()

"""Engine replicas on one host, for data parallelism offline (data_parallel.py) and in the
server (router.py): each an engine process on its own group of GPUs."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from nanovllm.config import Config
from nanovllm.serving.async_engine import AsyncLLMEngine


def replica_devices(data_parallel_size: int, tensor_parallel_size: int, num_gpus: int,
                    visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: consecutive groups of tensor_parallel_size of
    the GPUs this process sees."""
    ids = visible.split(",") if visible else [str(i) for i in range(num_gpus)]
    needed = data_parallel_size * tensor_parallel_size
    if needed > len(ids):
        raise ValueError(f"data_parallel_size {data_parallel_size} x tensor_parallel_size {tensor_parallel_size} "
                         f"needs {needed} GPUs; {len(ids)} are visible")
    return [",".join(ids[r * tensor_parallel_size:(r + 1) * tensor_parallel_size]) for r in range(data_parallel_size)]


def build_replicas(model: str, engine_args: dict, data_parallel_size: int,
                   config: Config | None = None) -> list[AsyncLLMEngine]:
    """data_parallel_size engine processes, started side by side, each on its own GPUs.
    If one fails to start, the others are stopped and its error raised. config: the
    engine arguments' Config, when the caller has built it already."""
    config = config or Config.from_kwargs(model, **engine_args)
    engine_args = {**engine_args, "seed": config.seed}  # seed=None: the one drawn here, the same for every replica
    devices: list[str | None] = [None] * data_parallel_size
    if config.torch_device.type == "cuda":
        import torch

        devices = replica_devices(data_parallel_size, config.tensor_parallel_size, torch.cuda.device_count(),
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
    replicas, failure = [], None
    with ThreadPoolExecutor(data_parallel_size) as pool:
        for build in [pool.submit(AsyncLLMEngine, model, engine_args, None, d) for d in devices]:
            try:
                replicas.append(build.result())
            except BaseException as exc:
                failure = failure or exc
    if failure is not None:
        for replica in replicas:
            replica.shutdown()
        raise failure
    for replica in replicas:  # N engine processes share plain streams' decoding better than one event loop
        replica.decode_streams = len(replicas) == 1
    return replicas

"""Load Hugging Face safetensors checkpoints (single file or sharded) into our modules."""
from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.utils.fp8 import dequantize_blocks, is_fp8


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}; nanovllm loads safetensors checkpoints only")
    return files


def load_model(model: nn.Module, path: str, fp8_block: int | None = None) -> None:
    """Copy every checkpoint tensor into its parameter through the parameter's weight_loader.

    `model.weight_target(name)` says where a tensor goes (q_proj -> qkv_proj shard "q",
    an expert's up_proj -> its slice of the stacked experts, ...). A tied LM head shares
    the embedding, so a checkpoint without lm_head.weight is fine; any other parameter
    left unloaded is an error. fp8_block: a block-scaled FP8 checkpoint's block size; its
    FP8 weights whose parameters are in the model's dtype (a router; MoE experts whose blocks
    a rank's slice would cut, quantized again after loading) are dequantized with their
    `weight_scale_inv` as they load.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = _checkpoint_files(path)

    def stays_unquantized(weight_name: str) -> bool:  # an FP8 checkpoint's weight for a 16/32-bit parameter
        param = params.get(model.weight_target(weight_name)[0])
        return fp8_block is not None and param is not None and not is_fp8(param.dtype)

    for file in files:
        with _open_weights(file) as f:
            keys = f.keys()
            names = set(keys)
            for name in keys:
                if name.endswith("_scale_inv") and stays_unquantized(name.removesuffix("_scale_inv")):
                    continue  # taken with its weight
                target, shard_id = model.weight_target(name)
                param = params.get(target)
                if param is None:
                    if "rotary_emb.inv_freq" in name:  # old checkpoints store a derived buffer
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} in {file} has no matching parameter")
                loader = getattr(param, "weight_loader", _default_weight_loader)
                tensor = f.get_tensor(name)
                if is_fp8(tensor.dtype) and stays_unquantized(name):
                    scale_name = name + "_scale_inv"
                    scale = f.get_tensor(scale_name) if scale_name in names else _tensor(scale_name, files)
                    tensor = dequantize_blocks(tensor, scale, fp8_block, param.dtype)
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
                loaded.add(target)
    loaded_ids = {id(params[name]) for name in loaded}  # a tied lm_head shares the embedding's tensor
    missing = {name for name, param in params.items()
               if id(param) not in loaded_ids and not getattr(param, "optional", False)}
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {', '.join(sorted(missing))}")


def _tensor(name: str, files: list[str]) -> torch.Tensor:
    """Tensor `name` from whichever checkpoint file holds it (a weight's scale stored apart)."""
    for file in files:
        with _open_weights(file) as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"checkpoint tensor {name.removesuffix('_scale_inv')!r} is FP8 but the checkpoint has no {name!r}")


def _open_weights(file: str):
    """safe_open(file), whose errors name the file (safetensors' own name none)."""
    try:
        return safe_open(file, "pt", "cpu")
    except SafetensorError as exc:
        raise ValueError(f"cannot read the weights in {file}: {exc}") from None
    except FileNotFoundError:
        raise ValueError(f"cannot read the weights in {file}: no such file (a broken link, or a shard that "
                         "model.safetensors.index.json names but the folder lacks)") from None


def _default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes (load_format="dummy"), for benchmarks.

    Small uniform values keep activations finite through many layers; norms stay 1.
    """
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if getattr(param, "optional", False):  # keeps its default (KV-cache scales: 1.0)
            continue
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.uniform_(-0.02, 0.02, generator=generator)

"""Block-scaled FP8 checkpoints written from tiny ones, as Qwen3's -FP8 releases are laid out,
with a dequantized twin for transformers to compare against."""
from __future__ import annotations

from pathlib import Path

from nanovllm.utils.fp8 import dequantize_blocks, quantize_blocks

# The projections an FP8 checkpoint stores in FP8 (Qwen3's -FP8 releases); embeddings,
# norms and the LM head stay as they are.
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: int = 128, fp8_routers: bool = False) -> Path:
    """Copy checkpoint `src` to `dst` as a block-scaled FP8 release: each projection's weight
    (an MoE expert's too) in float8_e4m3fn with `weight_scale_inv` [ceil(out / block),
    ceil(in / block)] (the largest |w| of each block / 448, the factor that dequantizes it),
    and the config's quantization_config saying so. An MoE model's routers stay as they are
    and are named in `modules_to_not_convert`, unless fp8_routers. Also writes
    `dst / "dequantized"`: the same model with every weight at its dequantized value, in the
    source's dtype (a transformers oracle for it)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    shutil.copytree(src, dst / "dequantized")
    projections, routers = FP8_PROJECTIONS + (("gate",) if fp8_routers else ()), []
    for file in src.glob("*.safetensors"):
        tensors, dequantized = load_file(file), {}
        for name, weight in list(tensors.items()):
            dequantized[name] = weight
            if name.endswith(".mlp.gate.weight") and not fp8_routers:
                routers.append(name.removesuffix(".weight"))
            if not (name.endswith(".weight") and name.split(".")[-2] in projections):
                continue
            tensors[name], scale = quantize_blocks(weight, block)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
            dequantized[name] = dequantize_blocks(tensors[name], scale, block, weight.dtype)
        save_file(tensors, dst / file.name)
        save_file(dequantized, dst / "dequantized" / file.name)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    if routers:
        config["quantization_config"]["modules_to_not_convert"] = ["lm_head", *sorted(routers)]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst

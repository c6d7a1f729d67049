"""A mixture-of-experts MLP: a router picks top_k of num_experts SwiGLU experts per token.

Weights are stacked per expert: w13 [experts, 2 * inter, hidden] (gate_proj's rows, then
up_proj's) and w2 [experts, hidden, inter]; the loader fills them from the hub layout
(`mlp.experts.{e}.gate_proj.weight`, ...) through `weight_loader(param, w, (e, part))`.

Parallelism, over the tensor-parallel group (whose ranks all hold every token's hidden
state after the attention's all-reduce):
  - tensor parallel (default): every rank holds all experts, each cut along inter;
  - expert parallel (`enable_expert_parallel`): rank r holds experts [r E/N, (r+1) E/N)
    whole, and computes only the pairs routed to them (the rest count as no expert).
Either way a rank's output is a partial sum over its shards, and the one all-reduce
that a row-parallel MLP does anyway completes it: expert parallelism needs no
all-to-all here, because the tokens are already on every rank.

FP8 (quantization="fp8", or an FP8 checkpoint's experts): w13 and w2 in float8_e4m3fn with
one fp32 scale per [block, block] block of each expert's gate, up and down weight
(`ExpertScales`), their inputs quantized per token and block as they arrive (dynamic
scales, as the linear layers' block-scaled FP8 GEMM does; kernels/fused_moe.py). Quantized
after loading on the widest of 128, 64 and 32 that divides a rank's inter (online_block);
from a checkpoint, its `weight_scale_inv` as stored, unless a rank's slice of inter would
cut its blocks (then loaded dequantized and quantized again on the rank).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, divide
from nanovllm.layers.quantization import FP8_WEIGHTS, dequantize_per_group, quantize_per_group
from nanovllm.utils.build_setting import BuildSetting
from nanovllm.utils.distributed import get_tp_group
from nanovllm.utils.fp8 import FP8_DTYPE, dequantize_blocks, quantize_blocks

# The blocks of experts quantized after loading: the -FP8 releases' 128, or the largest
# power of two from 32 that divides a rank's rows of inter (online_block).
ONLINE_BLOCKS = (128, 64, 32)
MIN_FP8_INPUT_BLOCK = 32


@dataclass(frozen=True)
class MoEOptions:
    expert_parallel: bool = False
    # "triton": the fused kernels (CUDA, or the Triton interpreter on CPU); "torch": one
    # expert at a time (CPU).
    kernel: str = "torch"


MOE_OPTIONS = BuildSetting(MoEOptions())
use_moe_options = MOE_OPTIONS.use  # the options of the MoE layers built inside the block


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the top_k of them, renormalised to sum to 1
    when asked: (weights [tokens, top_k] float32, expert ids [tokens, top_k])."""
    weights, ids = torch.softmax(router_logits.float(), dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertScales(NamedTuple):
    """FP8 experts' block scales: w13 [experts, 2 * ceil(inter / block), ceil(hidden / block)]
    (gate_proj's blocks, then up_proj's) and w2 [experts, ceil(hidden / block), ceil(inter /
    block)], fp32; weight = FP8 value * its block's scale."""

    w13: torch.Tensor
    w2: torch.Tensor
    block: int

    def quantizes_inputs(self, width: int) -> bool:
        """Whether a GEMM's input of `width` columns is quantized per row and block (FP8 products:
        whole blocks, at least 32 wide, the K an FP8 tl.dot takes); else it stays in its dtype."""
        return self.block >= MIN_FP8_INPUT_BLOCK and width % self.block == 0

    def dequantized(self, w13: torch.Tensor, w2: torch.Tensor, expert: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `expert`'s w13 [2 * inter, hidden] and w2 [hidden, inter] in dtype."""
        gate_up = [dequantize_blocks(weight, scale, self.block, dtype)  # gate's, then up's
                   for weight, scale in zip(w13[expert].unflatten(0, (2, -1)), self.w13[expert].unflatten(0, (2, -1)))]
        return torch.cat(gate_up), dequantize_blocks(w2[expert], self.w2[expert], self.block, dtype)


def online_block(local_inter: int) -> int:
    """The block size of experts quantized on this rank: 128 where it divides the rank's rows of
    inter, else the largest of 64 and 32 that does (so the down GEMM's input is whole blocks
    and its products FP8), else 128 (partial blocks, that input in its dtype)."""
    return next((block for block in ONLINE_BLOCKS if local_inter % block == 0), ONLINE_BLOCKS[0])


def loads_as_stored(block: int, local_inter: int, sliced: bool) -> bool:
    """Whether an FP8 checkpoint's experts with `block`-wide scale blocks load as stored: not
    where a rank's slice of inter (`sliced`) cuts the blocks, or where the kernel's K tiles
    (powers of two from 16) do not fit a block (those load dequantized, then are quantized
    again as quantization="fp8" quantizes)."""
    return not (sliced and local_inter % block) and block >= 16 and not block & (block - 1)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool):
        super().__init__()
        self.tp_group = get_tp_group()
        self.options = MOE_OPTIONS.value
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        tp_size = self.tp_group.size
        if self.options.expert_parallel:
            self.num_local_experts = divide(num_experts, tp_size)
            self.first_expert = self.tp_group.rank * self.num_local_experts
            self.local_inter = intermediate_size
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.local_inter = divide(intermediate_size, tp_size)
        self.gate = ReplicatedLinear(hidden_size, num_experts, quantizable=False)  # the router, never FP8
        fp8 = FP8_WEIGHTS.value
        sliced = tp_size > 1 and not self.options.expert_parallel
        as_stored = fp8 is not None and fp8.block is not None and loads_as_stored(fp8.block, self.local_inter, sliced)
        if fp8 is None:
            self.fp8_block = None
        else:
            self.fp8_block = fp8.block if as_stored else online_block(self.local_inter)
        dtype = FP8_DTYPE if as_stored else None  # else quantize_online makes them FP8 after loading
        experts, inter = self.num_local_experts, self.local_inter
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden_size, inter, dtype=dtype), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        self.scales = None
        if as_stored:
            self._set_scales(*_scale_buffers(experts, inter, hidden_size, self.fp8_block, self.w13.device))
            self.w13_scale.weight_loader = self.w2_scale.weight_loader = self.scale_loader
        if self.options.kernel == "triton":
            from nanovllm.kernels.fused_moe import fused_moe  # triton: only where it is used

            self.compute_experts = functools.partial(fused_moe, every_pair_routed=not self.options.expert_parallel)
        else:
            self.compute_experts = torch_moe

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: tuple[int, str]) -> None:
        """Expert `expert`'s gate_proj / up_proj [inter, hidden] or down_proj [hidden, inter]
        into its place; experts that live on another rank are skipped."""
        self._load_part(param, loaded_weight, shard, self.local_inter)

    def scale_loader(self, param: nn.Parameter, scale_inv: torch.Tensor, shard: tuple[int, str]) -> None:
        """An FP8 checkpoint's block scales of an expert's part, [inter / block, hidden / block]
        (down: transposed), sliced and placed as weight_loader places the weight."""
        self._load_part(param, scale_inv.float(), shard, _blocks(self.local_inter, self.fp8_block))

    def _load_part(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, str], inter: int) -> None:
        """`loaded` (an expert's part or its scales, `inter` rows of it per rank) into its place."""
        expert, part = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:  # it lives on another rank
            return
        tp_dim = 1 if part == "down" else 0
        if not self.options.expert_parallel:  # this rank's slice of inter
            loaded = loaded.narrow(tp_dim, self.tp_group.rank * inter, inter)
        target = param.data[local]
        if part != "down":
            target = target.narrow(0, 0 if part == "gate" else inter, inter)
        target.copy_(loaded)

    def quantize_online(self) -> None:
        """quantization="fp8": the loaded experts (this rank's shard) to FP8 with block scales."""
        if self.fp8_block is None or self.scales is not None:
            return
        w13, w2, scales = quantize_experts(self.w13.data, self.w2.data, self.fp8_block)
        self.w13, self.w2 = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
        self._set_scales(scales.w13, scales.w2)

    def _set_scales(self, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> None:
        self.w13_scale, self.w2_scale = (nn.Parameter(s, requires_grad=False) for s in (w13_scale, w2_scale))
        self.scales = ExpertScales(self.w13_scale, self.w2_scale, self.fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.options.expert_parallel:
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.num_local_experts), ids, self.num_local_experts)
        out = self.compute_experts(x, self.w13, self.w2, weights, ids, scales=self.scales)
        self.tp_group.all_reduce(out)
        return out


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor,
                     block: int) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """Stacked experts (FusedMoE's w13, w2) in FP8 with their block scales: each expert's
    gate, up and down weight quantized on its own grid of blocks (quantize_blocks), one
    expert at a time (a float32 copy of one expert at most)."""
    experts, two_inter, hidden = w13.shape
    q13, q2 = (torch.empty_like(w, dtype=FP8_DTYPE) for w in (w13, w2))
    s13, s2 = _scale_buffers(experts, two_inter // 2, hidden, block, w13.device)
    for e in range(experts):
        parts = [quantize_blocks(part, block) for part in w13[e].unflatten(0, (2, -1))]  # gate's, then up's
        q13[e], s13[e] = torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
        q2[e], s2[e] = quantize_blocks(w2[e], block)
    return q13, q2, ExpertScales(s13, s2, block)


def expert_parameters(model: nn.Module) -> list[torch.Tensor]:
    """Every FusedMoE's expert weights in `model`, FP8 experts' block scales too (not the routers)."""
    parameters = []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            parameters += [module.w13, module.w2]
            if module.scales is not None:
                parameters += [module.scales.w13, module.scales.w2]
    return parameters


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def _scale_buffers(experts: int, inter: int, hidden: int, block: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ExpertScales w13 and w2 (fp32) for experts of these sizes."""
    return (torch.empty(experts, 2 * _blocks(inter, block), _blocks(hidden, block), dtype=torch.float32, device=device),
            torch.empty(experts, _blocks(hidden, block), _blocks(inter, block), dtype=torch.float32, device=device))


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, scales: ExpertScales | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), one expert at a time in
    plain torch: the CPU path, and the reference of the fused kernels (kernels/fused_moe.py,
    which documents the arguments). Reads the counts on the host: not for CUDA graphs."""
    top_k = topk_ids.size(1)
    num_experts = w13.size(0)
    flat = topk_ids.flatten().long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts + 1).tolist()
    weights = topk_weights.flatten().to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count:
            pairs = order[start:start + count]
            tokens = pairs // top_k
            w13_e, w2_e = (w13[expert], w2[expert]) if scales is None else scales.dequantized(w13, w2, expert,
                                                                                                   x.dtype)
            gate, up = F.linear(_as_quantized(x[tokens], scales), w13_e).chunk(2, dim=-1)
            y = F.linear(_as_quantized(F.silu(gate) * up, scales), w2_e)
            out.index_add_(0, tokens, y * weights[pairs, None])
        start += count
    return out


def _as_quantized(a: torch.Tensor, scales: ExpertScales | None) -> torch.Tensor:
    """A GEMM's input as the fused kernels multiply it: with FP8 experts, quantized per row
    and block of columns where ExpertScales.quantizes_inputs says (kernels/fused_moe.py's
    _gemm), at its dequantized value."""
    if scales is None or not scales.quantizes_inputs(a.shape[1]):
        return a
    return dequantize_per_group(*quantize_per_group(a, scales.block)).to(a.dtype)


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """`model.layers.3.mlp.experts.17.up_proj.weight` -> (`model.layers.3.mlp.w13`, (17, "up"));
    an FP8 checkpoint's `...up_proj.weight_scale_inv` -> (`model.layers.3.mlp.w13_scale`, ...)."""
    prefix, sep, rest = name.partition(".experts.")
    if not sep:
        return None
    expert, proj, tensor = rest.split(".", 2)
    part = proj.removesuffix("_proj")
    suffix = "_scale" if tensor == "weight_scale_inv" else ""
    return f"{prefix}.{'w2' if part == 'down' else 'w13'}{suffix}", (int(expert), part)


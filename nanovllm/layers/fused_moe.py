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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import ReplicatedLinear, divide
from nanovllm.utils.build_setting import BuildSetting
from nanovllm.utils.distributed import get_tp_group


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
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.local_inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.local_inter), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader
        if self.options.kernel == "triton":
            from nanovllm.kernels.fused_moe import fused_moe  # triton: only where it is used

            self.compute_experts = functools.partial(fused_moe, every_pair_routed=not self.options.expert_parallel)
        else:
            self.compute_experts = torch_moe

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard: tuple[int, str]) -> None:
        """Expert `expert`'s gate_proj / up_proj [inter, hidden] or down_proj [hidden, inter]
        into its place; experts that live on another rank are skipped."""
        expert, part = shard
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        tp_dim = 1 if part == "down" else 0
        if not self.options.expert_parallel:  # this rank's slice of inter
            loaded_weight = loaded_weight.narrow(tp_dim, self.tp_group.rank * self.local_inter, self.local_inter)
        target = param.data[local]
        if part != "down":
            target = target.narrow(0, 0 if part == "gate" else self.local_inter, self.local_inter)
        target.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.options.expert_parallel:
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.num_local_experts), ids, self.num_local_experts)
        out = self.compute_experts(x, self.w13, self.w2, weights, ids)
        self.tp_group.all_reduce(out)
        return out


def torch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
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
            gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])
            out.index_add_(0, tokens, y * weights[pairs, None])
        start += count
    return out


def expert_weight_target(name: str) -> tuple[str, tuple[int, str]] | None:
    """`model.layers.3.mlp.experts.17.up_proj.weight` -> (`model.layers.3.mlp.w13`, (17, "up"))."""
    prefix, sep, rest = name.partition(".experts.")
    if not sep:
        return None
    expert, proj, _ = rest.split(".", 2)
    part = proj.removesuffix("_proj")
    return f"{prefix}.{'w2' if part == 'down' else 'w13'}", (int(expert), part)


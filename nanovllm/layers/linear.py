"""Linear layers in tensor-parallel shape (vLLM's names).

Each layer owns its shard of the full weight and a `weight_loader(param, loaded_weight,
shard_id=None)` that copies the right slice of a checkpoint tensor into it. With one
rank the shard is the whole weight; more ranks only add the communication
(RowParallelLinear's all-reduce). Built under use_fp8 (quantization.py), a layer holds
an FP8 weight and its scales instead.

Where layers/kernel_plan.py calls `use_small_batch_kernels` (on CUDA, with any attention
backend; under the Triton interpreter on CPU), `matmul` takes a step's rows (defaults in
parentheses) to:

    16-bit weight, defer=True (the norm, SiLU-and-mul or rotary_store reading the output
    sums its SplitSum):
      WIDE_MIN_ROWS-WIDE_MAX_ROWS (65-256), a row-parallel projection on one rank whose
        output is narrow (K >= 2 N, N <= 1,024: Qwen3-0.6B's o_proj, down_proj)  kernels/wide_gemm.py
      SPLIT_MIN_ROWS-SPLIT_MAX_ROWS (2-64; Hopper, or the interpreter)          kernels/split_gemm.py
    16-bit, gated=True ([gate | up] returned as silu(gate) * up): up to GEMV_MAX_ROWS (8)  kernels/gemv.py
      rows, where the split tiles do not take them first (so one row where those run)
    16-bit, otherwise: up to GEMV_MAX_ROWS the GEMV, more rows cuBLAS
    FP8 weight: quantization.fp8_linear (decode_route: the wide FP8 form or channel_gemm at
      decode batches; cuBLAS's row-wise GEMM, or scaled_gemm for block scales and on CPU)
"""
from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization import FP8_DTYPE, FP8_WEIGHTS, QuantizedInput, fp8_linear, quantize_per_group
from nanovllm.utils.distributed import get_tp_group, get_tp_size


class Route(enum.Enum):
    """Where a projection's step goes (LinearBase.route)."""

    WIDE = enum.auto()  # kernels/wide_gemm.py's split tiles: a SplitSum
    SPLIT = enum.auto()  # kernels/split_gemm.py's split tiles: a SplitSum
    GATED = enum.auto()  # kernels/gemv.py with SiLU-and-mul in its epilogue
    FP8 = enum.auto()  # quantization.fp8_linear (its decode_route picks the kernel)
    GEMV = enum.auto()  # kernels/gemv.py
    TORCH = enum.auto()  # F.linear (cuBLAS on CUDA)


def fits_small_batch(x: torch.Tensor, max_rows: int) -> bool:
    """Whether x can go to a small-batch kernel (kernels/gemv.py, rmsnorm.py) that takes up
    to max_rows rows (0: none): 1 to max_rows rows of a 2-D input with unit stride in its
    last dimension (not a QuantizedInput)."""
    return isinstance(x, torch.Tensor) and 0 < x.shape[0] <= max_rows and x.dim() == 2 and x.stride(-1) == 1


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W of shape [output_size, input_size] for this rank.

    tp_dim: the weight dimension split across ranks (0 = outputs, 1 = inputs, None = replicated).
    quantizable: False keeps the layer in the model's dtype under FP8 quantization (an MoE router).
    """

    # The most rows that go to kernels/gemv.py, plain and gated, and to kernels/split_gemm.py
    # (deferred; wide_rows: to kernels/wide_gemm.py): 0 (none) until use_small_batch_kernels;
    # split_above: the rows below the tiles' share.
    gemv_rows = gated_rows = split_rows = split_above = wide_rows = 0
    # Whether kernels/wide_gemm.py may take this layer (row-parallel layers: measured there)
    wide_tiles = False
    # An FP8 weight's plan for kernels/wide_gemm.py's FP8 form (use_small_batch_kernels, where it is on)
    fp8_wide_plan = None

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None, quantizable: bool = True):
        super().__init__()
        self.tp_dim = tp_dim
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank
        self.tp_size = self.tp_group.size
        self.fp8 = FP8_WEIGHTS.value if quantizable else None
        block = self.fp8.block if self.fp8 is not None else None
        if block is not None:  # an FP8 checkpoint: weight_scale from *.weight_scale_inv, per row and block
            sliced = tp_dim == 1 and self.tp_size > 1
            if input_size % block and (input_size > block or sliced):  # a K step would span two blocks' scales
                raise ValueError(f"an FP8 checkpoint with {block}-wide blocks needs "
                                 f"{'each rank' if sliced else 'a layer'}'s input size to be a multiple of {block} "
                                 f"(or, unsliced, below it); got {input_size}")
            self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE), requires_grad=False)
            self.weight_scale = nn.Parameter(torch.empty(output_size, -(-input_size // block), dtype=torch.float32),
                                             requires_grad=False)
            self.weight_scale.weight_loader = self.block_scale_loader
        else:  # in the model's dtype (quantized after loading when self.fp8)
            self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_dim is not None and param.dim() > self.tp_dim:
            shard = param.size(self.tp_dim)
            loaded_weight = loaded_weight.narrow(self.tp_dim, self.tp_rank * shard, shard)
        param.data.copy_(loaded_weight)

    def block_scale_loader(self, param: nn.Parameter, scale_inv: torch.Tensor, *shard_id) -> None:
        """A checkpoint's [out / block, in / block] block scales, repeated over each block's
        rows, go through the weight's own loader: sliced wherever the weight is."""
        rows = scale_inv.float().repeat_interleave(self.fp8.block, dim=0)
        if self.tp_dim != 0:  # the loader copies dim 0 whole: no rows past the last block's
            rows = rows[: param.size(0)]
        self.weight_loader(param, rows, *shard_id)

    def quantize_online(self) -> None:
        """quantization="fp8" of a layer loaded in the model's dtype: an FP8 weight, one scale per output channel."""
        if self.fp8 is not None and self.weight.dtype != FP8_DTYPE:
            weight, scale = quantize_per_group(self.weight.data, self.weight.shape[1])
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)

    def use_small_batch_kernels(self) -> None:
        """Plan this layer's Triton kernels for decode-sized steps (and prefill steps that
        small), by the table in this module's docstring: the GEMV, the split tiles, the wide
        tiles and the wide FP8 form, each where it takes this weight as loaded and quantized.
        Imported here: Triton is not imported where its kernels do not run."""
        from nanovllm.kernels import split_gemm, wide_gemm
        from nanovllm.kernels.gemv import GEMV_MAX_ROWS, gemv, supports

        self._gemv = gemv
        self.gemv_rows = GEMV_MAX_ROWS if supports(self.weight) else 0
        self.split_above = min(self.gemv_rows, split_gemm.SPLIT_MIN_ROWS - 1)
        if split_gemm.SPLIT_MAX_ROWS > self.split_above and split_gemm.supports(self.weight):
            self._split_gemm = split_gemm.split_gemm
            self._split_descriptor = split_gemm.weight_descriptor(self.weight)
            self.split_rows = split_gemm.SPLIT_MAX_ROWS
        # one rank only: with more, a row-parallel output is all-reduced, not read by a kernel
        wide = self.wide_tiles and self.tp_size == 1 and wide_gemm.WIDE_MAX_ROWS >= wide_gemm.WIDE_MIN_ROWS
        if wide and wide_gemm.takes_wide(self.weight):
            self._wide_gemm = wide_gemm.wide_split_gemm
            self._wide_descriptor = wide_gemm.wide_descriptor(self.weight)
            self._tma_rows, self._wide_from = wide_gemm.tma_rows, wide_gemm.WIDE_MIN_ROWS
            self.wide_rows = wide_gemm.WIDE_MAX_ROWS
        # one rank only too: the plans pick weights by shape, measured for whole layers
        if (self.takes_quantized_input() and self.tp_size == 1
                and wide_gemm.FP8_WIDE_MAX_ROWS >= wide_gemm.WIDE_MIN_ROWS):
            self.fp8_wide_plan = wide_gemm.fp8_plan(self.weight)

    def takes_quantized_input(self) -> bool:
        """Whether forward takes a QuantizedInput (quantized per token by the kernel before):
        per-channel FP8 weights on the kernels."""
        return (self.weight.dtype == FP8_DTYPE and self.fp8 is not None and self.fp8.kernel == "triton"
                and self.weight_scale.shape[1] == 1)

    def route(self, x: torch.Tensor | QuantizedInput, gated: bool = False, defer: bool = False) -> Route:
        """The kernel that forward(x, gated, defer) runs on: decided here alone. defer: the
        split tiles may take x (their SplitSum for the reader to sum); gated: the GEMV's
        SiLU-and-mul epilogue where it takes x, asked after the tiles (Route.GATED: else
        forward(x, gated=True) is refused)."""
        if defer and fits_small_batch(x, self.wide_rows) and x.shape[0] >= self._wide_from and self._tma_rows(x):
            return Route.WIDE
        if defer and fits_small_batch(x, self.split_rows) and x.shape[0] > self.split_above:
            return Route.SPLIT
        if gated and fits_small_batch(x, self.gated_rows):
            return Route.GATED
        if self.weight.dtype == FP8_DTYPE:  # its own GEMMs (neither small-batch kernel takes FP8 weights)
            return Route.FP8
        if fits_small_batch(x, self.gemv_rows):
            return Route.GEMV
        return Route.TORCH

    def matmul(self, x: torch.Tensor | QuantizedInput, bias: torch.Tensor | None, gated: bool = False,
               defer: bool = False):
        route = self.route(x, gated, defer)
        if route is Route.WIDE:
            return self._wide_gemm(x, self.weight, self._wide_descriptor, bias)
        if route is Route.SPLIT:
            return self._split_gemm(x, self.weight, self._split_descriptor, bias)
        if route is Route.GATED:
            return self._gemv(x, self.weight, bias, gated=True)
        if gated:
            raise ValueError(f"a gated projection of {tuple(x.shape)} needs the GEMV kernel (Route.GATED)")
        if route is Route.FP8:
            return fp8_linear(x, self.weight, self.weight_scale, bias, self.fp8.kernel, self.fp8_wide_plan)
        if route is Route.GEMV:
            return self._gemv(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor, gated: bool = False, defer: bool = False):
        """x W^T (+ b); gated (where route(x, gated=True) is Route.GATED): silu(gate) * up of
        the [gate | up] output; defer: a SplitSum where the split tiles take x (route(x,
        defer=True) is Route.WIDE or Route.SPLIT: the caller's reader sums it), else a tensor."""
        return self.matmul(x, self.bias, gated, defer)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True):
        super().__init__(input_size, output_size, bias, tp_dim=None, quantizable=quantizable)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, divide(output_size, get_tp_size()), bias, tp_dim=0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections stored as one (gate_proj + up_proj -> gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def use_small_batch_kernels(self) -> None:
        """As LinearBase's; [gate | up] of two equal halves may also be gated."""
        super().use_small_batch_kernels()
        from nanovllm.kernels.gemv import GEMV_MAX_ROWS, supports

        halves = len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1]
        self.gated_rows = GEMV_MAX_ROWS if halves and supports(self.weight, gated=True) else 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj as one projection; heads split across ranks.

    When there are fewer KV heads than ranks, each rank keeps a whole replicated KV head.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = max(1, total_num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // total_num_kv_heads)
        output_size = (total_num_heads + 2 * self.num_kv_heads * tp_size) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    wide_tiles = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(divide(input_size, get_tp_size()), output_size, bias, tp_dim=1)

    def forward(self, x: torch.Tensor, defer: bool = False):
        # The bias is added once, on rank 0, before the sum; a SplitSum only on one rank.
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None, defer=defer and self.tp_size == 1)
        self.tp_group.all_reduce(y)
        return y


def quantize_after_loading(model: nn.Module) -> None:
    """Online FP8 quantization: every layer built for FP8 but loaded in the model's dtype
    quantizes itself (`quantize_online`: a linear layer's weight with one scale per output
    channel, MoE experts with block scales: layers/fused_moe.py)."""
    for layer in model.modules():
        if hasattr(layer, "quantize_online"):
            layer.quantize_online()

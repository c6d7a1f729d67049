"""SiLU-and-mul: the gated MLP's activation on the fused gate_up projection."""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import maybe_compile


class SiluAndMul(nn.Module):
    @maybe_compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate] = [gate | up]
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up

"""What kernels' launch parameters read from the GPU: its SM count and shared memory per
program, with the Triton interpreter's stand-ins on CPU; and the weights the 16-bit GEMM
kernels take."""
import functools

import torch

# The Triton interpreter (CPU) runs programs one after another: more programs only cost time.
_INTERPRETER_NUM_SMS = 1
# An H200's opt-in shared memory per block; on CPU, tiles are chosen as for it.
H200_SHARED_MEMORY = 232_448


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def is_hopper_or_later(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0 or later (PDL, TMA copies)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may take (the opt-in limit)."""
    if device.type != "cuda":
        return H200_SHARED_MEMORY
    properties = torch.cuda.get_device_properties(device)
    return getattr(properties, "shared_memory_per_block_optin", properties.shared_memory_per_block)


def is_float_matrix(weight: torch.Tensor) -> bool:
    """Whether weight is a contiguous 2-D float16, bfloat16 or float32 tensor (not FP8): the
    weights the GEMV and the 16-bit GEMM tiles take, before their own limits."""
    return (weight.dim() == 2 and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.is_contiguous())

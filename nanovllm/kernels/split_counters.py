"""Zeroed int32 counters for kernels whose splits merge in the same launch.

A kernel that cuts one output tile's work into splits lets the last split to finish do
the merge: each split stores its partial result, then asks `last_to_count` (a barrier,
since Triton runs a scalar atomic on one thread, whose release covers the other threads'
stores only once they are behind one; then one acq_rel add to the tile's counter), and the
program that brings it to the split count merges; the counter is back at zero. So the
counters are zero between launches, and a launch, or a CUDA graph replaying one, finds
them as the last one left them. Every kernel can use the same buffer: launches on one
stream run one after another, and a kernel launched early (PDL, kernels/pdl.py) touches the
counters only after its gdc_wait, once the kernel before it has finished.
"""
import torch
import triton
import triton.language as tl

# Per device; never freed: a captured graph keeps using the buffer it was captured with,
# so a grown buffer is added, not swapped in.
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_COUNTERS = 1 << 16


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters on device. The first call (on a device, or for a
    larger n) allocates, so it must come before CUDA-graph capture."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a split kernel must run once outside CUDA-graph capture before it is captured")
        buffers.append(torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def last_to_count(counter_ptr, parts):
    """Called by each of `parts` programs after its stores: whether this one is the last to
    count in at counter_ptr. That one has acquired every other program's stores (read them
    with .cg loads, from L2), and the counter is back at zero for the next launch."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == parts - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
    return last

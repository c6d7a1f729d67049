"""Step inputs built on the host in preallocated arrays and copied to the device."""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class StagedBuffer:
    """One step input: a preallocated host array (pinned on CUDA, so the copy does not
    wait) and its device twin. A step fills a leading part of `np` and sends it with
    to_device; nothing is allocated per step but the slices."""

    __slots__ = ("host", "np", "device")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.empty_like(self.host, device=device)

    def to_device(self, *shape: int) -> torch.Tensor:
        """The first `shape` elements (per dimension), on the device."""
        index = tuple(slice(0, n) for n in shape)
        host, dev = self.host[index], self.device[index]
        if dev is not host:
            dev.copy_(host, non_blocking=True)
        return dev


class DoubleBuffered(Generic[T]):
    """Two sets of a step's buffers used in turn: the next step is built in one while the
    step before, still in flight, may be reading the other. Safe because step N's set is
    reused by step N + 2, which the engine prepares only after it has read step N back
    (a step run in two halves included: LLMEngine.step)."""

    def __init__(self, make: Callable[[], T]):
        self._sets = (make(), make())
        self._turn = 0

    def flip(self) -> T:
        """Switch to the other set and return it."""
        self._turn ^= 1
        return self._sets[self._turn]


def host_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or equal-length lists) as a tensor on the device, copied without waiting for
    the GPU (through pinned memory)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def index_lists(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """Equal-length int64 index lists as one [len(lists), n] tensor on the device."""
    return host_values(lists, torch.int64, device)

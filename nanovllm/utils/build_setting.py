"""Settings that layers read while a model is built, set around the construction as
torch.device(...) is: the tensor-parallel group, the MoE options, FP8 weights."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class BuildSetting(Generic[T]):
    def __init__(self, default: T):
        self.value = default

    @contextmanager
    def use(self, value: T) -> Iterator[None]:
        """`value` for the layers built inside the block."""
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous

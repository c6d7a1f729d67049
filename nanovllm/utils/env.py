"""The NANOVLLM_* environment variables: a few settings (README.md), diagnostics and the
switches that A/B measurements set (docs/architecture.md); and whether Triton runs its
kernels through its interpreter."""
from __future__ import annotations

import os


def env_int(name: str, default: int, least: int = 1) -> int:
    """The integer in environment variable `name` (default when unset), at least `least`;
    anything else is refused with the variable's name."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """A switch: environment variable `name` as an integer, 0 off and anything above on
    (default when unset)."""
    return env_int(name, int(default), least=0) > 0


def triton_interpreting() -> bool:
    """Whether TRITON_INTERPRET asks Triton to interpret its kernels (as Triton reads it:
    1, true, on or yes) rather than compile them for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

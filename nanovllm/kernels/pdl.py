"""Programmatic dependent launch (PDL, Hopper and later), as the decode kernels use it.

A kernel launched with PDL may start while the kernel before it still runs, once every
program of that one has called gdc_launch_dependents (or ended). Since each of a chain of
such kernels lets the next start at once, several may run together: a kernel must call
gdc_wait before it reads anything written, or writes anything, since the last kernel
launched without PDL; what depends on nothing (weights) it loads first. A kernel launched
without PDL waits for the one before as always, so a kernel may call gdc_launch_dependents
whoever follows it.

    pdl = pdl_enabled(device)
    launch(kernel, grid, ..., PDL=pdl, **launch_options(pdl))   # kernels/launch.py
"""
from __future__ import annotations

import torch

from nanovllm.kernels.gpu import is_hopper_or_later
from nanovllm.utils.env import env_flag, triton_interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the intrinsics: PDL stays off
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options", "pdl_enabled"]


def pdl_enabled(device: torch.device) -> bool:
    """PDL needs a GPU of compute capability 9.0+, Triton's intrinsics and no interpreter;
    NANOVLLM_PDL=0 switches it off (for A/B measurements)."""
    return (device.type == "cuda" and gdc_wait is not None and env_flag("NANOVLLM_PDL", True)
            and not triton_interpreting() and is_hopper_or_later(device))


def launch_options(pdl: bool) -> dict:
    """The launch's keyword arguments: launch_pdl where PDL is on (pdl_enabled)."""
    return {"launch_pdl": True} if pdl else {}

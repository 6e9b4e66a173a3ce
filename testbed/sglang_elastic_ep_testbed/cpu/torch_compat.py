"""Small gaps in CPU torch that SGLang's device-generic code reaches."""

from __future__ import annotations

import torch


def install() -> None:
    # EPLB calls torch.<device>.empty_cache(); the CPU allocator has nothing to release.
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda: None

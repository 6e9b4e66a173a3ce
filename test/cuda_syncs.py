"""Counting the synchronizing CUDA calls a piece of code makes (the GPU tests' no-sync checks)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch


def count_syncs(fn: Callable[[], Any]) -> tuple[int, Any]:
    """How many synchronizing CUDA calls ``fn`` made (``set_sync_debug_mode("warn")``), and
    what it returned. The one-time warning that the mode is a prototype is not a sync."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) and "prototype" not in str(w.message)
               for w in caught), result

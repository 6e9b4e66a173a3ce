"""Settings the CPU testbed reads from its environment, checked on reading."""

from __future__ import annotations

import os
from collections.abc import Sequence


def env_number(name: str, default: float, low: float, high: float | None = None,
               unit: str = "") -> float:
    """``name``'s value, ``default`` when unset; ValueError naming the range when outside
    ``low``..``high`` or not a number."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = float(raw)
    if value < low or (high is not None and value > high):
        span = f">= {low:g}" if high is None else f"in {low:g}..{high:g}"
        raise ValueError(f"{name} must be {span}{unit}, got {raw}")
    return value


def env_choice(name: str, choices: Sequence[str], default: str) -> str:
    """``name``'s value, ``default`` when unset; ValueError naming ``choices`` when it is none
    of them."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value

"""A pure autoscaling policy: load samples in, a target EP size (or None) out.

Load is queued + running requests per attention shard (one DP-attention replica). The
policy scales up when load per shard stays above ``target_load * up_ratio`` for
``up_checks`` consecutive samples, straight to the size that brings load back to
``target_load``; it scales down one replica at a time when load stays below
``target_load * down_ratio`` for ``down_checks`` samples and the smaller size would still
be at or under ``target_load``. The gap between the ratios is the hysteresis band. After a
decision, and after any operation finished, nothing is decided for ``cooldown_s``. While an
operation runs or a rank is failed, streaks reset and nothing is decided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalerConfig:
    min_size: int
    max_size: int
    ranks_per_shard: int = 1  # attention replica size: sizes move in these steps
    target_load: float = 8.0  # queued + running requests per shard to aim for
    up_ratio: float = 1.25
    down_ratio: float = 0.5
    up_checks: int = 3
    down_checks: int = 10
    cooldown_s: float = 300.0

    def __post_init__(self) -> None:
        g = self.ranks_per_shard
        if g < 1 or self.min_size < g or self.max_size < self.min_size:
            raise ValueError(
                f"need 1 <= ranks_per_shard <= min_size <= max_size (got {g}, "
                f"{self.min_size}, {self.max_size})"
            )
        if self.min_size % g or self.max_size % g:
            raise ValueError("min_size and max_size must be multiples of ranks_per_shard")
        if self.target_load <= 0:
            raise ValueError("target_load must be positive")
        if not 0 <= self.down_ratio < 1 < self.up_ratio:
            raise ValueError("need 0 <= down_ratio < 1 < up_ratio (the hysteresis band)")
        if self.up_checks < 1 or self.down_checks < 1 or self.cooldown_s < 0:
            raise ValueError("up_checks, down_checks must be >= 1 and cooldown_s >= 0")


@dataclass(frozen=True)
class LoadSample:
    now: float  # monotonic seconds
    current_size: int
    queued: Sequence[int]  # per shard
    running: Sequence[int]  # per shard
    busy: bool = False  # an operation is running or a rank is failed


class Autoscaler:
    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._up_streak = 0
        self._down_streak = 0
        self._quiet_until = -math.inf

    def notify_operation_finished(self, now: float) -> None:
        """Start the cooldown when any operation (also one we did not ask for) ends."""
        self._quiet_until = max(self._quiet_until, now + self.config.cooldown_s)

    def decide(self, sample: LoadSample) -> int | None:
        cfg = self.config
        if sample.busy:
            self._up_streak = self._down_streak = 0
            return None
        g = cfg.ranks_per_shard
        shards = max(1, sample.current_size // g)
        total = sum(sample.queued) + sum(sample.running)
        load = total / shards

        self._up_streak = self._up_streak + 1 if load > cfg.target_load * cfg.up_ratio else 0
        self._down_streak = self._down_streak + 1 if load < cfg.target_load * cfg.down_ratio else 0
        if sample.now < self._quiet_until:
            return None

        target: int | None = None
        if not cfg.min_size <= sample.current_size <= cfg.max_size:
            target = min(max(sample.current_size, cfg.min_size), cfg.max_size)
        elif self._up_streak >= cfg.up_checks:
            needed = math.ceil(total / cfg.target_load) * g
            target = min(cfg.max_size, max(needed, sample.current_size + g))
        elif self._down_streak >= cfg.down_checks:
            smaller = sample.current_size - g
            if smaller >= cfg.min_size and total / (smaller // g) <= cfg.target_load:
                target = smaller
        if target is None or target == sample.current_size:
            return None
        self._up_streak = self._down_streak = 0
        self._quiet_until = sample.now + cfg.cooldown_s
        return target

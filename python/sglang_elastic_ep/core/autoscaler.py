"""A pure autoscaling policy: load samples in, a target EP size (or a reason to hold) out.

The load signal is queued + running requests per active rank, and the KV-cache usage
(0..1) where the server reports it. The policy scales up when the signal stays above its
up threshold (``scale_up_load``, or ``kv_scale_up`` for the KV usage) for ``up_window_s``,
straight to the size that brings the load back to ``target_load`` (at most ``max_step_up``
ranks at once). It scales down one ``step`` at a time when the load stays below
``scale_down_load`` (and the KV usage below ``kv_scale_down``) for ``down_window_s``, and only
if the smaller size would still carry at most ``target_load`` per rank (and fill at most the
middle of the KV band). The gap between the thresholds is the hysteresis band: resizes aim
inside it, so the same load does not reverse them. Nothing is decided for ``cooldown_s``
after the server's last operation finished (any operation, also one someone else asked for)
or after a decision of this policy. While the deployment is busy (an operation runs, a rank
failed) the windows restart. Sizes never leave ``[min_size, max_size]``: a size outside is
pulled back in.

Time is whatever clock the caller passes as ``now``; ``last_finished_at`` must come from the
same clock (the controller uses wall-clock seconds, as the server's status does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AutoscalerConfig:
    min_size: int
    max_size: int
    step: int = 1  # ranks per joiner (an attention replica): sizes move in these steps
    scale_up_load: float = 8.0  # queued + running requests per active rank
    scale_down_load: float = 2.0
    target_load: float | None = None  # a resize aims here; default: between the thresholds
    kv_scale_up: float | None = 0.9  # KV-cache usage counts as hot above this; None: ignore
    kv_scale_down: float = 0.5  # and a scale-down also needs it below this, where reported
    up_window_s: float = 60.0
    down_window_s: float = 300.0
    cooldown_s: float = 300.0
    max_step_up: int | None = None  # most ranks one scale-up adds; None: no limit

    def __post_init__(self) -> None:
        g = self.step
        if g < 1 or self.min_size < g or self.max_size < self.min_size:
            raise ValueError(
                f"need 1 <= step <= min_size <= max_size (got {g}, {self.min_size}, "
                f"{self.max_size})"
            )
        if self.min_size % g or self.max_size % g:
            raise ValueError(f"min_size and max_size must be multiples of step ({g})")
        if not 0 <= self.scale_down_load < self.scale_up_load:
            raise ValueError(
                f"need 0 <= scale_down_load < scale_up_load (got {self.scale_down_load}, "
                f"{self.scale_up_load}): the gap is the hysteresis band"
            )
        if not self.scale_down_load < self.effective_target <= self.scale_up_load:
            raise ValueError(
                f"target_load must be above scale_down_load and at most scale_up_load "
                f"(got {self.target_load})"
            )
        if self.kv_scale_up is not None and not 0 <= self.kv_scale_down < self.kv_scale_up <= 1:
            raise ValueError(
                f"need 0 <= kv_scale_down < kv_scale_up <= 1 (got {self.kv_scale_down}, "
                f"{self.kv_scale_up})"
            )
        if min(self.up_window_s, self.down_window_s, self.cooldown_s) < 0:
            raise ValueError("windows and cooldown must be >= 0 seconds")
        if self.max_step_up is not None and (self.max_step_up < g or self.max_step_up % g):
            raise ValueError(f"max_step_up must be a positive multiple of step ({g})")

    @property
    def effective_target(self) -> float:
        if self.target_load is not None:
            return self.target_load
        return (self.scale_up_load + self.scale_down_load) / 2


@dataclass(frozen=True)
class LoadSample:
    now: float
    current_size: int  # the server's effective EP size
    active_ranks: int  # ranks serving now
    queued_per_rank: float | None = None  # None: the server reports no load
    running_per_rank: float | None = None
    kv_usage: float | None = None  # 0..1, None where not reported
    busy: bool = False  # an operation runs or a rank failed: hold, restart the windows
    last_finished_at: float | None = None  # when the server's newest operation finished

    @property
    def load_per_rank(self) -> float | None:
        if self.queued_per_rank is None and self.running_per_rank is None:
            return None
        return (self.queued_per_rank or 0.0) + (self.running_per_rank or 0.0)


@dataclass(frozen=True)
class Verdict:
    """``target`` is the size to scale to, or None to hold; ``reason`` says why either way."""

    target: int | None
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


class Autoscaler:
    """The policy with its windows; everything else it needs comes in the sample."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._hot_since: float | None = None
        self._cold_since: float | None = None
        self._quiet_until = -math.inf  # after our own decision, before the server shows it

    def decide(self, sample: LoadSample) -> Verdict:
        cfg = self.config
        load = sample.load_per_rank
        kv = sample.kv_usage
        inputs: dict[str, Any] = {
            "size": sample.current_size,
            "active_ranks": sample.active_ranks,
            "queued_per_rank": _round(sample.queued_per_rank),
            "running_per_rank": _round(sample.running_per_rank),
            "load_per_rank": _round(load),
            "kv_usage": _round(kv),
        }
        if sample.busy:
            self._hot_since = self._cold_since = None
            return Verdict(None, "busy: an operation runs or a rank is failed", inputs)

        hot = (load is not None and load > cfg.scale_up_load) or (
            cfg.kv_scale_up is not None and kv is not None and kv > cfg.kv_scale_up
        )
        cold = (
            load is not None
            and load < cfg.scale_down_load
            and (kv is None or cfg.kv_scale_up is None or kv < cfg.kv_scale_down)
        )
        now = sample.now
        self._hot_since = (self._hot_since if self._hot_since is not None else now) if hot else None
        self._cold_since = (
            (self._cold_since if self._cold_since is not None else now) if cold else None
        )
        hot_for = now - self._hot_since if self._hot_since is not None else 0.0
        cold_for = now - self._cold_since if self._cold_since is not None else 0.0
        inputs.update(hot_for_s=_round(hot_for), cold_for_s=_round(cold_for))

        quiet_until = self._quiet_until
        if sample.last_finished_at is not None:
            quiet_until = max(quiet_until, sample.last_finished_at + cfg.cooldown_s)
        if now < quiet_until:
            return Verdict(None, f"cooldown for {quiet_until - now:.0f}s more", inputs)

        size = sample.current_size
        if size < cfg.min_size or size > cfg.max_size:
            target = min(max(size, cfg.min_size), cfg.max_size)
            return self._decided(
                target, now, f"size {size} is outside [{cfg.min_size}, {cfg.max_size}]", inputs
            )
        if load is None and kv is None:
            return Verdict(None, "no load signal (is the server run with --enable-metrics?)",
                           inputs)
        if hot:
            if hot_for < cfg.up_window_s:
                return Verdict(None, f"hot for {hot_for:.0f}s of {cfg.up_window_s:g}s", inputs)
            return self._scale_up(sample, load, kv, now, hot_for, inputs)
        if cold:
            if cold_for < cfg.down_window_s:
                return Verdict(
                    None, f"cold for {cold_for:.0f}s of {cfg.down_window_s:g}s", inputs
                )
            return self._scale_down(sample, load, kv, now, cold_for, inputs)
        return Verdict(None, "load inside the hysteresis band", inputs)

    def _scale_up(
        self,
        sample: LoadSample,
        load: float | None,
        kv: float | None,
        now: float,
        hot_for: float,
        inputs: dict[str, Any],
    ) -> Verdict:
        cfg = self.config
        g = cfg.step
        size = sample.current_size
        if size >= cfg.max_size:
            return Verdict(None, f"hot for {hot_for:.0f}s but already at --max-size {size}",
                           inputs)
        needed = size + g
        if load is not None:
            total = load * max(1, sample.active_ranks)
            needed = max(needed, math.ceil(total / cfg.effective_target / g) * g)
        target = min(cfg.max_size, needed)
        if cfg.max_step_up is not None:
            target = min(target, size + cfg.max_step_up)
        what = f"load {load:.2f}/rank > {cfg.scale_up_load:g}" if (
            load is not None and load > cfg.scale_up_load
        ) else f"KV usage {kv:.2f} > {cfg.kv_scale_up:g}"
        return self._decided(target, now, f"{what} for {hot_for:.0f}s", inputs)

    def _scale_down(
        self,
        sample: LoadSample,
        load: float | None,
        kv: float | None,
        now: float,
        cold_for: float,
        inputs: dict[str, Any],
    ) -> Verdict:
        cfg = self.config
        size = sample.current_size
        smaller = size - cfg.step
        if smaller < cfg.min_size:
            return Verdict(None, f"cold for {cold_for:.0f}s but already at --min-size {size}",
                           inputs)
        assert load is not None  # cold needs a load reading
        ranks = max(1, sample.active_ranks)
        after = load * ranks / smaller
        if after > cfg.effective_target:
            return Verdict(
                None,
                f"cold, but {smaller} ranks would carry {after:.2f}/rank > target "
                f"{cfg.effective_target:g}",
                inputs,
            )
        if kv is not None and cfg.kv_scale_up is not None:
            # The KV cache fills up on fewer ranks too: land mid-band, not at the hot line.
            kv_after = kv * ranks / smaller
            kv_mid = (cfg.kv_scale_down + cfg.kv_scale_up) / 2
            if kv_after > kv_mid:
                return Verdict(
                    None,
                    f"cold, but {smaller} ranks would fill {kv_after:.2f} of the KV cache > "
                    f"{kv_mid:g}",
                    inputs,
                )
        return self._decided(
            smaller, now, f"load {load:.2f}/rank < {cfg.scale_down_load:g} for {cold_for:.0f}s",
            inputs,
        )

    def _decided(self, target: int, now: float, reason: str, inputs: dict[str, Any]) -> Verdict:
        self._hot_since = self._cold_since = None
        self._quiet_until = now + self.config.cooldown_s
        return Verdict(target, reason, inputs)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)

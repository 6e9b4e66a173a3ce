"""Per-expert compute latency on the CPU engine, for the health monitor (GET /elastic_ep/health).

The CPU expert runner calls :meth:`ExpertTimer.record` after each local expert with rows
(``run_packed_experts(on_expert_done=...)``). The timer keeps, per local slot, a moving average
of seconds per token row and the rows computed so far; the membership step gathers them from
every rank (sglang/expert_health.py).

Test-only fault injection: ``SGLANG_EEP_TEST_SLOW_EXPERTS=<rank>:<factor>`` makes that rank's
experts really take ``factor`` times as long (it sleeps the difference), as a failing GPU or a
thermally throttled one would.
"""

from __future__ import annotations

import os
import time

ENV_TEST_SLOW_EXPERTS = "SGLANG_EEP_TEST_SLOW_EXPERTS"
SMOOTHING = 0.2  # weight of the newest sample in the moving average


def slowdown_for(spec: str | None, rank: int) -> float:
    """The injected slowdown factor for ``rank`` (1.0: none)."""
    if not spec:
        return 1.0
    target, _, factor = spec.partition(":")
    if int(target) != rank:
        return 1.0
    value = float(factor)
    if value < 1.0:
        raise ValueError(f"{ENV_TEST_SLOW_EXPERTS}: factor must be >= 1, got {value}")
    return value


class ExpertTimer:
    @classmethod
    def from_environment(cls, rank: int) -> ExpertTimer:
        """With the injected slowdown as the server's environment set it before start (read
        once here; ``record`` runs after every expert and reads only ``slowdown``)."""
        return cls(slowdown_for(os.environ.get(ENV_TEST_SLOW_EXPERTS), rank))

    def __init__(self, slowdown: float = 1.0) -> None:
        self.slowdown = slowdown
        self.seconds_per_row: list[float] = []
        self.rows: list[int] = []

    def record(self, expert: int, rows: int, seconds: float) -> None:
        if self.slowdown > 1.0:
            extra = seconds * (self.slowdown - 1.0)
            time.sleep(extra)
            seconds += extra
        if expert >= len(self.rows):
            grow = expert + 1 - len(self.rows)
            self.seconds_per_row += [0.0] * grow
            self.rows += [0] * grow
        sample = seconds / rows
        before = self.seconds_per_row[expert]
        self.seconds_per_row[expert] = (
            sample if before == 0.0 else (1 - SMOOTHING) * before + SMOOTHING * sample
        )
        self.rows[expert] += rows

    def snapshot(self, local_slots: int) -> tuple[list[int], list[int]]:
        """(nanoseconds per row, rows) for ``local_slots`` slots (zeros where never run)."""
        ns = [int(v * 1e9) for v in self.seconds_per_row[:local_slots]]
        rows = list(self.rows[:local_slots])
        pad = local_slots - len(ns)
        return ns + [0] * pad, rows + [0] * pad


_timer: ExpertTimer | None = None


def expert_timer() -> ExpertTimer:
    """This process's timer (one EP rank per scheduler process). Process-wide because its two
    users share no object: the CPU MoE layer records into it, the per-pass step reads it."""
    global _timer
    if _timer is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        _timer = ExpertTimer.from_environment(rank)
    return _timer

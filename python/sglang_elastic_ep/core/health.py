"""Rank health from per-expert latency and liveness, with failure persistence counting.

An expert is slow when its latency exceeds ``latency_threshold`` x the median over all
experts measured in the same check. A rank is unhealthy in a check when it is not alive or
when at least ``rank_failure_ratio`` of its measured experts are slow. A rank unhealthy for
``persistence_threshold`` consecutive checks (``dead_rank_threshold`` when not alive) is
hard-blocked: it gets a ``RecoveryRequired`` decision once and stays blocked until
``clear()`` (after it was recovered or removed). One healthy check resets the streak; a check
in which none of a live rank's experts was measured leaves it as it was.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sglang_elastic_ep.core.api_models import (
    ExpertHealthStatus,
    HealthResponse,
    RankHealthStatus,
)


@dataclass(frozen=True)
class HealthConfig:
    latency_threshold: float = 3.0
    rank_failure_ratio: float = 0.5
    persistence_threshold: int = 10
    dead_rank_threshold: int = 1

    def __post_init__(self) -> None:
        if self.latency_threshold <= 1.0:
            raise ValueError("latency_threshold must be > 1 (a multiple of the median)")
        if not 0.0 < self.rank_failure_ratio <= 1.0:
            raise ValueError("rank_failure_ratio must be in (0, 1]")
        if self.persistence_threshold < 1 or self.dead_rank_threshold < 1:
            raise ValueError("thresholds must be >= 1 check")


def _valid(latency: float | None) -> bool:
    return latency is not None and math.isfinite(latency) and latency >= 0


def classify_expert_latency(
    latencies: Mapping[int, float | None], *, threshold: float = 3.0
) -> tuple[dict[int, bool], float | None]:
    """Healthy flag per expert and the median used; experts without a sample count healthy."""
    measured = [v for v in latencies.values() if v is not None and _valid(v)]
    if not measured:
        return {e: True for e in latencies}, None
    median = statistics.median(measured)
    limit = threshold * median
    healthy = {e: v is None or not _valid(v) or v <= limit for e, v in latencies.items()}
    return healthy, median


@dataclass(frozen=True)
class RecoveryRequired:
    ranks: tuple[int, ...]
    reason: str

    @property
    def suggested_action(self) -> str:
        ranks = list(self.ranks)
        return (
            f"relaunch rank(s) {ranks} with --elastic-ep-join-mode recover, or scale down "
            f"to remove them if they are the tail ranks"
        )


@dataclass
class _RankRecord:
    alive: bool = True
    healthy: bool = True
    consecutive: int = 0
    total: int = 0
    hard_blocked: bool = False
    unhealthy_experts: list[int] = field(default_factory=list)


class RankHealthMonitor:
    """Feed one ``observe()`` per health check; not thread-safe (one owner)."""

    def __init__(self, ranks: Iterable[int], config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self._ranks: dict[int, _RankRecord] = {r: _RankRecord() for r in sorted(ranks)}
        self.checks = 0
        self._median: float | None = None
        self._experts: list[ExpertHealthStatus] = []

    @property
    def hard_blocked(self) -> frozenset[int]:
        return frozenset(r for r, rec in self._ranks.items() if rec.hard_blocked)

    def set_ranks(self, ranks: Iterable[int]) -> None:
        """Follow a membership change: keep records of staying ranks, start fresh for new."""
        wanted = set(ranks)
        self._ranks = {r: self._ranks.get(r, _RankRecord()) for r in sorted(wanted)}

    def clear(self, rank: int) -> None:
        """Forget a rank's failures (it was recovered or replaced)."""
        if rank in self._ranks:
            self._ranks[rank] = _RankRecord()

    def observe(
        self,
        *,
        alive: Mapping[int, bool],
        expert_latency: Mapping[int, float | None],
        expert_rank: Mapping[int, int],
    ) -> RecoveryRequired | None:
        """One health check. ``expert_latency``/``expert_rank`` are keyed by physical expert.

        Returns a decision only for ranks that became hard-blocked in this check.
        """
        self.checks += 1
        healthy_expert, self._median = classify_expert_latency(
            expert_latency, threshold=self.config.latency_threshold
        )
        self._experts = [
            ExpertHealthStatus(
                physical_expert=e,
                rank=expert_rank[e],
                latency_s=expert_latency[e] if _valid(expert_latency[e]) else None,
                healthy=healthy_expert[e],
            )
            for e in sorted(expert_latency)
            if e in expert_rank
        ]

        newly_blocked: list[int] = []
        reasons: list[str] = []
        for rank, rec in self._ranks.items():
            measured = [
                e for e, r in expert_rank.items() if r == rank and _valid(expert_latency.get(e))
            ]
            was_alive = rec.alive
            rec.alive = alive.get(rank, True)
            if rec.alive and was_alive and not measured:
                # None of its experts ran in this check (no tokens, or a liveness-only
                # check): no evidence either way, so the streak stands.
                continue
            slow = [e for e in measured if not healthy_expert[e]]
            rec.unhealthy_experts = sorted(slow)
            slow_ratio = len(slow) / len(measured) if measured else 0.0
            rec.healthy = rec.alive and slow_ratio < self.config.rank_failure_ratio
            if rec.healthy:
                rec.consecutive = 0
                continue
            rec.consecutive += 1
            rec.total += 1
            limit = (
                self.config.dead_rank_threshold
                if not rec.alive
                else self.config.persistence_threshold
            )
            if not rec.hard_blocked and rec.consecutive >= limit:
                rec.hard_blocked = True
                newly_blocked.append(rank)
                reasons.append(
                    f"rank {rank} not alive for {rec.consecutive} check(s)"
                    if not rec.alive
                    else f"rank {rank} had {len(slow)}/{len(measured)} slow experts "
                    f"(> {self.config.latency_threshold:g}x median) for {rec.consecutive} checks"
                )
        if not newly_blocked:
            return None
        return RecoveryRequired(ranks=tuple(newly_blocked), reason="; ".join(reasons))

    def to_response(self, instance_id: str) -> HealthResponse:
        return HealthResponse(
            instance_id=instance_id,
            checks=self.checks,
            latency_threshold=self.config.latency_threshold,
            persistence_threshold=self.config.persistence_threshold,
            median_latency_s=self._median,
            ranks=[
                RankHealthStatus(
                    rank=rank,
                    alive=rec.alive,
                    healthy=rec.healthy,
                    consecutive_unhealthy_checks=rec.consecutive,
                    total_unhealthy_checks=rec.total,
                    hard_blocked=rec.hard_blocked,
                    unhealthy_experts=rec.unhealthy_experts,
                )
                for rank, rec in self._ranks.items()
            ],
            experts=list(self._experts),
        )


@dataclass(frozen=True)
class ExpertTimings:
    """Per-physical-expert compute time as the schedulers report it (rank 0 gathers them).

    ``ns_per_row[p]`` is the recent compute time per token row of physical expert ``p`` (0: no
    sample yet); ``rows[p]`` counts the rows it computed so far. Physical expert ``p`` lives on
    rank ``p // local_slots`` (SGLang's layout)."""

    local_slots: int
    ns_per_row: tuple[int, ...]
    rows: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.local_slots < 1:
            raise ValueError(f"local_slots must be >= 1, got {self.local_slots}")
        if len(self.ns_per_row) != len(self.rows) or len(self.rows) % self.local_slots:
            raise ValueError(
                f"{len(self.ns_per_row)} latencies and {len(self.rows)} row counts for "
                f"{self.local_slots} slots per rank"
            )

    def rank_of(self, physical_expert: int) -> int:
        return physical_expert // self.local_slots

    def for_monitor(self, ranks: Iterable[int]) -> tuple[dict[int, float | None], dict[int, int]]:
        """(latency in seconds per row or None, rank) per physical expert of ``ranks``: the
        ``expert_latency``/``expert_rank`` arguments of :meth:`RankHealthMonitor.observe`."""
        wanted = set(ranks)
        latency: dict[int, float | None] = {}
        owner: dict[int, int] = {}
        for p, ns in enumerate(self.ns_per_row):
            rank = self.rank_of(p)
            if rank not in wanted:
                continue
            owner[p] = rank
            latency[p] = ns / 1e9 if ns > 0 and self.rows[p] > 0 else None
        return latency, owner


def blockable_ranks(
    candidates: Iterable[int],
    physical_to_logical: Sequence[int],
    local_slots: int,
    serving: Iterable[int],
) -> tuple[frozenset[int], dict[int, list[int]]]:
    """Which ``candidates`` can stop receiving tokens without an expert losing its last replica
    among the ``serving`` ranks (one MoE layer's map; every layer has the same placement here).

    Returns (blockable ranks, rank -> logical experts that only it would still serve) for the
    ranks that cannot be blocked. Candidates are taken in order; each one blocked narrows what
    the next may rely on."""
    serving_now = set(serving)
    blocked: set[int] = set()
    kept: dict[int, list[int]] = {}

    def logical_on(ranks: set[int]) -> set[int]:
        return {e for p, e in enumerate(physical_to_logical)
                if e >= 0 and p // local_slots in ranks}

    for rank in sorted(set(candidates)):
        if rank not in serving_now:
            continue
        without = serving_now - blocked - {rank}
        lost = sorted(logical_on(serving_now - blocked) - logical_on(without))
        if lost:
            kept[rank] = lost
        else:
            blocked.add(rank)
    return frozenset(blocked), kept

"""Checks a scale target against the facts of the running cluster.

Decisions:
- Target equal to the current size is a no-op answered with 200 (absolute targets are
  idempotent: an orchestrator that retries after success must not see an error).
- Ranks join and leave at the tail: scale-up adds [current, target), scale-down removes
  [target, current). A rank-explicit removal (``remove_ranks``) must name that tail.
- A size must be a whole number of attention replicas (upstream Scheduler rule:
  ``new_ep_size % (attn_tp_size * attn_cp_size) == 0``).
- While a rank inside the current size has failed, scale-up is refused (409), and the only
  scale-down allowed is the one that removes exactly the failed ranks (so they must be the
  tail); anything else would mix cleanup and resizing in one operation.
- A scale-down below the launch size releases launch-time slots and says so: a later
  scale-up refills them with scale joiners at those offsets, as for any other slot.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

from sglang_elastic_ep.core.api_models import RejectionReason


class ScaleDirection(str, enum.Enum):
    UP = "up"
    DOWN = "down"
    NOOP = "noop"


@dataclass(frozen=True)
class ScaleTopology:
    max_ep_size: int
    attn_replica_size: int = 1  # attn_tp_size * attn_cp_size: ranks per attention replica
    num_logical_experts: int | None = None
    slots_per_rank: int | None = None  # physical expert slots per rank, fixed at launch
    launch_size: int | None = None  # ranks at launch: a shrink below it releases launch-time slots

    def __post_init__(self) -> None:
        if self.max_ep_size < 1 or self.attn_replica_size < 1:
            raise ValueError("max_ep_size and attn_replica_size must be >= 1")
        if self.max_ep_size % self.attn_replica_size:
            raise ValueError(
                f"max_ep_size {self.max_ep_size} is not a multiple of the attention replica "
                f"size {self.attn_replica_size}"
            )

    @property
    def min_ep_size(self) -> int:
        """Smallest size that is a whole number of replicas and holds every expert once."""
        size = self.attn_replica_size
        if self.num_logical_experts and self.slots_per_rank:
            needed = -(-self.num_logical_experts // self.slots_per_rank)
            size = max(size, -(-needed // self.attn_replica_size) * self.attn_replica_size)
        return size


@dataclass(frozen=True)
class ScaleVerdict:
    ok: bool
    status: int  # HTTP status to answer with
    message: str
    direction: ScaleDirection | None = None  # None when refused
    joining_ranks: tuple[int, ...] = ()
    leaving_ranks: tuple[int, ...] = ()
    reason: RejectionReason | None = None


def _refuse(status: HTTPStatus, reason: RejectionReason, message: str) -> ScaleVerdict:
    return ScaleVerdict(ok=False, status=int(status), message=message, reason=reason)


def _ranks(ranks: Iterable[int]) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


def resolve_removal(ranks: Iterable[int], current_size: int) -> int | ScaleVerdict:
    """``remove_ranks`` as the size it leaves, or why it cannot be done. Only the tail leaves
    (the active set stays a prefix: routing, expert placement and upstream's DP attention
    count ranks from 0), so the set must be the highest ranks of ``current_size``."""
    named = sorted(set(ranks))
    unknown = [r for r in named if r >= current_size]
    if unknown:
        return _refuse(
            HTTPStatus.BAD_REQUEST, RejectionReason.UNKNOWN_RANKS,
            f"remove_ranks {_ranks(unknown)} are not in the current EP size {current_size} "
            f"(ranks 0..{current_size - 1}); nothing changed",
        )
    tail = list(range(current_size - len(named), current_size))
    if 0 in named:
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.RANK_ZERO,
            "rank 0 hosts the HTTP server and the DP router and cannot be removed; "
            + (f'remove the {len(named)} highest ranks instead: {{"remove_ranks": '
               f"{_ranks(tail)}}}" if len(named) < current_size
               else "to stop serving, shut the server down"),
        )
    if named != tail:
        holes = sorted(set(range(current_size)) - set(named))
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.NOT_THE_TAIL,
            f"removing {_ranks(named)} would leave the active ranks {_ranks(holes)} with a "
            "hole, and this build removes ranks from the tail only; remove the "
            f'{len(named)} highest ranks instead ({{"remove_ranks": {_ranks(tail)}}}, the same '
            f"as new_ep_size {current_size - len(named)}), or relaunch a failed rank with "
            "--ep-join-mode recover",
        )
    return current_size - len(named)


def validate_scale(
    target: int,
    *,
    current_size: int,
    topology: ScaleTopology,
    failed_ranks: Iterable[int] = (),
) -> ScaleVerdict:
    """Decide whether scaling from ``current_size`` to ``target`` may start now. A refusal
    names only sizes that would be accepted in the same state."""
    failed = frozenset(r for r in failed_ranks if 0 <= r < current_size)

    def accepted(size: int) -> bool:
        return size != current_size and _judge(size, current_size, topology, failed, None).ok

    return _judge(target, current_size, topology, failed, accepted)


def _judge(
    target: int,
    current_size: int,
    topology: ScaleTopology,
    failed: frozenset[int],
    accepted: Callable[[int], bool] | None,
) -> ScaleVerdict:
    """The verdict; ``accepted`` (None while judging a hint itself) filters the sizes a
    refusal suggests."""
    replica = topology.attn_replica_size

    def first(sizes: Iterable[int]) -> int | None:
        return next((s for s in sizes if accepted is not None and accepted(s)), None)

    if target < 1:
        return _refuse(
            HTTPStatus.BAD_REQUEST,
            RejectionReason.INVALID_TARGET,
            f"new_ep_size must be at least 1 (got {target})",
        )
    if target > topology.max_ep_size:
        largest = first(range(topology.max_ep_size, current_size, -1))
        hint = (f"the largest size accepted now is {largest}; " if largest is not None
                else "")
        return _refuse(
            HTTPStatus.BAD_REQUEST,
            RejectionReason.EXCEEDS_MAX_EP_SIZE,
            f"new_ep_size ({target}) exceeds --max-ep-size ({topology.max_ep_size}); "
            f"{hint}restart with a larger --max-ep-size to go beyond it",
        )
    if target % replica:
        lower = target // replica * replica
        options = [str(s) for s in (lower, lower + replica)
                   if 1 <= s <= topology.max_ep_size and accepted is not None and accepted(s)]
        example = f" (e.g. {' or '.join(options)})" if options else ""
        return _refuse(
            HTTPStatus.BAD_REQUEST,
            RejectionReason.INCOMPLETE_ATTENTION_REPLICA,
            f"new_ep_size ({target}) would leave an incomplete attention replica of "
            f"{replica} ranks; use a multiple of {replica}{example}",
        )
    if target < topology.min_ep_size:
        smallest = first(range(topology.min_ep_size, current_size))
        hint = (f"the smallest size accepted now is {smallest}" if smallest is not None
                else f"keep {current_size} ranks (no smaller size is accepted now)")
        return _refuse(
            HTTPStatus.BAD_REQUEST,
            RejectionReason.TOO_FEW_EXPERT_SLOTS,
            f"new_ep_size ({target}) gives {target * (topology.slots_per_rank or 0)} expert "
            f"slots for {topology.num_logical_experts} experts (at least "
            f"{topology.min_ep_size} ranks are needed); {hint}",
        )
    if target == current_size:
        return ScaleVerdict(
            ok=True,
            status=int(HTTPStatus.OK),
            message=f"Already at {target} EP ranks; nothing to do",
            direction=ScaleDirection.NOOP,
        )

    removable = frozenset(range(target, current_size))
    removal_target = _removal_target(failed, current_size, topology)
    if failed and target > current_size:
        remove_hint = (
            f", or remove them by scaling down to {removal_target}"
            if removal_target is not None
            else ""
        )
        return _refuse(
            HTTPStatus.CONFLICT,
            RejectionReason.FAILED_RANKS_PRESENT,
            f"rank(s) {_ranks(failed)} failed; recover or remove rank(s) {_ranks(failed)} "
            f"first (relaunch them with --elastic-ep-join-mode recover{remove_hint}), "
            "then scale up",
        )
    if failed and removable != failed:
        fix = (
            f"scale down to exactly {removal_target}"
            if removal_target is not None
            else "they cannot be removed that way, so relaunch them with "
            "--elastic-ep-join-mode recover instead"
        )
        return _refuse(
            HTTPStatus.CONFLICT,
            RejectionReason.MUST_REMOVE_FAILED_RANKS,
            f"rank(s) {_ranks(failed)} failed; while they are down a scale-down may only "
            f"remove exactly them, and ranks leave from the tail: {fix}",
        )

    if target > current_size:
        joining = tuple(range(current_size, target))
        return ScaleVerdict(
            ok=True,
            status=int(HTTPStatus.OK),
            message=f"Scaling initiated from {current_size} to {target}, polling for new ranks",
            direction=ScaleDirection.UP,
            joining_ranks=joining,
        )
    leaving = tuple(range(target, current_size))
    launch = topology.launch_size
    one_way = ""
    if launch is not None and target < launch:
        one_way = (f"; ranks {_ranks(range(target, min(current_size, launch)))} are launch-time"
                   " slots: they come back as scale joiners at their own offsets")
    return ScaleVerdict(
        ok=True,
        status=int(HTTPStatus.OK),
        message=(
            f"Scaling initiated from {current_size} to {target}, draining ranks "
            f"{_ranks(leaving)}{one_way}"
        ),
        direction=ScaleDirection.DOWN,
        leaving_ranks=leaving,
    )


def _removal_target(
    failed: frozenset[int], current_size: int, topology: ScaleTopology
) -> int | None:
    """The one scale-down target that removes exactly the failed ranks, if there is one."""
    if not failed:
        return None
    target = current_size - len(failed)
    if failed != frozenset(range(target, current_size)):
        return None  # not the tail
    if target % topology.attn_replica_size or target < topology.min_ep_size:
        return None
    return target

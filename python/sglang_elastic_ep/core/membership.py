"""A snapshot of which EP rank slots are active, pending, failed, leaving, released or removed."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sglang_elastic_ep.core.api_models import RankState, RankStatus


@dataclass(frozen=True)
class Membership:
    max_size: int
    # Slots [0, effective_size) are managed: serving, failed in place, or removed (holes).
    effective_size: int
    pending_size: int | None = None  # target of a running scale-up
    failed: frozenset[int] = field(default_factory=frozenset)
    leaving: frozenset[int] = field(default_factory=frozenset)  # running scale-down
    safe_to_terminate: frozenset[int] = field(default_factory=frozenset)
    # Failed slots below the tail that the operator removed (``remove_ranks``): holes in the
    # active set, counted in no size until a replacement refills them.
    removed: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not 1 <= self.effective_size <= self.max_size:
            raise ValueError(
                f"effective_size {self.effective_size} must be in [1, {self.max_size}]"
            )
        for name in ("failed", "leaving", "safe_to_terminate", "removed"):
            ranks: frozenset[int] = getattr(self, name)
            bad = sorted(r for r in ranks if not 0 <= r < self.max_size)
            if bad:
                raise ValueError(f"{name} ranks {bad} are outside [0, {self.max_size})")
        if self.removed & self.failed:
            raise ValueError(f"ranks {sorted(self.removed & self.failed)} cannot be both "
                             "failed and removed")

    def rank_state(self, rank: int) -> RankState:
        # Order matters: a released rank may also have failed; "released" is what to act on.
        if rank in self.safe_to_terminate:
            return RankState.SAFE_TO_TERMINATE
        if rank in self.failed:
            return RankState.FAILED
        if rank in self.leaving:
            return RankState.LEAVING
        if rank in self.removed:  # a hole; pending while a scale-up refills it
            return RankState.INACTIVE if self.pending_size is None else RankState.PENDING
        if rank < self.effective_size:
            return RankState.ACTIVE
        if self.pending_size is not None and rank < self.pending_size:
            return RankState.PENDING
        return RankState.INACTIVE

    def rank_statuses(self) -> list[RankStatus]:
        return [RankStatus(rank=r, state=self.rank_state(r)) for r in range(self.max_size)]

    def failed_in_range(self) -> frozenset[int]:
        return frozenset(r for r in self.failed if r < self.effective_size)

    def managed_ranks(self) -> list[int]:
        """The slots inside the effective size that are not holes (serving or failed)."""
        return [r for r in range(self.effective_size) if r not in self.removed]

    @property
    def serving_size(self) -> int:
        """The EP size an orchestrator reads: the managed slots, holes not counted."""
        return len(self.managed_ranks())

    def failed_tail(self, launch_size: int) -> FailedTail | None:
        """The failed tail of scale-joined ranks as the survivors see it: holes count as down.

        A scale-joined rank is removed where it is only below a live rank. Should every rank
        above it fail later, the survivors find one failed tail from it to the top, let all of
        it go and re-admit replacements from its lowest slot: the hole is awaited again."""
        mask = [0 if r in self.failed or r in self.removed else 1
                for r in range(self.effective_size)]
        return failed_tail(mask, self.effective_size, launch_size)


def is_recovery_join(rank_ids: Iterable[int], ever_active: Iterable[int]) -> bool:
    """The RFC's contract ("Distinguishing scale from recovery"): a join is a recovery when
    every joining rank was active before (replacements sync expert locations and keep EPLB's
    state), a scale-up when none was (EPLB may place experts on the new ranks). A mix is
    refused."""
    joining = set(rank_ids)
    before = joining & set(ever_active)
    if before and before != joining:
        raise ValueError(
            f"ranks {sorted(before)} were active before and {sorted(joining - before)} were not:"
            " recover and scale in separate operations"
        )
    return bool(joining) and before == joining


class JoinKind(str, enum.Enum):
    """What a join does to EPLB (the RFC's ``is_recovery_join``)."""

    RECOVERY = "recovery"  # the slots served before: EPLB's statistics are stale, reset it
    SCALE_UP = "scale-up"  # new slots: EPLB re-arms on the new layout and may rebalance


class SlotHistory:
    """Which EP slots were ever active since their experts last left the layout, per process.

    Every membership event shows the mask (:meth:`observe`); a slot cut from the expert map
    (scale-down, letting go of a failed tail) is forgotten (:meth:`release`), because its next
    join gets fresh slots appended to the map, exactly as a new rank would. :meth:`join_kind`
    answers the RFC's question for a join: "were these ranks previously active?"
    """

    def __init__(self, initially_active: Iterable[int] = ()) -> None:
        self._ever: set[int] = {int(r) for r in initially_active}

    @property
    def ever_active(self) -> frozenset[int]:
        return frozenset(self._ever)

    def observe(self, mask: Sequence[int]) -> None:
        self._ever.update(r for r, v in enumerate(mask) if v)

    def release(self, ranks: Iterable[int]) -> None:
        self._ever.difference_update(int(r) for r in ranks)

    def join_kind(self, rank_ids: Iterable[int]) -> JoinKind:
        """Raises ``ValueError`` for a mix of old and new slots (see :func:`is_recovery_join`)."""
        if is_recovery_join(rank_ids, self._ever):
            return JoinKind.RECOVERY
        return JoinKind.SCALE_UP


def p2p_peers_mask(active: Sequence[int], rank: int, launch_size: int) -> list[int]:
    """The active mask this rank shows to a weight update whose point-to-point transfers must
    stay between launch-time ranks (both ends of a transfer compute the same answer):
    a launch-time rank keeps the active launch-time ranks; a rank that joined by scale-up
    keeps only itself. Transfers to the masked ranks are skipped by the sender, and the
    receiver loads those experts from the checkpoint instead."""
    if rank >= launch_size:
        return [1 if r == rank else 0 for r in range(len(active))]
    return [int(bool(v)) if r < launch_size else 0 for r, v in enumerate(active)]


@dataclass(frozen=True)
class FailedTail:
    """The failed ranks that joined by scale-up at the top of the effective size,
    ``[first, effective_size)``: the survivors let their slots go (a contraction, as in a
    scale-down) and re-admit their replacements into the same slots, the way the ranks first
    came in. Failed ranks below it rejoin in place once it is let go (``failed_in_place``)."""

    first: int
    effective_size: int

    @property
    def ranks(self) -> range:
        return range(self.first, self.effective_size)


def failed_tail(active: Sequence[int], effective_size: int, launch_size: int) -> FailedTail | None:
    """The longest run of failed scale-joined ranks that ends at the top of
    ``[0, effective_size)`` of the ``active`` mask (None: the top slot serves, or was launched
    with the server).

    ``launch_size`` is the EP size the server was launched with: ranks below it are in the
    launch-time groups and always rejoin in place. The effective size may be below it after a
    scale-down past the launch size."""
    if launch_size < 1 or not 1 <= effective_size <= len(active):
        raise ValueError(
            f"need launch_size ({launch_size}) >= 1 and 1 <= effective_size ({effective_size}) "
            f"<= mask length ({len(active)})"
        )
    first = effective_size
    while first > launch_size and not active[first - 1]:
        first -= 1
    return None if first == effective_size else FailedTail(first, effective_size)


def failed_in_place(active: Sequence[int], effective_size: int,
                    launch_size: int) -> tuple[int, ...]:
    """The failed ranks among ``[0, effective_size)`` that rejoin where they are, once no failed
    tail is left to let go (else ``()``: none failed, or a failed tail goes first).

    A replacement relaunched with the rank's own arguments rejoins WORLD (and, for a
    launch-time rank, the launch-time groups it was in: upstream's recovery), then takes on
    the size the survivors serve on. That holds for a scale-joined rank below a live one too:
    Mooncake admits a scale joiner by the same recovery of its WORLD slot. Nothing is let go
    meanwhile: the slots stay in the layout and their experts are served from replicas."""
    if failed_tail(active, effective_size, launch_size) is not None:
        return ()
    return tuple(r for r in range(effective_size) if not active[r])


def not_removable_in_place(ranks: Iterable[int], size: int, launch_size: int,
                           live: Iterable[int]) -> list[int]:
    """The ranks among ``ranks`` that cannot be removed where they are (leave a hole): rank 0,
    ranks outside ``[0, size)``, and scale-joined ranks (at or above ``launch_size``) with no
    rank of ``live`` above them that stays. Those would be part of a failed tail that the
    survivors let go (``failed_tail``), not a slot they await in place."""
    named = set(ranks)
    top = max((r for r in live if r not in named), default=-1)
    return sorted(r for r in named if not 0 < r < size or (r >= launch_size and r > top))

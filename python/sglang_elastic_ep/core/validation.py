"""Checks a scale target against the facts of the running cluster.

Decisions:
- Target equal to the current size is a no-op answered with 200 (absolute targets are
  idempotent: an orchestrator that retries after success must not see an error).
- Ranks join and leave at the tail: scale-up adds [current, target), scale-down removes
  [target, current). A rank-explicit removal (``remove_ranks``) may also name ranks below the
  tail: launch-time ranks anywhere, scale-joined ones below a live rank that stays. Their
  slots become holes, which a relaunch with ``--elastic-ep-join-mode recover`` refills (a
  scale-up adds the holes first). Failed ones serve nothing already, so nothing runs; live
  ones drain first and leave on an agreed pass (no expert moves: the schedulers refuse a set
  whose experts have no replica elsewhere). While a hole is open, no other size change is
  accepted: the tail arithmetic of sizes would not say which slots change.
- A size must be a whole number of attention replicas (upstream Scheduler rule:
  ``new_ep_size % (attn_tp_size * attn_cp_size) == 0``).
- While a rank inside the current size has failed, scale-up is refused (409), and the only
  scale-down allowed is the one that removes exactly the failed ranks (so they must be the
  tail); anything else would mix cleanup and resizing in one operation. One exception: failed
  scale-joined ranks with a live rank above them rejoin in place by a relaunch, and may
  instead be removed by a scale-down past them (with the live ranks above, which drain): that
  scale-down is accepted too.
- A scale-down below the launch size releases launch-time slots and says so: a later
  scale-up refills them with scale joiners at those offsets, as for any other slot.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

from sglang_elastic_ep.core.api_models import RejectionReason
from sglang_elastic_ep.core.membership import not_removable_in_place


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
    # Ranks in the launch-time groups: the launch size, lowered by a shrink below it (which
    # releases launch-time slots for good; joiners refill them).
    launch_size: int | None = None
    # Launch-time ranks per launch_server tree (node): a live one leaves with its whole node.
    ranks_per_node: int = 1

    def __post_init__(self) -> None:
        if self.max_ep_size < 1 or self.attn_replica_size < 1 or self.ranks_per_node < 1:
            raise ValueError("max_ep_size, attn_replica_size and ranks_per_node must be >= 1")
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
    # A removal below the tail: the ranks leave holes, and no expert moves.
    leaves_holes: bool = False
    # A scale-up into removed ranks' holes: their relaunches rejoin in place.
    refills_holes: bool = False


def _refuse(status: HTTPStatus, reason: RejectionReason, message: str) -> ScaleVerdict:
    return ScaleVerdict(ok=False, status=int(status), message=message, reason=reason)


def _ranks(ranks: Iterable[int]) -> str:
    return "[" + ", ".join(str(r) for r in sorted(ranks)) + "]"


def resolve_removal(ranks: Iterable[int], current_size: int, *,
                    failed: Iterable[int] = (), launch_size: int | None = None,
                    removed: Iterable[int] = (),
                    attn_replica_size: int = 1, min_size: int = 1, ranks_per_node: int = 1,
                    hints: bool = True) -> int | ScaleVerdict:
    """``remove_ranks`` as the size it leaves (the tail of ``current_size``), or as an
    accepted removal of ranks below the tail (``leaves_holes``), or why it cannot be done.
    A removed rank leaves a hole that a relaunch with ``--elastic-ep-join-mode recover``
    refills later: every launch-time rank rejoins in place, and so does a scale-joined one
    (at or above ``launch_size``) with a live rank above it. A scale-joined rank with no live
    rank above it that stays is a tail the survivors would let go, not a hole: it leaves
    from the tail only. ``launch_size``: the ranks in the launch-time groups, as the
    schedulers count them (``ScaleTopology.launch_size``, lowered by a shrink below it).
    Failed ranks
    are removed together (nothing runs); live ones only while no rank has failed and no hole
    is open (``removed``), so the drain and the agreed release start from one known set.
    ``min_size`` (``ScaleTopology.min_ep_size``): a refusal offers the tail only down to it.
    ``ranks_per_node``: a live launch-time rank leaves with every rank of its node (its server
    exits; node 0's hosts the HTTP server and stays), so a relaunch of the node refills them.
    ``hints=False``: refusals offer no other set (how an offer itself is checked)."""
    named = sorted(set(ranks))
    unknown = [r for r in named if r >= current_size]
    if unknown:
        return _refuse(
            HTTPStatus.BAD_REQUEST, RejectionReason.UNKNOWN_RANKS,
            f"remove_ranks {_ranks(unknown)} are not in the current EP size {current_size} "
            f"(ranks 0..{current_size - 1}); nothing changed",
        )
    tail = list(range(current_size - len(named), current_size))
    down = frozenset(failed)
    holes_open = sorted(removed)
    refill = (f"refill the holes of removed ranks {_ranks(holes_open)} first (new_ep_size "
              f"{current_size}, then relaunch them with --elastic-ep-join-mode recover: they "
              "rejoin in place)")
    # The tail is offered only where it is accepted: not while a hole is open, and with
    # failed ranks the one scale-down admitted removes exactly them.
    smaller = current_size - len(named)
    past = scale_down_past_failed_joiners(down, current_size, launch_size=launch_size,
                                          attn_replica_size=attn_replica_size,
                                          min_size=min_size)
    past_hint = "" if past is None else (
        f"relaunch them with --elastic-ep-join-mode recover (they rejoin in place), or scale "
        f"down to {past} instead (new_ep_size {past}: it "
        f"{_past_failed_joiners(past, down, current_size)})")
    if holes_open:
        instead = refill
    elif past is not None:
        instead = past_hint
    elif not _size_accepted(smaller, min_size, attn_replica_size):
        instead = (f"no smaller size is accepted (at least {max(min_size, 1)} ranks, in whole "
                   f"attention replicas of {attn_replica_size})")
    elif not down or down == set(tail):
        instead = (f'remove the {len(named)} highest ranks instead ({{"remove_ranks": '
                   f"{_ranks(tail)}}}, the same as new_ep_size {smaller})")
    else:
        instead = "relaunch the failed ones with --elastic-ep-join-mode recover instead"
    if 0 in named:
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.RANK_ZERO,
            "rank 0 hosts the HTTP server and the DP router and cannot be removed; "
            + (instead if len(named) < current_size
               else "to stop serving, shut the server down"),
        )
    if named == tail:
        return current_size - len(named)
    launch = current_size if launch_size is None else launch_size

    def offered(candidate: Iterable[int]) -> bool:
        """Whether a refusal may offer removing ``candidate`` instead: it is accepted."""
        if not hints:
            return False
        verdict = resolve_removal(candidate, current_size, failed=down, launch_size=launch,
                                  removed=holes_open,
                                  attn_replica_size=attn_replica_size, min_size=min_size,
                                  ranks_per_node=ranks_per_node, hints=False)
        if isinstance(verdict, int):  # a tail: accepted as that size
            return (not holes_open and _size_accepted(verdict, min_size, attn_replica_size)
                    and (not down or down == set(range(verdict, current_size))))
        return verdict.ok

    live = [r for r in named if r not in down]
    if live and holes_open:
        return _refuse(
            HTTPStatus.CONFLICT, RejectionReason.REMOVED_RANKS_PRESENT,
            f"live ranks are removed only while no hole is open; {refill}, then retry",
        )
    if live and down and past is not None:
        return _refuse(
            HTTPStatus.CONFLICT, RejectionReason.FAILED_RANKS_PRESENT,
            f"ranks {_ranks(down)} have failed, and live ranks {_ranks(live)} are removed only "
            f"while every rank serves: {past_hint}",
        )
    if live and down:
        failed_hint = (f' or remove them ({{"remove_ranks": {_ranks(down)}}})'
                       if offered(down) else "")
        return _refuse(
            HTTPStatus.CONFLICT, RejectionReason.FAILED_RANKS_PRESENT,
            f"ranks {_ranks(down)} have failed, and live ranks {_ranks(live)} are removed only "
            f"while every rank serves: relaunch the failed ones with --elastic-ep-join-mode "
            f"recover{failed_hint}, then retry",
        )
    no_live_above = not_removable_in_place(
        named, current_size, launch,
        live=(r for r in range(current_size) if r not in down and r not in holes_open))
    if no_live_above:
        rest = sorted(set(range(current_size)) - set(named))
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.NOT_THE_TAIL,
            f"removing {_ranks(named)} would leave the active ranks {_ranks(rest)} with a "
            f"hole, and ranks {_ranks(no_live_above)} joined by scale-up and have no live rank "
            f"above them that stays, so they leave from the tail only; {instead}",
        )
    split = sorted({r // attn_replica_size for r in named
                    if any(p not in named for p in _replica(r, attn_replica_size))})
    if split and split[0] == 0:
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.RANK_ZERO,
            f"ranks {_ranks(_replica(0, attn_replica_size))} form rank 0's attention replica, "
            "which hosts the HTTP server and the DP router, and cannot be removed; name whole "
            "replicas above it",
        )
    if split:
        whole = sorted(set(named) | {p for g in split
                                     for p in _replica(g * attn_replica_size, attn_replica_size)})
        return _refuse(
            HTTPStatus.BAD_REQUEST, RejectionReason.INCOMPLETE_ATTENTION_REPLICA,
            f"removing {_ranks(named)} would split an attention replica of "
            f"{attn_replica_size} ranks; name whole replicas"
            + (f', e.g. {{"remove_ranks": {_ranks(whole)}}}' if offered(whole) else ""),
        )
    # A live launch-time rank leaves with its node; a scale joiner's server may keep ranks
    # (the released scheduler alone exits), and its replacement starts at any offset.
    live_launch = [r for r in live if r < launch]
    nodes = sorted({r // ranks_per_node for r in live_launch})
    if live_launch and nodes[0] == 0:
        return _refuse(
            HTTPStatus.UNPROCESSABLE_ENTITY, RejectionReason.RANK_ZERO,
            f"ranks {_ranks(r for r in live_launch if r < ranks_per_node)} run in node 0's server "
            "with rank 0, which hosts the HTTP server and stays: a live rank leaves with its "
            f"whole node; {instead}",
        )
    partial = sorted({p for n in nodes for p in range(n * ranks_per_node,
                                                         (n + 1) * ranks_per_node)} - set(named))
    if live_launch and partial:
        whole = sorted(set(named) | set(partial))
        return _refuse(
            HTTPStatus.BAD_REQUEST, RejectionReason.INCOMPLETE_NODE,
            f"a live launch-time rank leaves with every rank of its node ({ranks_per_node} per "
            f"node), and ranks {_ranks(partial)} share a node with {_ranks(live_launch)}; name "
            "whole nodes"
            + (f', e.g. {{"remove_ranks": {_ranks(whole)}}}' if offered(whole) else ""),
        )
    joiners = [r for r in named if r >= launch]
    relaunch = ("relaunch them with --elastic-ep-join-mode recover to refill their slots"
                + (f" (ranks {_ranks(joiners)} as joiners at their own "
                   "--elastic-ep-join-rank-offset)" if joiners else ""))
    if live:
        return ScaleVerdict(
            ok=True, status=int(HTTPStatus.OK), direction=ScaleDirection.DOWN,
            leaving_ranks=tuple(named), leaves_holes=True,
            message=(f"Removing ranks {_ranks(named)} where they are: their shards drain, then "
                     f"they leave and the cluster serves on {current_size - len(named)} ranks; "
                     f"{relaunch}"),
        )
    return ScaleVerdict(
        ok=True, status=int(HTTPStatus.OK), direction=ScaleDirection.DOWN,
        leaving_ranks=tuple(named), leaves_holes=True,
        message=(f"Removed failed ranks {_ranks(named)}: serving on "
                 f"{current_size - len(named)} ranks; {relaunch}"),
    )


def failed_joiners_below_live(failed: Iterable[int], current_size: int, *,
                              launch_size: int | None) -> frozenset[int]:
    """The failed ranks that joined by scale-up and have a live rank above them (empty: none).

    They are no failed tail for the survivors to let go (``core.membership.failed_tail``):
    they rejoin in place by a relaunch, or leave with the live ranks above by a scale-down
    past them. Ranks at or above ``launch_size`` only: the ranks below it are in the
    launch-time groups (a shrink below the launch size lowers it, on the schedulers and in
    ``ScaleTopology.launch_size``)."""
    down = frozenset(failed)
    launch = current_size if launch_size is None else launch_size
    live = [r for r in range(current_size) if r not in down]
    return frozenset(r for r in down if r >= launch and live and r < max(live))


def scale_down_past_failed_joiners(failed: Iterable[int], current_size: int, *,
                                   launch_size: int | None, attn_replica_size: int = 1,
                                   min_size: int = 1) -> int | None:
    """The largest size whose scale-down removes every failed rank, when all of them joined by
    scale-up and some have a live rank above them (``failed_joiners_below_live``); else None.
    The scale-down removes them with the live ranks above, which drain as in any scale-down (a
    dead leaving rank leaves anyway). None also when that size is below the smallest one
    accepted."""
    down = frozenset(failed)
    launch = current_size if launch_size is None else launch_size
    if not failed_joiners_below_live(down, current_size, launch_size=launch_size) \
            or min(down) < launch:
        return None
    size = min(down) // attn_replica_size * attn_replica_size
    return size if _size_accepted(size, min_size, attn_replica_size) else None


def _past_failed_joiners(target: int, failed: frozenset[int], current_size: int) -> str:
    """How ``target``'s scale-down past failed joiners reads to the operator."""
    live = sorted(set(range(target, current_size)) - failed)
    return (f"removes failed ranks {_ranks(failed)}, which joined by scale-up, together with "
            f"live ranks {_ranks(live)}, which drain")


def _size_accepted(size: int, min_size: int, attn_replica_size: int) -> bool:
    return size >= max(min_size, 1) and size % attn_replica_size == 0


def _replica(rank: int, attn_replica_size: int) -> range:
    first = rank // attn_replica_size * attn_replica_size
    return range(first, first + attn_replica_size)


def judge_with_holes(target: int, serving_size: int,
                     removed: Iterable[int]) -> ScaleVerdict | None:
    """The verdict on a size while removed ranks leave holes (None: no holes, or ``target``
    is the size served now). A scale-up adds the next free slots, and holes come first: it
    refills the lowest holes (``refills_holes``), and the operation commits once their ranks'
    relaunches rejoin in place. Any other size waits for the holes to close: which slots a
    size removes, or adds past them, is defined for ranks 0..n-1 only."""
    holes = sorted(removed)
    if not holes or target == serving_size:
        return None
    if serving_size < target <= serving_size + len(holes):
        refill = tuple(holes[: target - serving_size])
        return ScaleVerdict(
            ok=True, status=int(HTTPStatus.OK), direction=ScaleDirection.UP,
            joining_ranks=refill, refills_holes=True,
            message=(f"Scaling initiated from {serving_size} to {target}: refilling the holes "
                     f"of removed ranks {_ranks(refill)}; relaunch them with "
                     "--elastic-ep-join-mode recover (they rejoin in place), and the "
                     "operation commits when they serve"),
        )
    full = serving_size + len(holes)
    return _refuse(
        HTTPStatus.CONFLICT, RejectionReason.REMOVED_RANKS_PRESENT,
        f"removed ranks {_ranks(holes)} leave holes in the active ranks, and a size change "
        f"is defined for ranks 0..n-1 only; refill the holes first (new_ep_size {full}, then "
        f"relaunch ranks {_ranks(holes)} with --elastic-ep-join-mode recover: they rejoin in "
        "place), then retry",
    )


def validate_scale(
    target: int,
    *,
    current_size: int,
    topology: ScaleTopology,
    failed_ranks: Iterable[int] = (),
) -> ScaleVerdict:
    """Decide whether scaling from ``current_size`` to ``target`` may start now. A refusal
    names only sizes (and removals) that would be accepted in the same state."""
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
    past = scale_down_past_failed_joiners(failed, current_size,
                                          launch_size=topology.launch_size,
                                          attn_replica_size=replica,
                                          min_size=topology.min_ep_size)
    if past is not None and target > current_size:
        return _refuse(
            HTTPStatus.CONFLICT,
            RejectionReason.FAILED_RANKS_PRESENT,
            f"rank(s) {_ranks(failed)} failed; recover them first (relaunch them with "
            f"--elastic-ep-join-mode recover: they rejoin in place), or scale down to {past} "
            f"first (it {_past_failed_joiners(past, failed, current_size)})"
            f"{_hole_removal_hint(failed, current_size, topology)}, then scale up",
        )
    if failed and target > current_size:
        remove_hint = (
            f", or remove them by scaling down to {removal_target}"
            if removal_target is not None
            else _hole_removal_hint(failed, current_size, topology)
        )
        return _refuse(
            HTTPStatus.CONFLICT,
            RejectionReason.FAILED_RANKS_PRESENT,
            f"rank(s) {_ranks(failed)} failed; recover or remove rank(s) {_ranks(failed)} "
            f"first (relaunch them with --elastic-ep-join-mode recover{remove_hint}), "
            "then scale up",
        )
    if past is not None and target > past:
        return _refuse(
            HTTPStatus.CONFLICT,
            RejectionReason.MUST_REMOVE_FAILED_RANKS,
            f"rank(s) {_ranks(failed)} failed; a scale-down must remove them too, and ranks "
            f"leave from the tail: scale down to {past} instead (it "
            f"{_past_failed_joiners(past, failed, current_size)}), or relaunch them with "
            "--elastic-ep-join-mode recover (they rejoin in place)"
            f"{_hole_removal_hint(failed, current_size, topology)}",
        )
    if failed and past is None and removable != failed:
        holes = _hole_removal_hint(failed, current_size, topology)
        fix = (
            f"scale down to exactly {removal_target}"
            if removal_target is not None
            else "they cannot be removed that way, so relaunch them with "
            f"--elastic-ep-join-mode recover instead{holes}"
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
    draining = (f"draining ranks {_ranks(leaving)}" if past is None
                else f"it {_past_failed_joiners(target, failed, current_size)}")
    return ScaleVerdict(
        ok=True,
        status=int(HTTPStatus.OK),
        message=f"Scaling initiated from {current_size} to {target}, {draining}{one_way}",
        direction=ScaleDirection.DOWN,
        leaving_ranks=leaving,
    )


def _hole_removal_hint(failed: frozenset[int], current_size: int,
                       topology: ScaleTopology) -> str:
    """How to remove ``failed`` where they are (holes), when that is accepted; else ""."""
    if not failed:
        return ""
    accepted = resolve_removal(failed, current_size, failed=failed,
                               launch_size=topology.launch_size,
                               attn_replica_size=topology.attn_replica_size)
    if isinstance(accepted, ScaleVerdict) and accepted.leaves_holes:
        return f', or remove them where they are: {{"remove_ranks": {_ranks(failed)}}}'
    return ""


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

"""Rank agreement on a membership step, with no collective of its own.

Each rank learns about a membership change (a scale request, a joiner that connected, a
failed peer) on its own scheduler pass. If one rank entered a collective step (admission,
weight moves, release) while another ran a normal forward, both would hang. With DP attention
every scheduler pass already all-gathers one row per rank (upstream's ``MLPSyncBatchInfo``),
so each rank appends its :class:`Proposal` to that row (:func:`pack_row`) and every rank
computes the same :func:`gathered_round` from the same rows, on the same pass: the same
verdict everywhere, with no store and no added collective or host sync.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class LockstepVerdict(str, enum.Enum):
    """What every rank does this pass, decided from the same gathered values on every rank."""

    NOTHING_PENDING = "nothing_pending"  # no rank sees a scale: run the normal per-pass step
    ENTER = "enter"  # every rank is ready for the same target: enter the membership step
    WAIT = "wait"  # some rank is not ready (saw the request later, or sees no joiner yet)
    ABORT = "abort"  # some rank calls the pending step off (cancelled, timed out): all drop it


def lockstep_verdict(max_ready: int, min_ready: int, max_target: int) -> LockstepVerdict:
    """Agreement for ranks that already run in lockstep (DP attention: every pass has a
    collective). Each rank contributes ``ready`` = the scale target it is ready to enter (it sees
    the request, the joining cohort and the joiners' peer state; else 0) and the target it sees.
    Every rank reduces the same contributions (the rows of the DP gather, or one all-reduce with
    MAX of ``(ready, -ready, target)``) to the same three numbers, hence the same verdict: no rank
    enters a membership collective that another rank skips on this pass, and every local check
    upstream makes afterwards already holds."""
    if min(max_ready, min_ready, max_target) < 0 or min_ready > max_ready:
        raise ValueError(f"bad reduced values: ready max={max_ready} min={min_ready}")
    if max_target == 0:
        return LockstepVerdict.NOTHING_PENDING
    if min_ready == max_ready == max_target:
        return LockstepVerdict.ENTER
    return LockstepVerdict.WAIT


# --------------------------------------------------------- the verdict's inputs as gather rows


class StepKind(enum.IntEnum):
    """The membership step a rank proposes; an integer column of its gather row."""

    NONE = 0  # no change seen
    GROW = 1  # a scale-up: upstream admits the joiners
    SHRINK = 2  # a scale-down: the tail leaves once drained
    LET_GO = 3  # the survivors let go of a failed tail of scale-joined ranks
    RECOVER = 4  # failed launch-time ranks rejoin in place (their replacements are in WORLD)
    REMOVE = 5  # live launch-time ranks below the tail leave once drained; their slots: holes


class AbortReason(enum.IntEnum):
    """Why a rank calls its pending step off; an integer column of its gather row."""

    NONE = 0
    CANCELLED = 1  # the operation was cancelled (``DELETE /scale_elastic_ep/{id}``)
    TIMED_OUT = 2  # the step did not become ready within the scale timeout
    RANK_FAILED = 3  # a rank the step keeps failed before it entered (scale-down)


@dataclass(frozen=True)
class Proposal:
    """One rank's input to the verdict of one pass.

    Schedulers carry no operation id, so ``(kind, serving, target)`` names the operation: the
    step, the membership it starts from and the size it goes to (for ``REMOVE``, which keeps
    the size, the set of ranks that leave: :func:`ranks_bitmask`). Ranks enter only when they
    agree on all three.
    """

    rank: int  # EP rank
    kind: StepKind
    ready: int  # ``target`` when this rank can enter the step now, else 0
    target: int  # the size this rank sees requested (0: none)
    serving: int  # the EP size this rank serves on now
    abort: AbortReason = AbortReason.NONE  # this rank calls its pending step off

    def __post_init__(self) -> None:
        problem = _proposal_problem(self)
        if problem is not None:
            raise ValueError(problem)


PROPOSAL_COLUMNS = 6  # member (rank + 1; 0 = no row), kind, ready, target, serving, abort
# The steps an operation starts, which a rank can call off before they are entered.
_CALLED_OFF_STEPS = (StepKind.GROW, StepKind.SHRINK, StepKind.REMOVE)


def ranks_bitmask(ranks: Sequence[int]) -> int:
    """``ranks`` as one integer column (bit ``r`` set for rank ``r``): a ``REMOVE`` proposal's
    target, so the ranks agree on which ranks leave, not only on how many."""
    if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
        raise ValueError(f"a removal names distinct ranks >= 0, got {list(ranks)}")
    return sum(1 << int(r) for r in ranks)


def bitmask_ranks(mask: int) -> tuple[int, ...]:
    """The ranks whose bits ``mask`` sets (the inverse of :func:`ranks_bitmask`)."""
    if mask < 0:
        raise ValueError(f"a rank bitmask is >= 0, got {mask}")
    return tuple(r for r in range(mask.bit_length()) if mask >> r & 1)


def _proposal_problem(p: Proposal) -> str | None:
    if p.rank < 0 or p.serving < 1 or p.target < 0:
        return f"rank {p.rank}: bad sizes (serving {p.serving}, target {p.target})"
    if p.ready not in (0, p.target):
        return f"rank {p.rank}: ready {p.ready} is neither 0 nor its target {p.target}"
    if (p.kind is StepKind.NONE) != (p.target == 0):
        return f"rank {p.rank}: step {p.kind.name} with target {p.target}"
    if p.abort is not AbortReason.NONE and p.kind not in _CALLED_OFF_STEPS:
        return f"rank {p.rank}: abort of step {p.kind.name} (only a scale is called off)"
    return None


def pack_row(proposal: Proposal, timings: Sequence[int] = ()) -> list[int]:
    """This rank's columns of the gather: the proposal, then its own expert timings."""
    return [proposal.rank + 1, int(proposal.kind), proposal.ready, proposal.target,
            proposal.serving, int(proposal.abort), *timings]


def blank_row(timing_width: int) -> list[int]:
    """The columns of a row no rank wrote (upstream's fallback row for an inactive slot)."""
    return [0] * (PROPOSAL_COLUMNS + timing_width)


def unpack_rows(rows: Sequence[Sequence[int]]) -> tuple[list[Proposal], str | None]:
    """The proposals in gathered ``rows`` (rows with member 0 carry none: a slot no rank wrote,
    or one upstream blanked as inactive), and what is wrong with the first malformed row."""
    proposals: list[Proposal] = []
    seen: set[int] = set()
    for row in rows:
        member = int(row[0])
        if member == 0:
            continue
        head = [int(v) for v in row[:PROPOSAL_COLUMNS]]
        if member < 0 or len(head) < PROPOSAL_COLUMNS:
            return proposals, f"malformed gather row {head}"
        try:
            proposal = Proposal(rank=member - 1, kind=StepKind(head[1]), ready=head[2],
                                target=head[3], serving=head[4], abort=AbortReason(head[5]))
        except ValueError as exc:
            return proposals, f"malformed gather row {head}: {exc}"
        if proposal.rank in seen:
            return proposals, f"two gather rows for rank {proposal.rank}"
        seen.add(proposal.rank)
        proposals.append(proposal)
    return proposals, None


@dataclass(frozen=True)
class GatheredRound:
    """The verdict of one pass, reached from the gathered rows alone (equal on every rank)."""

    verdict: LockstepVerdict
    proposals: tuple[Proposal, ...] = ()
    problem: str | None = None  # why the rows forbid entering although they may look ready
    abort: AbortReason = AbortReason.NONE  # on ABORT: why (a cancel wins over a timeout)


def verdict_from_proposals(proposals: Sequence[Proposal],
                           problem: str | None = None) -> GatheredRound:
    """:func:`lockstep_verdict` over every rank's proposal, entering only when the ranks also
    agree on the membership they serve and on the step. ``problem`` (a malformed row) forces
    WAIT: an unreadable row may be a rank that is not ready."""
    found = tuple(proposals)
    if problem is not None:
        return GatheredRound(LockstepVerdict.WAIT, found, problem)
    if not found:
        return GatheredRound(LockstepVerdict.WAIT, found, "no rank's row in the gather")
    aborting = sorted({(p.abort, p.target) for p in found if p.abort is not AbortReason.NONE})
    if aborting:
        # Before anything else: a rank that calls the step off never enters it, so no rank may.
        reason, target = aborting[0]
        return GatheredRound(LockstepVerdict.ABORT, found,
                             f"the scale to {target} is called off ({reason.name.lower()})",
                             abort=reason)
    serving = sorted({p.serving for p in found})
    if len(serving) > 1:
        return GatheredRound(LockstepVerdict.WAIT, found,
                             f"ranks serve on different EP sizes {serving}")
    readies = [p.ready for p in found]
    verdict = lockstep_verdict(max(readies), min(readies), max(p.target for p in found))
    kinds = sorted({p.kind.name for p in found})
    if verdict is LockstepVerdict.ENTER and len(kinds) > 1:
        return GatheredRound(LockstepVerdict.WAIT, found,
                             f"ranks ready for size {found[0].target} propose steps {kinds}")
    return GatheredRound(verdict, found)


def gathered_round(rows: Sequence[Sequence[int]],
                   unseen: Sequence[int] = ()) -> GatheredRound:
    """The verdict from gathered rows (each starting with :data:`PROPOSAL_COLUMNS` columns).

    ``unseen``: ranks whose rows this rank did not receive because they failed during the
    gather (their rows here are blank). Another survivor may have received them whole, and a
    dying leaving rank's row says "not ready" while it still held requests, so entering on the
    rows without them could put this rank into a step that survivor skips: ENTER becomes WAIT
    on such a pass. The next gather no longer counts the failed ranks, and every survivor
    decides on the same rows again."""
    outcome = verdict_from_proposals(*unpack_rows(rows))
    if unseen and outcome.verdict is LockstepVerdict.ENTER:
        return GatheredRound(LockstepVerdict.WAIT, outcome.proposals,
                             f"ranks {sorted(unseen)} failed during this pass's gather: their "
                             "rows are unknown here, so no step is entered on it")
    return outcome


def gathered_timings(rows: Sequence[Sequence[int]], *, slots_per_rank: int,
                     capacity: int) -> list[int]:
    """Every rank's expert timings as one vector, ``[ns per row..., rows...]`` over
    ``capacity * slots_per_rank`` physical slots (zeros where no row has them): each row carries
    its own ``slots_per_rank`` ns values then as many row counts after the proposal."""
    total = capacity * slots_per_rank
    ns = [0] * total
    counts = [0] * total
    if not slots_per_rank:
        return ns + counts
    for row in rows:
        rank = int(row[0]) - 1
        if rank < 0 or rank >= capacity:
            continue
        start = rank * slots_per_rank
        own = [int(v) for v in row[PROPOSAL_COLUMNS:PROPOSAL_COLUMNS + 2 * slots_per_rank]]
        if len(own) != 2 * slots_per_rank:
            continue
        ns[start:start + slots_per_rank] = own[:slots_per_rank]
        counts[start:start + slots_per_rank] = own[slots_per_rank:]
    return ns + counts

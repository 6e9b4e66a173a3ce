"""Lockstep agreement: all ranks reach one verdict from the same reduced or gathered values."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.agreement import (
    PROPOSAL_COLUMNS,
    AbortReason,
    LockstepVerdict,
    Proposal,
    StepKind,
    blank_row,
    gathered_round,
    gathered_timings,
    lockstep_verdict,
    pack_row,
    unpack_rows,
    verdict_from_proposals,
)


def simulate(seen_at: list[int], target: int, passes: int) -> list[list[LockstepVerdict]]:
    """Rank r sees the scale request from pass ``seen_at[r]`` on; returns verdicts per pass."""
    history = []
    for p in range(passes):
        local = [target if p >= s else 0 for s in seen_at]
        # what the all-reduce gives everyone
        verdict = lockstep_verdict(max(local), min(local), max(local))
        history.append([verdict] * len(seen_at))
    return history


@pytest.mark.parametrize("skew", [0, 1, 3, 5])
def test_late_rank_delays_entry_but_all_enter_on_one_pass(skew: int) -> None:
    history = simulate([2, 2 + skew, 2], target=3, passes=12)
    entered = [p for p, row in enumerate(history) if row[0] is LockstepVerdict.ENTER]
    assert entered[0] == 2 + skew  # no added wait when ranks agree (skew 0 enters at once)
    assert all(len(set(row)) == 1 for row in history)
    assert all(row[0] is LockstepVerdict.WAIT for row in history[2 : 2 + skew])


def test_nothing_pending_and_bad_values() -> None:
    assert lockstep_verdict(0, 0, 0) is LockstepVerdict.NOTHING_PENDING
    with pytest.raises(ValueError):
        lockstep_verdict(2, 3, 3)
    with pytest.raises(ValueError):
        lockstep_verdict(-1, 0, 0)


def test_pending_but_joiner_not_ready_everywhere_waits() -> None:
    # every rank sees target 3, one rank does not see the joiner's peer state yet
    assert lockstep_verdict(3, 0, 3) is LockstepVerdict.WAIT
    # nobody ready yet
    assert lockstep_verdict(0, 0, 3) is LockstepVerdict.WAIT
    assert lockstep_verdict(3, 3, 3) is LockstepVerdict.ENTER


# ------------------------------------------------------- the verdict's inputs as gather rows

def grow(rank: int, ready: bool, target: int = 3, serving: int = 2) -> Proposal:
    return Proposal(rank=rank, kind=StepKind.GROW, ready=target if ready else 0, target=target,
                    serving=serving)


def idle(rank: int, serving: int = 2) -> Proposal:
    return Proposal(rank=rank, kind=StepKind.NONE, ready=0, target=0, serving=serving)


def test_a_row_packs_and_unpacks_and_blank_rows_carry_no_proposal() -> None:
    p = grow(1, ready=True)
    row = pack_row(p, [11, 12, 5, 6])
    assert row[:PROPOSAL_COLUMNS] == [2, int(StepKind.GROW), 3, 3, 2, 0]
    assert row[PROPOSAL_COLUMNS:] == [11, 12, 5, 6]
    assert len(blank_row(4)) == len(row) and not any(blank_row(4))
    found, problem = unpack_rows([blank_row(4), row, blank_row(4)])
    assert found == [p] and problem is None


def test_rows_reach_the_verdicts_of_the_reduced_values() -> None:
    def verdict(*proposals: Proposal) -> LockstepVerdict:
        return gathered_round([pack_row(p) for p in proposals]).verdict

    assert verdict(idle(0), idle(1)) is LockstepVerdict.NOTHING_PENDING
    assert verdict(grow(0, True), grow(1, True)) is LockstepVerdict.ENTER
    assert verdict(grow(0, True), grow(1, False)) is LockstepVerdict.WAIT
    assert verdict(grow(0, True), idle(1)) is LockstepVerdict.WAIT  # rank 1 saw no request yet
    assert verdict(grow(0, True)) is LockstepVerdict.ENTER  # a single rank agrees with itself


@pytest.mark.parametrize("skew", [0, 1, 3])
def test_gathered_rows_enter_together_on_one_pass(skew: int) -> None:
    seen_at = [2, 2 + skew, 2]
    history = []
    for p in range(10):
        rows = [pack_row(grow(r, ready=p >= s) if p >= s else idle(r))
                for r, s in enumerate(seen_at)]
        history.append(gathered_round(rows).verdict)
    assert history.index(LockstepVerdict.ENTER) == 2 + skew
    assert history[:2] == [LockstepVerdict.NOTHING_PENDING] * 2


def test_ranks_enter_only_when_they_agree_on_the_membership_and_the_step() -> None:
    split = verdict_from_proposals([grow(0, True), grow(1, True, serving=3)])
    assert split.verdict is LockstepVerdict.WAIT and "different EP sizes [2, 3]" in split.problem
    mixed = [Proposal(rank=0, kind=StepKind.SHRINK, ready=2, target=2, serving=3),
             Proposal(rank=1, kind=StepKind.LET_GO, ready=2, target=2, serving=3)]
    outcome = verdict_from_proposals(mixed)
    assert outcome.verdict is LockstepVerdict.WAIT and "LET_GO" in outcome.problem
    assert verdict_from_proposals([]).verdict is LockstepVerdict.WAIT


def test_malformed_rows_make_every_rank_wait_instead_of_raising() -> None:
    good = pack_row(grow(0, True))
    for bad in ([2, 9, 3, 3, 2],  # no such step
                [2, int(StepKind.GROW), 1, 3, 2],  # ready is neither 0 nor the target
                [2, int(StepKind.NONE), 0, 3, 2],  # a target without a step
                [-5, 0, 0, 0, 0]):
        outcome = gathered_round([good, bad])
        assert outcome.verdict is LockstepVerdict.WAIT and outcome.problem
    twice = gathered_round([good, good])
    assert twice.verdict is LockstepVerdict.WAIT and "two gather rows" in twice.problem
    with pytest.raises(ValueError):
        Proposal(rank=0, kind=StepKind.GROW, ready=1, target=3, serving=2)


def shrink(rank: int, ready: bool, target: int = 2, serving: int = 3) -> Proposal:
    return Proposal(rank=rank, kind=StepKind.SHRINK, ready=target if ready else 0,
                    target=target, serving=serving)


def test_a_survivor_that_missed_a_dying_leaving_ranks_row_waits_as_the_one_that_got_it() -> None:
    """Rank 2 leaves by a scale-down and dies mid-drain, during a gather: survivor 1 received
    its row whole (still draining: not ready), survivor 0 did not (blank)."""
    staying = [pack_row(shrink(0, True)), pack_row(shrink(1, True))]
    got_it = gathered_round([*staying, pack_row(shrink(2, False))])
    missed_it = gathered_round([*staying, blank_row(0)], unseen=[2])
    assert got_it.verdict is LockstepVerdict.WAIT
    assert missed_it.verdict is LockstepVerdict.WAIT
    assert "ranks [2] failed during this pass's gather" in missed_it.problem
    # Without the failure report the blank row is an inactive slot: the staying ranks enter.
    assert gathered_round([*staying, blank_row(0)]).verdict is LockstepVerdict.ENTER


def test_a_failed_peer_in_the_gather_holds_back_only_entering() -> None:
    assert gathered_round([pack_row(idle(0)), blank_row(0)],
                          unseen=[1]).verdict is LockstepVerdict.NOTHING_PENDING
    called_off = Proposal(rank=0, kind=StepKind.GROW, ready=0, target=3, serving=2,
                          abort=AbortReason.CANCELLED)
    assert gathered_round([pack_row(called_off), blank_row(0)],
                          unseen=[1]).verdict is LockstepVerdict.ABORT


def test_each_rows_timings_land_in_its_own_slots() -> None:
    rows = [pack_row(idle(1), [10, 20, 1, 2]), blank_row(4), pack_row(idle(0), [30, 40, 3, 4])]
    assert gathered_timings(rows, slots_per_rank=2, capacity=3) == [
        30, 40, 10, 20, 0, 0,  # ns per row, slots of ranks 0, 1, 2
        3, 4, 1, 2, 0, 0,  # rows
    ]
    assert gathered_timings(rows, slots_per_rank=0, capacity=3) == []


def test_a_removal_is_named_by_its_ranks_and_entered_only_on_the_same_set() -> None:
    from sglang_elastic_ep.core.agreement import bitmask_ranks, ranks_bitmask

    assert ranks_bitmask([1, 3]) == 0b1010 and bitmask_ranks(0b1010) == (1, 3)
    for bad in ([], [1, 1], [-1]):
        with pytest.raises(ValueError):
            ranks_bitmask(bad)
    one = ranks_bitmask([1])

    def row(rank: int, target: int, ready: bool) -> Proposal:
        return Proposal(rank=rank, kind=StepKind.REMOVE, ready=target if ready else 0,
                        target=target, serving=3)

    agreed = verdict_from_proposals([row(0, one, True), row(1, one, True), row(2, one, True)])
    assert agreed.verdict is LockstepVerdict.ENTER
    # Rank 1 still drains: every rank serves on.
    assert verdict_from_proposals([row(0, one, True), row(1, one, False),
                                   row(2, one, True)]).verdict is LockstepVerdict.WAIT
    # Another set of ranks is another operation, even when the sizes match.
    other = ranks_bitmask([2])
    assert verdict_from_proposals([row(0, one, True), row(1, one, True),
                                   row(2, other, True)]).verdict is LockstepVerdict.WAIT
    # A removal may be called off (its drain timed out): every rank drops it.
    called_off = Proposal(rank=2, kind=StepKind.REMOVE, ready=0, target=one, serving=3,
                          abort=AbortReason.TIMED_OUT)
    assert verdict_from_proposals([row(0, one, True), called_off]).verdict \
        is LockstepVerdict.ABORT

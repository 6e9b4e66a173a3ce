"""Lockstep agreement: all ranks reach one verdict from the same reduced values."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.agreement import LockstepVerdict, lockstep_verdict


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

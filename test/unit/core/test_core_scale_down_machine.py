"""The scale-down machine of each role, driven as the adapter drives it: one call per pass."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.agreement import AbortReason
from sglang_elastic_ep.core.phases import IllegalTransition, Phase, Role
from sglang_elastic_ep.core.scale_down_machine import ScaleDownMachine

RELEASE = (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING)
NO_FAILURE: frozenset[int] = frozenset()


def machine(rank: int, timeout_s: float = 60.0) -> ScaleDownMachine:
    return ScaleDownMachine(rank=rank, old_size=4, new_size=2, started_at=100.0,
                            timeout_s=timeout_s)


def release(m: ScaleDownMachine, now: float) -> Phase:
    for step in RELEASE:
        m.advance(step, now)
    return m.committed(now)


def test_a_staying_rank_is_ready_at_once_and_ends_serving_contracted() -> None:
    m = machine(rank=1)
    assert m.role is Role.SCALE_DOWN_STAYING and m.leaving_ranks == (2, 3)
    assert m.phase is Phase.DRAINING
    assert m.readiness(holds_no_request=False) == 2  # it keeps its requests
    assert m.abort_reason(101.0, failed_ranks=NO_FAILURE) is AbortReason.NONE
    assert release(m, 102.0) is Phase.SERVING_CONTRACTED
    assert [s.phase for s in m.phase_stamps] == [Phase.DRAINING, *RELEASE,
                                                 Phase.SERVING_CONTRACTED]
    assert m.done and m.readiness(holds_no_request=True) == 0  # nothing left to enter
    assert m.answers_late_confirmation(2) and not m.answers_late_confirmation(3)


def test_a_leaving_rank_waits_for_the_confirmed_drain_and_an_empty_scheduler() -> None:
    m = machine(rank=3)
    assert m.role is Role.SCALE_DOWN_LEAVING
    assert m.readiness(holds_no_request=True) == 0  # a request may still be on its way
    m.confirm_drain()
    assert m.readiness(holds_no_request=False) == 0  # still finishing one
    assert m.readiness(holds_no_request=True) == 2
    assert release(m, 103.0) is Phase.RELEASED
    assert not m.answers_late_confirmation(2)  # a released rank answers nothing more
    with pytest.raises(ValueError, match="no drain to confirm"):
        m.confirm_drain()


@pytest.mark.parametrize("rank", [0, 3])
def test_a_drain_past_the_timeout_is_called_off_on_every_role(rank: int) -> None:
    m = machine(rank, timeout_s=30.0)
    assert m.abort_reason(130.0, failed_ranks=NO_FAILURE) is AbortReason.NONE
    assert m.abort_reason(130.5, failed_ranks=NO_FAILURE) is AbortReason.TIMED_OUT
    message = m.call_off(AbortReason.TIMED_OUT, "", 130.5)
    assert "within 30 s" in message and m.error == message
    assert m.phase is Phase.FAILED and m.done
    assert m.readiness(holds_no_request=True) == 0
    assert m.abort_reason(200.0, failed_ranks=NO_FAILURE) is AbortReason.NONE  # already off
    with pytest.raises(IllegalTransition):
        m.advance(Phase.MOVING_EXPERTS, 131.0)  # no release after a call-off


def test_no_timeout_means_the_drain_may_take_as_long_as_it_needs() -> None:
    assert machine(3, timeout_s=0).abort_reason(1e9, failed_ranks=NO_FAILURE) is AbortReason.NONE


@pytest.mark.parametrize("rank", [0, 2])
def test_a_staying_rank_failing_during_the_drain_calls_it_off(rank: int) -> None:
    m = machine(rank)
    # A leaving rank's failure changes nothing: it was leaving anyway.
    assert m.abort_reason(101.0, failed_ranks=frozenset({3})) is AbortReason.NONE
    assert m.abort_reason(101.0, failed_ranks=frozenset({1})) is AbortReason.RANK_FAILED
    message = m.call_off(AbortReason.RANK_FAILED, "rank 1 failed", 101.0)
    assert "a staying rank failed" in message and "rank 1 failed" in message
    assert m.phase is Phase.FAILED


def test_a_fault_inside_the_release_is_not_a_call_off() -> None:
    m = machine(1)
    m.advance(Phase.MOVING_EXPERTS, 101.0)
    # Every rank entered on the same pass: none may drop out of it alone.
    assert m.abort_reason(500.0, failed_ranks=frozenset({0})) is AbortReason.NONE
    with pytest.raises(IllegalTransition):
        m.call_off(AbortReason.RANK_FAILED, "", 101.0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="new size < old size"):
        ScaleDownMachine(rank=0, old_size=2, new_size=2, started_at=0.0)
    with pytest.raises(ValueError, match="outside the current size"):
        ScaleDownMachine(rank=4, old_size=4, new_size=2, started_at=0.0)
    with pytest.raises(ValueError, match="timeout_s"):
        ScaleDownMachine(rank=0, old_size=4, new_size=2, started_at=0.0, timeout_s=-1)
    m = machine(0)
    with pytest.raises(ValueError, match="not a step of the release"):
        m.advance(Phase.DRAINING, 1.0)
    with pytest.raises(ValueError, match="CANCELLED"):
        m.call_off(AbortReason.CANCELLED, "", 1.0)  # a draining scale-down is not cancelled
    with pytest.raises(ValueError, match="NONE"):
        m.call_off(AbortReason.NONE, "", 1.0)
    assert m.phase is Phase.DRAINING


def removal(rank: int, removed: tuple[int, ...] = (1,), size: int = 3) -> ScaleDownMachine:
    return ScaleDownMachine(rank=rank, old_size=size, new_size=size, removed=removed,
                            started_at=100.0, timeout_s=60.0)


def test_a_removal_below_the_tail_names_its_ranks_and_keeps_the_size() -> None:
    leaving, staying, above = removal(1), removal(0), removal(2)
    assert leaving.leaving and not staying.leaving and not above.leaving
    assert leaving.leaving_ranks == (1,) and leaving.agreed_target == 0b10
    assert removal(0, (1, 3), 4).agreed_target == 0b1010
    assert leaving.role is Role.SCALE_DOWN_LEAVING and above.role is Role.SCALE_DOWN_STAYING
    # Staying ranks (below and above it) are ready at once; the removed one after its drain.
    assert staying.readiness(holds_no_request=False) == 0b10
    assert above.readiness(holds_no_request=False) == 0b10
    assert leaving.readiness(holds_no_request=True) == 0
    leaving.confirm_drain()
    assert leaving.readiness(holds_no_request=True) == 0b10
    assert leaving.is_for(3, (1,)) and not leaving.is_for(2) and not leaving.is_for(3, (2,))


def test_a_removal_is_called_off_when_a_staying_rank_fails_not_the_removed_one() -> None:
    m = removal(0)
    assert m.abort_reason(101.0, failed_ranks=frozenset({1})) is AbortReason.NONE
    assert m.abort_reason(101.0, failed_ranks=frozenset({2})) is AbortReason.RANK_FAILED
    assert m.abort_reason(161.0, failed_ranks=frozenset()) is AbortReason.TIMED_OUT
    message = m.call_off(AbortReason.TIMED_OUT, "", 161.0)
    assert message.startswith("removal of ranks [1] called off: the drain did not end")


def test_a_late_drain_confirmation_of_a_removal_is_answered_once() -> None:
    m = removal(0)
    for step in (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING):
        m.advance(step, 101.0)
    assert m.committed(101.0) is Phase.SERVING_CONTRACTED
    assert not m.answers_late_confirmation(3, (2,))
    assert m.answers_late_confirmation(3, (1,))
    assert not m.answers_late_confirmation(3, (1,))  # the same removal later is a new one


@pytest.mark.parametrize(("removed", "new", "match"), [
    ((1,), 2, "keeps the size"),
    ((0,), 3, "in 1..2"),
    ((3,), 3, "in 1..2"),
    ((2, 1), 3, "sorted"),
])
def test_bad_removals_are_refused(removed: tuple[int, ...], new: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaleDownMachine(rank=0, old_size=3, new_size=new, removed=removed, started_at=0.0)


def test_the_drain_confirmation_of_a_called_off_scale_down_gets_the_reason_once() -> None:
    """A staying rank died mid-drain and the drain ended before the HTTP process read the
    call-off: its confirmation (the same operation id) is answered with why; another
    operation's request for the same size is a new one."""
    m = ScaleDownMachine(rank=0, old_size=3, new_size=2, started_at=100.0,
                         operation_id="shrink")
    assert m.answers_called_off_confirmation("shrink") is None  # still draining
    message = m.call_off(AbortReason.RANK_FAILED, "", 101.0)
    assert m.answers_called_off_confirmation("retry") is None
    assert m.answers_called_off_confirmation(None) is None
    assert m.answers_called_off_confirmation("shrink") == message
    assert "a staying rank failed during the drain" in message
    assert m.answers_called_off_confirmation("shrink") is None  # once

"""A serving rank's scale-up machine through every phase, with a cancel, a timeout and a
failed commit; pure (no SGLang, no torch)."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.agreement import AbortReason
from sglang_elastic_ep.core.phases import IllegalTransition, Phase
from sglang_elastic_ep.core.scale_up_machine import JoinerMachine, ScaleUpMachine


def machine(timeout_s: float = 60.0) -> ScaleUpMachine:
    return ScaleUpMachine(old_size=2, new_size=3, started_at=100.0, timeout_s=timeout_s)


def test_waits_then_enters_on_the_agreed_pass_and_commits() -> None:
    m = machine()
    assert m.phase is Phase.WAITING_FOR_COHORT and m.waiting and not m.done
    assert m.abort_reason(now=150.0) is AbortReason.NONE
    m.entered(now=151.0)
    assert m.observe(effective_size=2, still_pending=True, now=152.0) is None  # under way
    assert m.observe(effective_size=3, still_pending=False, now=153.0) is Phase.SERVING_EXPANDED
    assert m.done and m.error is None
    assert [(s.phase, s.at) for s in m.phase_stamps] == [
        (Phase.WAITING_FOR_COHORT, 100.0), (Phase.JOINING, 151.0),
        (Phase.SERVING_EXPANDED, 153.0)]


def test_a_cancel_before_the_commit_point_is_taken_and_wins_over_the_timeout() -> None:
    m = machine(timeout_s=10.0)
    assert m.request_cancel() == (True, "cancel of the scale-up to 3 requested")
    assert m.abort_reason(now=1_000.0) is AbortReason.CANCELLED  # also timed out by now
    assert m.call_off(AbortReason.CANCELLED, "", now=1_000.0) == "scale-up to 3 cancelled"
    assert m.phase is Phase.FAILED and m.done
    assert m.abort_reason(now=1_001.0) is AbortReason.NONE  # nothing left to call off


def test_a_cancel_after_the_commit_point_is_refused() -> None:
    m = machine()
    m.entered(now=101.0)
    accepted, message = m.request_cancel()
    assert not accepted and message == "the scale-up to 3 is past its commit point (joining)"
    assert m.abort_reason(now=1_000.0) is AbortReason.NONE
    with pytest.raises(IllegalTransition, match="cannot go from joining to joining"):
        m.entered(now=102.0)


def test_the_timeout_calls_the_wait_off() -> None:
    m = machine(timeout_s=60.0)
    assert m.abort_reason(now=160.0) is AbortReason.NONE
    assert m.abort_reason(now=160.5) is AbortReason.TIMED_OUT
    message = m.call_off(AbortReason.TIMED_OUT, "called off (timed_out)", now=161.0)
    assert message == ("scale-up to 3 called off: the joiners were not ready within 60 s "
                       "(--elastic-ep-scale-timeout)")
    assert machine(timeout_s=0.0).abort_reason(now=1e9) is AbortReason.NONE  # no limit


def test_a_commit_that_fails_on_this_rank_ends_failed() -> None:
    m = machine()
    m.entered(now=101.0)
    assert m.observe(effective_size=2, still_pending=False, now=102.0) is Phase.FAILED
    assert m.error == "scale-up to 3 failed on this rank; serving on at 2"
    with pytest.raises(IllegalTransition):
        m.call_off(AbortReason.CANCELLED, "", now=103.0)  # a failed scale-up is over


@pytest.mark.parametrize("old,new,timeout", [(3, 3, 0.0), (3, 2, 0.0), (0, 2, 0.0),
                                             (2, 3, -1.0)])
def test_bad_sizes_and_timeouts_are_refused(old: int, new: int, timeout: float) -> None:
    with pytest.raises(ValueError):
        ScaleUpMachine(old_size=old, new_size=new, started_at=0.0, timeout_s=timeout)


# ------------------------------------------------------------------------ the joiner's side


def joiner(offset: int = 2, new_size: int = 3) -> JoinerMachine:
    return JoinerMachine(join_offset=offset, new_size=new_size, started_at=10.0)


def test_a_joiner_goes_from_pending_to_serving_and_says_how_long_each_step_took() -> None:
    machine = joiner()
    assert machine.phase is Phase.PENDING and list(machine.ranks) == [2]
    machine.admitted(25.0)
    assert machine.phase is Phase.JOINING
    machine.syncing(40.0)
    assert machine.phase is Phase.SYNCING_NEW_WORLD
    machine.serving(40.5)
    assert machine.phase is Phase.SERVING_EXPANDED and machine.done
    assert machine.seconds_in_phases() == {Phase.PENDING: 15.0, Phase.JOINING: 15.0,
                                           Phase.SYNCING_NEW_WORLD: 0.5}


@pytest.mark.parametrize("steps", [0, 1, 2])
def test_a_step_that_raises_ends_the_joiner_failed(steps: int) -> None:
    machine = joiner()
    for step in (machine.admitted, machine.syncing)[:steps]:
        step(11.0)
    machine.fail("RuntimeError: peer gone", 12.0)
    assert machine.phase is Phase.FAILED and machine.error == "RuntimeError: peer gone"
    machine.fail("a later error", 13.0)  # the first failure is the one reported
    assert machine.error == "RuntimeError: peer gone"


def test_a_joiner_cannot_skip_its_admission_or_serve_twice() -> None:
    machine = joiner()
    with pytest.raises(IllegalTransition):
        machine.syncing(11.0)
    machine.admitted(11.0)
    machine.syncing(12.0)
    machine.serving(13.0)
    with pytest.raises(IllegalTransition):
        machine.serving(14.0)
    machine.fail("late", 15.0)  # a serving joiner keeps its end
    assert machine.phase is Phase.SERVING_EXPANDED


@pytest.mark.parametrize(("offset", "new_size"), [(0, 2), (3, 3), (4, 3)])
def test_a_joiner_outside_the_new_size_is_refused(offset: int, new_size: int) -> None:
    with pytest.raises(ValueError, match="1 <= first rank < new size"):
        JoinerMachine(join_offset=offset, new_size=new_size, started_at=0.0)

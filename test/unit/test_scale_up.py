"""The driver of a serving rank's scale-up machine (sglang/scale_up.py): the cancel request
each scheduler takes, the abort column it proposes, the verdict, what dropping it does, and how
upstream's admission and commit end the machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_elastic_ep.core.agreement import (
    AbortReason,
    LockstepVerdict,
    Proposal,
    StepKind,
    gathered_round,
    pack_row,
    unpack_rows,
)
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import scale_up
from sglang_elastic_ep.sglang.scale_up import (
    abort_pending_scale,
    abort_reason,
    request_cancel,
    scale_up_machine,
    scale_up_state,
    settle,
)


def waiting(target: int = 3, since: float = 100.0) -> SimpleNamespace:
    return SimpleNamespace(pending_ep_size=target, effective_ep_size=2,
                           scale_phase="waiting_for_cohort", pending_since=since)


def test_a_cancel_is_taken_while_the_scale_up_waits_and_refused_after() -> None:
    state = waiting()
    assert request_cancel(state) == (True, "cancel of the scale-up to 3 requested")
    assert abort_reason(state, 600.0, now=101.0) is AbortReason.CANCELLED
    past = waiting()
    past.scale_phase = "pending"  # upstream's admission began on the agreed pass
    accepted, message = request_cancel(past)
    assert not accepted and "past its commit point" in message
    assert scale_up_machine(past).phase is Phase.JOINING  # type: ignore[union-attr]
    idle = SimpleNamespace(pending_ep_size=None, effective_ep_size=3,
                           scale_phase="serving_expanded")
    accepted, message = request_cancel(idle)
    assert not accepted and "committed or ended" in message
    draining = SimpleNamespace(pending_ep_size=2, effective_ep_size=3, scale_phase="draining")
    accepted, message = request_cancel(draining)
    assert not accepted and "scale-down" in message


def test_a_scale_up_waiting_past_the_timeout_is_called_off() -> None:
    state = waiting(since=100.0)
    assert abort_reason(state, 600.0, now=650.0) is AbortReason.NONE
    assert abort_reason(state, 600.0, now=701.0) is AbortReason.TIMED_OUT
    # No limit: never timed out. No scale-up pending: nothing to call off.
    assert abort_reason(waiting(since=100.0), 0.0, now=10_000.0) is AbortReason.NONE
    state.pending_ep_size = None
    assert abort_reason(state, 600.0, now=701.0) is AbortReason.NONE


def test_a_new_request_gets_a_new_machine_and_a_commit_ends_it() -> None:
    state = waiting(target=3)
    first = scale_up_machine(state)
    assert first is not None and first.waiting and scale_up_machine(state) is first
    state.scale_phase = "pending"  # the agreed pass: upstream's admission began
    assert settle(state) is None and first.phase is Phase.JOINING  # the commit is under way
    state.pending_ep_size, state.effective_ep_size = None, 3
    state.scale_phase = "serving_expanded"
    assert settle(state) is Phase.SERVING_EXPANDED and first.done
    assert settle(state) is None  # ended once
    state.pending_ep_size, state.scale_phase = 4, "waiting_for_cohort"
    second = scale_up_machine(state)
    assert second is not first and second is not None
    assert (second.old_size, second.new_size) == (3, 4)


def test_upstream_failing_the_admission_ends_the_machine_failed() -> None:
    state = waiting(target=3)
    machine = scale_up_machine(state)
    assert machine is not None
    state.pending_ep_size, state.scale_phase = None, "failed"  # e.g. a cohort of another size
    assert settle(state) is Phase.FAILED
    assert machine.error == "scale-up to 3 failed on this rank; serving on at 2"


def test_one_rank_calling_off_is_an_abort_for_all_even_when_all_are_ready() -> None:
    ready = [Proposal(rank=r, kind=StepKind.GROW, ready=3, target=3, serving=2)
             for r in range(2)]
    assert gathered_round([pack_row(p) for p in ready]).verdict is LockstepVerdict.ENTER
    off = Proposal(rank=1, kind=StepKind.GROW, ready=0, target=3, serving=2,
                   abort=AbortReason.CANCELLED)
    rows = [pack_row(ready[0]), pack_row(off)]
    outcome = gathered_round(rows)
    assert outcome.verdict is LockstepVerdict.ABORT
    assert "cancelled" in (outcome.problem or "")
    assert unpack_rows(rows)[0][1].abort is AbortReason.CANCELLED
    with pytest.raises(ValueError, match="abort of step LET_GO"):
        Proposal(rank=0, kind=StepKind.LET_GO, ready=2, target=2, serving=3,
                 abort=AbortReason.TIMED_OUT)


class Runner:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _reset_eplb_after_elastic_scale_failure(self) -> None:
        self.calls.append("eplb re-armed")

    def _report_elastic_scale_failure(self, error: str, effective: int) -> None:
        self.calls.append(f"told tokenizer: {error} at {effective}")


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    failed: list[str] = []

    def fail_scale(error: str) -> None:
        failed.append(error)

    monkeypatch.setattr(scale_up, "state_manager",
                        lambda: SimpleNamespace(fail_scale=fail_scale))
    return failed


def test_dropping_a_cancelled_scale_up_tells_upstream_and_remembers_it(manager: list[str]) -> None:
    state = waiting()
    request_cancel(state)
    runner = Runner()
    abort_pending_scale(runner, state, AbortReason.CANCELLED,
                        "the scale to 3 is called off (cancelled)")
    assert manager == ["scale-up to 3 cancelled"]
    assert runner.calls == ["eplb re-armed", "told tokenizer: scale-up to 3 cancelled at 2"]
    # A cancel arriving after the drop (another scheduler's copy) is answered as done.
    state.pending_ep_size = None
    assert request_cancel(state) == (True, "the scale-up to 3 is already cancelled")


def test_a_timed_out_scale_up_is_dropped_with_the_reason(manager: list[str]) -> None:
    state = waiting()
    scale_up_machine(state, timeout_s=600.0)
    abort_pending_scale(Runner(), state, AbortReason.TIMED_OUT,
                        "the scale to 3 is called off (timed_out)")
    assert manager == ["scale-up to 3 called off: the joiners were not ready within 600 s "
                       "(--elastic-ep-scale-timeout)"]
    assert scale_up_state(state).last_cancelled is None
    assert scale_up_state(state).machine.phase is Phase.FAILED  # type: ignore[union-attr]


def test_a_rank_that_has_not_seen_the_request_drops_nothing(manager: list[str]) -> None:
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=2, scale_phase="idle")
    runner = Runner()
    abort_pending_scale(runner, state, AbortReason.CANCELLED, "called off")
    assert manager == [] and runner.calls == []


def test_a_rank_whose_copy_of_the_cancel_comes_later_answers_it_as_done(
    manager: list[str],
) -> None:
    # Rank 1 took the cancel and its row aborted the scale on every rank; rank 0's copy of
    # the cancel was still on its way. When it arrives, it is answered as done, not refused.
    state = waiting()
    abort_pending_scale(Runner(), state, AbortReason.CANCELLED,
                        "the scale to 3 is called off (cancelled)")
    assert manager == ["scale-up to 3 cancelled"]
    state.pending_ep_size = None
    assert request_cancel(state) == (True, "the scale-up to 3 is already cancelled")

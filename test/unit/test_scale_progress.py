"""Where the per-pass agreement runs, and what the membership step does with its verdict."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.core.agreement import (
    AbortReason,
    GatheredRound,
    LockstepVerdict,
    Proposal,
    StepKind,
    verdict_from_proposals,
)
from sglang_elastic_ep.sglang import launch_recovery, scale_progress, tail_recovery
from sglang_elastic_ep.sglang.gather_agreement import AgreedRound, gather_agreement
from sglang_elastic_ep.sglang.nixl_buffer_hooks import mirror_of
from sglang_elastic_ep.sglang.upstream import lockstep_agreement_on
from sglang_elastic_ep.sglang.world_view import world_quiesce


def test_agreement_on_any_device_with_room_to_grow() -> None:
    cpu_state = SimpleNamespace(active_ranks=torch.ones(4, dtype=torch.int32))
    grow = SimpleNamespace(max_ep_size=4, tp_size=2)
    full = SimpleNamespace(max_ep_size=2, tp_size=2)
    unset = SimpleNamespace(max_ep_size=None, tp_size=2)
    assert lockstep_agreement_on(cpu_state, grow) is True
    assert lockstep_agreement_on(cpu_state, full) is False
    assert lockstep_agreement_on(cpu_state, unset) is False
    assert lockstep_agreement_on(None, grow) is False
    # The verdict rides in the DP gather: no device-specific step, so no device gate.
    device_state = SimpleNamespace(active_ranks=torch.ones(4, device="meta"))
    assert lockstep_agreement_on(device_state, grow) is True


def round_of(verdict: LockstepVerdict, kind: StepKind = StepKind.GROW,
             target: int = 3) -> AgreedRound:
    target = 0 if kind is StepKind.NONE else target
    proposal = Proposal(rank=0, kind=kind, ready=target, target=target, serving=4)
    return AgreedRound(GatheredRound(verdict, (proposal,)), proposal)


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """``agreed_join_step`` on a fake state; ``calls`` records what it did."""
    import sglang.srt.runtime_context as runtime_context

    calls: list[str] = []
    state = SimpleNamespace(active_ranks=torch.ones(4, dtype=torch.int32),
                            active_ranks_cpu=torch.tensor([1, 1, 0, 0], dtype=torch.int32),
                            pending_ep_size=3, effective_ep_size=2,
                            scale_phase="waiting_for_cohort", last_error=None)
    runner = SimpleNamespace(_elastic_ep_readiness_skew=SimpleNamespace(
        entered=lambda: calls.append("skew reset")),
        eplb_manager=SimpleNamespace(reset_generator=lambda: calls.append("eplb reset")))
    monkeypatch.setattr(scale_progress, "elastic_state", lambda: state)
    monkeypatch.setattr(scale_progress, "lockstep_agreement_on", lambda s, p: True)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: object())
    failed_since_gather = SimpleNamespace(target=0)  # a rank failed in this pass's forward
    monkeypatch.setattr(tail_recovery, "contraction_target",
                        lambda s, r: failed_since_gather.target)
    launch_failed = SimpleNamespace(ranks=())  # launch-time ranks down after a scale
    monkeypatch.setattr(launch_recovery, "ranks_to_rejoin", lambda s: launch_failed.ranks)
    monkeypatch.setattr(launch_recovery, "rejoin_in_place",
                        lambda r, s, ranks: calls.append(f"take back {list(ranks)}"))
    monkeypatch.setattr(tail_recovery, "note_committed", lambda s: calls.append("noted"))
    monkeypatch.setattr(tail_recovery, "let_go_of_failed_tail",
                        lambda r, t: calls.append(f"let go to {t}"))
    monkeypatch.setattr(scale_progress, "finalize_scale_down",
                        lambda r, t: calls.append(f"shrink to {t}"))
    monkeypatch.setattr(scale_progress, "call_off_scale_down",
                        lambda r, s, o: calls.append(
                            f"shrink to {max(p.target for p in o.proposals if p.abort)} off"))
    monkeypatch.setattr(scale_progress, "abort_pending_scale",
                        lambda r, s, reason, detail: calls.append("scale-up off"))
    monkeypatch.setattr(scale_progress, "agree_by_all_reduce",
                        lambda s, r: calls.append("all-reduce") or round_of(LockstepVerdict.WAIT))

    def run(upstream: Callable[[], None] = lambda: calls.append("upstream")) -> None:
        scale_progress.agreed_join_step(lambda r: upstream(), runner)

    return SimpleNamespace(calls=calls, state=state, run=run,
                           agreement=gather_agreement(state), failed=failed_since_gather,
                           launch_failed=launch_failed)


@pytest.mark.parametrize(("agreed", "expected"), [
    (round_of(LockstepVerdict.WAIT), []),
    (round_of(LockstepVerdict.NOTHING_PENDING, StepKind.NONE), ["upstream", "noted"]),
    (round_of(LockstepVerdict.ENTER), ["skew reset", "upstream", "noted"]),
    (round_of(LockstepVerdict.ENTER, StepKind.SHRINK, 2), ["skew reset", "shrink to 2"]),
    (round_of(LockstepVerdict.ENTER, StepKind.LET_GO, 2), ["skew reset", "let go to 2"]),
])
def test_the_step_acts_on_this_passes_gathered_verdict_without_a_collective(
    step: SimpleNamespace, agreed: AgreedRound, expected: list[str]
) -> None:
    step.agreement.finish(agreed)
    step.agreement.mark_iteration()
    step.run()
    assert step.calls == expected  # no "all-reduce"


@pytest.mark.parametrize(("kind", "expected"), [
    (StepKind.SHRINK, ["shrink to 2 off"]),
    (StepKind.GROW, ["scale-up off"]),
])
def test_an_abort_drops_the_step_that_was_called_off(
    step: SimpleNamespace, kind: StepKind, expected: list[str]
) -> None:
    called_off = Proposal(rank=1, kind=kind, ready=0, target=2, serving=4,
                          abort=AbortReason.TIMED_OUT)
    mine = Proposal(rank=0, kind=StepKind.NONE, ready=0, target=0, serving=4)
    step.agreement.finish(AgreedRound(verdict_from_proposals([mine, called_off]), mine))
    step.agreement.mark_iteration()
    step.run()
    assert step.calls == expected


def test_the_all_reduce_fallback_tells_a_rank_which_step_another_called_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang_elastic_ep.sglang import expert_health, gather_agreement

    mine = Proposal(rank=0, kind=StepKind.NONE, ready=0, target=0, serving=3)
    monkeypatch.setattr(gather_agreement, "propose", lambda state, runner, batch_idle: mine)
    monkeypatch.setattr(expert_health, "local_contribution", lambda rank, size: [0, 0])
    taken: list[list[int]] = []
    monkeypatch.setattr(expert_health, "expert_health_state",
                        lambda state: SimpleNamespace(take_gathered=taken.append))

    host_group = object()
    groups: list[object] = []

    def all_reduce(tensor: torch.Tensor, op: object, group: object) -> None:
        # Another rank drains a scale-down to 2 and calls it off (timed out).
        groups.append(group)
        other = torch.tensor([0, 0, 2, int(AbortReason.TIMED_OUT), int(StepKind.SHRINK), 7, 1])
        tensor.copy_(torch.maximum(tensor, other))

    monkeypatch.setattr(gather_agreement.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(gather_agreement, "world_host_group", lambda: host_group)
    # The mask on a device (meta stands in): the fallback still reduces host tensors over
    # WORLD's host group.
    state = SimpleNamespace(active_ranks=torch.ones(3, device="meta"))
    agreed = gather_agreement.agree_by_all_reduce(state, runner=None)
    assert groups == [host_group]
    assert agreed.verdict is LockstepVerdict.ABORT
    (called_off,) = agreed.outcome.proposals
    assert (called_off.kind, called_off.target, called_off.abort) == (
        StepKind.SHRINK, 2, AbortReason.TIMED_OUT)
    assert taken == [[7, 1]]  # the timings after the five agreement columns


def test_a_scale_up_failed_by_upstream_on_this_rank_alone_is_logged_by_it(
    step: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    def upstream_fails_it() -> None:  # what ElasticEPStateManager.fail_scale leaves
        step.state.pending_ep_size, step.state.scale_phase = None, "failed"
        step.state.last_error = "Requested target EP size 3 does not match joining cohort target 4"

    step.agreement.finish(round_of(LockstepVerdict.ENTER))
    step.agreement.mark_iteration()
    with caplog.at_level(logging.INFO):
        step.run(upstream_fails_it)
    assert "rank 0 enters the scale-up to 3 (joining [2]; verdict from the gather)" \
        in caplog.text
    assert "rank 0: the scale-up to 3 failed on this rank: Requested target EP size 3 does not " \
        "match joining cohort target 4" in caplog.text


def test_a_committed_scale_up_logs_no_failure(
    step: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    def upstream_commits() -> None:  # what ElasticEPStateManager.commit_scale leaves
        step.state.pending_ep_size, step.state.scale_phase = None, "serving_expanded"
        step.state.effective_ep_size = 3

    step.agreement.finish(round_of(LockstepVerdict.ENTER))
    step.agreement.mark_iteration()
    with caplog.at_level(logging.INFO):
        step.run(upstream_commits)
    assert "enters the scale-up to 3" in caplog.text
    assert "failed on this rank" not in caplog.text


def test_a_rank_whose_upstream_step_skipped_the_admission_says_so(
    step: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    # Upstream returned before ``_try_recover_world`` (the cohort not seen, say): the members
    # armed on the agreed pass were never met.
    step.agreement.finish(round_of(LockstepVerdict.ENTER))
    step.agreement.mark_iteration()
    with caplog.at_level(logging.INFO):
        step.run()
    assert "rank 0: upstream's step returned before the admission of the agreed scale-up to " \
        "3 (phase waiting_for_cohort, pending 3, serving 2)" in caplog.text
    assert world_quiesce(step.state).take() == ()  # no later change meets these members


def test_a_rank_that_proposed_the_admission_says_nothing_more(
    step: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    step.agreement.finish(round_of(LockstepVerdict.ENTER))
    step.agreement.mark_iteration()
    with caplog.at_level(logging.INFO):
        step.run(lambda: world_quiesce(step.state).take())  # as the admission's barrier does
    assert "returned before the admission" not in caplog.text


@pytest.mark.parametrize(("verdict", "again"), [
    (LockstepVerdict.ENTER, []),
    (LockstepVerdict.WAIT, []),
    (LockstepVerdict.NOTHING_PENDING, ["upstream"]),
])
def test_a_second_step_in_the_same_iteration_acts_on_nothing_new(
    step: SimpleNamespace, verdict: LockstepVerdict, again: list[str]
) -> None:
    kind = StepKind.NONE if verdict is LockstepVerdict.NOTHING_PENDING else StepKind.GROW
    step.agreement.finish(round_of(verdict, kind))
    step.agreement.mark_iteration()
    step.run()
    step.calls.clear()
    step.run()  # e.g. a draft model's forward in the same pass
    assert step.calls == again


def test_a_pass_without_a_gather_agrees_by_the_host_all_reduce_on_any_device(
    step: SimpleNamespace,
) -> None:
    for mask_device in ("cpu", "meta"):  # meta stands in for a GPU's mask
        step.state.active_ranks = torch.ones(4, dtype=torch.int32, device=mask_device)
        step.calls.clear()
        step.agreement.mark_iteration()  # no gather in this iteration
        step.run()
        assert step.calls == ["all-reduce"]  # the fallback, not upstream's own step


def test_without_the_agreement_the_step_is_upstreams(step: SimpleNamespace,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale_progress, "lockstep_agreement_on", lambda s, p: False)
    step.agreement.finish(round_of(LockstepVerdict.WAIT))
    step.run()
    assert step.calls == ["upstream"]


def test_the_idle_step_runs_after_an_agreed_no_batch_and_marks_every_iteration(
    step: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    runner = SimpleNamespace(maybe_join_ep_ranks=lambda: calls.append("step"))
    sched = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner),
                            _maybe_report_active_ranks=lambda: calls.append("report"))
    agreement = step.agreement

    def iteration(batch: Any, gathered: bool) -> None:
        if gathered:
            agreement.finish(round_of(LockstepVerdict.WAIT))
        scale_progress.progress_membership_when_idle(SimpleNamespace(batch_to_run=batch), sched)

    # Mooncake's launch-time group evicted rank 1 while every rank idled (no forward, so the
    # dispatcher never cleared it in the state's mask): the idle step folds the group's drop
    # into the state's mask and copies it to the host before the report reads it.
    group = SimpleNamespace(ranks=[0, 1], active_ranks_cpu=torch.ones(2, dtype=torch.int32))
    monkeypatch.setattr(scale_progress, "mooncake_groups", lambda: [group])
    step.state.active_ranks = torch.tensor([1, 1, 0, 0], dtype=torch.int32)
    step.state.sync_active_to_cpu = lambda: (
        calls.append("sync"), step.state.active_ranks_cpu.copy_(step.state.active_ranks))
    iteration(object(), gathered=True)
    assert calls == [] and agreement.iteration_gathered
    iteration(None, gathered=True)  # the first read of the group's mask: nothing dropped yet
    assert calls == ["step", "sync", "report"]
    group.active_ranks_cpu[1] = 0
    iteration(None, gathered=True)
    assert step.state.active_ranks_cpu.tolist() == [1, 0, 0, 0]
    calls.clear()
    monkeypatch.setattr(scale_progress, "mooncake_groups", lambda: [])
    step.state.active_ranks = torch.ones(4, dtype=torch.int32, device="meta")
    step.state.sync_active_to_cpu = lambda: calls.append("sync")  # meta holds no values
    iteration(None, gathered=False)
    # No gather this iteration, on any device: the step runs and agrees by the host all-reduce.
    assert calls == ["step", "sync", "report"] and not agreement.iteration_gathered


def test_a_failure_seen_after_the_gather_skips_upstreams_step_until_the_next_gather(
    step: SimpleNamespace,
) -> None:
    # The gather said nothing is pending, but this pass's forward found a scale-joined rank
    # dead: upstream's step would declare the failure unrecoverable, so it is not run; the
    # next pass's gather carries the let-go.
    step.failed.target = 2
    step.agreement.fresh = round_of(LockstepVerdict.NOTHING_PENDING, StepKind.NONE)
    step.run()
    assert step.calls == []
    step.agreement.fresh = round_of(LockstepVerdict.ENTER, StepKind.LET_GO, target=2)
    step.run()
    assert step.calls == ["skew reset", "let go to 2"]


@pytest.mark.parametrize(("slot", "kind", "eplb"), [
    (2, "scale-up", []),  # a new slot: upstream re-arms EPLB, nothing reset here
    (1, "recovery", ["eplb reset"]),  # a slot that served before: stale statistics
])
def test_a_grow_logs_which_kind_of_join_it_was_and_resets_eplb_for_a_recovery_only(
    step: SimpleNamespace, slot: int, kind: str, eplb: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    mirror = mirror_of(step.state)
    if slot == 1:  # rank 1 failed (it served before)
        mirror.set_active([1], False)
    step.agreement.finish(round_of(LockstepVerdict.ENTER, StepKind.GROW, slot + 1))
    step.agreement.mark_iteration()
    with caplog.at_level(logging.INFO):
        step.run(lambda: mirror.set_active([slot]))
    assert step.calls == ["skew reset", "noted", *eplb]
    assert f"ranks [{slot}] joined by {kind}" in caplog.text


def test_a_failed_launch_rank_after_a_scale_waits_then_is_taken_back_on_the_agreed_pass(
    step: SimpleNamespace,
) -> None:
    # Upstream's step would fail the recovery (recovery_unsupported): it never runs while the
    # survivors wait for the replacement, and RECOVER takes it back on the agreed pass.
    step.launch_failed.ranks = (1,)
    step.agreement.fresh = round_of(LockstepVerdict.NOTHING_PENDING, StepKind.NONE)
    step.run()
    step.agreement.fresh = round_of(LockstepVerdict.WAIT, StepKind.RECOVER, target=3)
    step.run()
    assert step.calls == []
    step.agreement.fresh = round_of(LockstepVerdict.ENTER, StepKind.RECOVER, target=3)
    step.run()
    assert step.calls == ["skew reset", "take back [1]"]


def test_only_a_drop_in_a_group_mask_clears_the_state_mask() -> None:
    state = SimpleNamespace(active_ranks=torch.tensor([1, 1, 1, 0], dtype=torch.int32),
                            active_ranks_cpu=torch.tensor([1, 1, 1, 0], dtype=torch.int32))
    launch = SimpleNamespace(ranks=[0, 1], active_ranks_cpu=torch.tensor([1, 1], dtype=torch.int32))
    world = SimpleNamespace(ranks=[0, 1, 2, 3],
                            active_ranks_cpu=torch.tensor([1, 1, 1, 0], dtype=torch.int32))
    groups = [launch, world]
    assert scale_progress.fold_group_evictions(state, groups) == []  # first read: a baseline
    # rank 3 rises late in WORLD's mask (a joiner's admission the bitmap lags): nothing changes
    world.active_ranks_cpu[3] = 1
    assert scale_progress.fold_group_evictions(state, groups) == []
    # rank 2 dropped from WORLD and rank 1 from the launch-time group: both cleared, once
    world.active_ranks_cpu[2] = 0
    launch.active_ranks_cpu[1] = 0
    assert scale_progress.fold_group_evictions(state, groups) == [1, 2]
    assert state.active_ranks.tolist() == [1, 0, 0, 0]
    assert scale_progress.fold_group_evictions(state, groups) == []
    # a group without a Mooncake mask (gloo) is skipped
    assert scale_progress.fold_group_evictions(
        state, [SimpleNamespace(ranks=[0, 1], active_ranks_cpu=None)]) == []


def test_a_rank_fault_logs_the_last_reports_of_the_ranks_it_takes_for_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without EPLB the survivor records the new mask itself; the ranks that went from active
    to inactive on it are the ones whose last progress reports get logged."""
    logged: list[list[int]] = []

    class FakeState:
        active_ranks_cpu = torch.tensor([1, 1, 1, 0])

        def is_active_equal_last(self) -> bool:
            return False

        def snapshot_active_to_last(self) -> None:
            pass

        def sync_active_to_cpu(self) -> None:
            self.active_ranks_cpu = torch.tensor([0, 1, 1, 0])

    state = FakeState()
    monkeypatch.setattr(scale_progress, "elastic_state", lambda: state)
    monkeypatch.setattr(scale_progress, "pass_progress", lambda s: SimpleNamespace(
        log_last_reports=lambda ranks: logged.append(list(ranks))))
    assert scale_progress.rebalance_after_rank_fault(None, eplb_manager=None) is False
    assert logged == [[0]]

"""The controller's pure decisions: observations in, actions and holds out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import pytest

from sglang_elastic_ep.core.api_models import (
    HealthResponse,
    OperationKind,
    OperationResult,
    OperationStatus,
    RankFailedEvent,
    RankHealthStatus,
    RankPosition,
    RankRecoveredEvent,
    RecoveryRequiredEvent,
    ScaleCommittedEvent,
    StallStatus,
    StatusResponse,
)
from sglang_elastic_ep.core.autoscaler import AutoscalerConfig
from sglang_elastic_ep.core.controller import (
    CancelScale,
    ControllerConfig,
    Decision,
    ElasticController,
    JoinMode,
    Launch,
    LaunchJoiner,
    LoadReading,
    Purpose,
    Relaunch,
    ScaleTo,
    Terminate,
    operation_id,
    parse_operation_id,
    recover_operation_id,
)
from sglang_elastic_ep.core.membership import Membership
from sglang_elastic_ep.core.phases import Phase

INST = "inst-a"
HOT = LoadReading(queued_per_rank=10.0, running_per_rank=20.0, kv_usage=0.3, shards=2)
QUIET = LoadReading(queued_per_rank=0.0, running_per_rank=1.0, kv_usage=0.1, shards=2)


def config(**kw: Any) -> ControllerConfig:
    policy = dict(min_size=2, max_size=8, scale_up_load=8, scale_down_load=2, target_load=5,
                  up_window_s=0, down_window_s=0, cooldown_s=0, max_step_up=1)
    policy.update(kw.pop("policy", {}))
    kw.setdefault("launch_size", 2)
    return ControllerConfig(policy=AutoscalerConfig(**policy), **kw)


def op(op_id: str, old: int, new: int, *, result: str = "running", at: float = 0.0,
       error: str | None = None) -> OperationStatus:
    up = new > old
    if result == "running":
        phase = Phase.WAITING_FOR_COHORT if up else Phase.DRAINING
    elif result == "succeeded":
        phase = Phase.SERVING_EXPANDED if up else Phase.SERVING_CONTRACTED
    else:
        phase = Phase.FAILED
    return OperationStatus(
        operation_id=op_id, kind=OperationKind.SCALE_UP if up else OperationKind.SCALE_DOWN,
        old_ep_size=old, new_ep_size=new, phase=phase, phase_timestamps=[], started_at=at,
        finished_at=None if result == "running" else at, result=OperationResult(result),
        error=error,
    )


def status(size: int, *, failed: Iterable[int] = (), safe: Iterable[int] = (),
           current: OperationStatus | None = None, recent: Sequence[OperationStatus] = (),
           max_size: int = 8, instance: str = INST,
           removed: Iterable[int] = ()) -> StatusResponse:
    pending = current.new_ep_size if current and current.new_ep_size > size else None
    leaving = range(current.new_ep_size, size) if current and current.new_ep_size < size else ()
    m = Membership(max_size=max_size, effective_size=size, pending_size=pending,
                   failed=frozenset(failed), leaving=frozenset(leaving),
                   safe_to_terminate=frozenset(safe), removed=frozenset(removed))
    return StatusResponse(
        instance_id=instance, phase=current.phase if current else Phase.IDLE,
        effective_ep_size=m.serving_size, pending_ep_size=pending, max_ep_size=max_size,
        ranks=m.rank_statuses(), safe_to_terminate_ranks=sorted(m.safe_to_terminate),
        current_operation=current, recent_operations=list(recent),
    )


def health(*, blocked: Iterable[int] = (), size: int = 3, instance: str = INST) -> HealthResponse:
    ranks = [RankHealthStatus(rank=r, alive=True, healthy=r not in blocked,
                              consecutive_unhealthy_checks=10 if r in blocked else 0,
                              total_unhealthy_checks=10 if r in blocked else 0,
                              hard_blocked=r in blocked) for r in range(size)]
    return HealthResponse(instance_id=instance, checks=12, latency_threshold=3.0,
                          persistence_threshold=10, median_latency_s=0.01, ranks=ranks,
                          experts=[])


def launch(offset: int, op_id: str, *, alive: bool = True, mode: JoinMode = JoinMode.SCALE,
           size: int = 1, started: float = 0.0) -> Launch:
    return Launch(handle=f"h-{op_id}-{offset}", rank_offset=offset, num_ranks=size, mode=mode,
                  operation_id=op_id, alive=alive, started_at=started)


class Event:
    """Events with increasing ids, like one server instance's log."""

    def __init__(self, instance: str = INST) -> None:
        self.instance = instance
        self.next_id = 1

    def _base(self) -> dict[str, Any]:
        base = {"event_id": self.next_id, "time": float(self.next_id), "instance_id": self.instance}
        self.next_id += 1
        return base

    def failed(self, *ranks: int) -> RankFailedEvent:
        return RankFailedEvent(**self._base(), ranks=list(ranks), reason="heartbeat lost")

    def required(self, *ranks: int) -> RecoveryRequiredEvent:
        return RecoveryRequiredEvent(**self._base(), ranks=list(ranks), reason="dead",
                                     suggested_action="relaunch")

    def recovered(self, *ranks: int) -> RankRecoveredEvent:
        return RankRecoveredEvent(**self._base(), ranks=list(ranks))

    def committed(self, op_id: str, old: int, new: int) -> ScaleCommittedEvent:
        ranks = list(range(min(old, new), max(old, new)))
        return ScaleCommittedEvent(**self._base(), operation_id=op_id, old_ep_size=old,
                                   new_ep_size=new, duration_s=1.0, ranks=ranks)


def step(c: ElasticController, now: float, s: StatusResponse, *,
         load: LoadReading | None = None, launches: Iterable[Launch] = (),
         health_report: HealthResponse | None = None) -> Decision:
    c.observe_status(s)
    c.observe_load(load)
    c.observe_health(health_report)
    c.observe_launches(launches)
    return c.decide(now)


def only(decision: Decision, kind: type) -> Any:
    assert len(decision.actions) == 1, decision
    (action,) = decision.actions
    assert isinstance(action, kind), decision
    return action


# --- autoscaling through the controller -------------------------------------------------


def test_hot_load_scales_up_with_its_own_operation_id_and_logged_inputs() -> None:
    c = ElasticController(config())
    action = only(step(c, 100, status(2), load=HOT), ScaleTo)
    assert (action.target, action.purpose, action.operation_id) == (3, Purpose.GROW,
                                                                     "ctl-1-grow-to-3")
    assert action.inputs["load_per_rank"] == 30.0 and action.inputs["active_ranks"] == 2
    assert "grow 2 -> 3" in action.reason


def test_one_operation_at_a_time() -> None:
    c = ElasticController(config())
    only(step(c, 100, status(2), load=HOT), ScaleTo)
    # Until the server shows it, nothing else is asked for.
    decision = step(c, 101, status(2), load=HOT)
    assert decision.actions == ()
    assert "waiting for the server to show operation ctl-1-grow-to-3" in decision.holds[0].reason
    # While it runs (or anyone else's runs), no resize either.
    running = status(2, current=op("ctl-1-grow-to-3", 2, 3))
    decision = step(c, 102, running, load=HOT, launches=[launch(2, "ctl-1-grow-to-3")])
    assert decision.actions == ()
    external = status(2, current=op("someone-else", 2, 1))
    assert step(c, 103, external, load=HOT).actions == ()


def test_numbering_resumes_after_the_newest_id_the_server_shows() -> None:
    c = ElasticController(config())
    done = op("ctl-41-grow-to-3", 2, 3, result="succeeded", at=0)
    action = only(step(c, 100, status(3, recent=[done]), load=HOT), ScaleTo)
    assert action.operation_id == "ctl-42-grow-to-4"


def test_cooldown_counts_from_the_servers_last_finished_operation() -> None:
    c = ElasticController(config(policy={"cooldown_s": 60}))
    done = op("anyone", 2, 3, result="succeeded", at=1000.0)
    decision = step(c, 1030, status(3, recent=[done]), load=HOT)
    assert decision.actions == () and "cooldown" in decision.holds[0].reason
    assert only(step(c, 1060, status(3, recent=[done]), load=HOT), ScaleTo).target == 4


def test_quiet_load_scales_down_and_bounds_hold() -> None:
    c = ElasticController(config())
    action = only(step(c, 100, status(4), load=QUIET), ScaleTo)
    assert (action.target, action.purpose) == (3, Purpose.SHRINK)
    assert action.operation_id == "ctl-1-shrink-to-3"
    at_min = ElasticController(config())
    decision = step(at_min, 100, status(2), load=QUIET)
    assert decision.actions == () and "--min-size" in decision.holds[0].reason


def test_a_target_above_the_servers_max_ep_size_is_not_asked_for() -> None:
    c = ElasticController(config(policy={"max_size": 8}))
    decision = step(c, 100, status(4, max_size=4), load=HOT)
    assert decision.actions == () and "--max-ep-size 4" in decision.holds[0].reason


def test_a_refused_or_dry_run_request_frees_the_next_decision() -> None:
    c = ElasticController(config())
    first = only(step(c, 100, status(2), load=HOT), ScaleTo)
    c.observe_scale_answer(first.operation_id, accepted=False)
    second = only(step(c, 101, status(2), load=HOT), ScaleTo)
    assert second.operation_id == "ctl-2-grow-to-3"


def test_autoscale_off_holds() -> None:
    c = ElasticController(config(autoscale=False))
    decision = step(c, 100, status(2), load=HOT)
    assert decision.actions == () and "--no-autoscale" in decision.holds[0].reason


# --- joiners and terminations ---------------------------------------------------------


def test_running_scale_up_gets_its_joiners_once() -> None:
    c = ElasticController(config())
    running = status(2, current=op("grow-x", 2, 4))
    decision = step(c, 100, running)
    launches = [a for a in decision.actions if isinstance(a, LaunchJoiner)]
    assert [(a.spec.rank_offset, a.spec.num_ranks, a.spec.mode, a.spec.operation_id,
             a.spec.ep_size) for a in launches] == [
        (2, 1, JoinMode.SCALE, "grow-x", 4), (3, 1, JoinMode.SCALE, "grow-x", 4)]
    # Launched: nothing more; one exited: not relaunched (the operation fails and releases it).
    assert step(c, 101, running, launches=[launch(2, "grow-x"), launch(3, "grow-x")]).actions \
        == ()
    decision = step(c, 102, running, launches=[launch(2, "grow-x"), launch(3, "grow-x",
                                                                           alive=False)])
    assert decision.actions == ()
    assert any("exited" in h.reason for h in decision.holds)


def test_its_own_scale_up_whose_joiner_died_before_the_commit_is_cancelled_once() -> None:
    c = ElasticController(config())
    mine = status(2, current=op("ctl-1-grow-to-4", 2, 4))
    dead = [launch(2, "ctl-1-grow-to-4"), replace(launch(3, "ctl-1-grow-to-4", alive=False),
                                                  exit_code=1)]
    decision = step(c, 100, mine, launches=dead)
    (cancel,) = [a for a in decision.actions if isinstance(a, CancelScale)]
    assert cancel.operation_id == "ctl-1-grow-to-4"
    assert "exited (codes [1])" in cancel.reason and cancel.inputs["exit_codes"] == [1]
    # Past the commit point, or someone else's operation: the server ends it; only a hold.
    current = mine.current_operation
    assert current is not None
    for other in (current.model_copy(update={"phase": Phase.JOINING}),
                  current.model_copy(update={"operation_id": "grow-x"})):
        running = status(2, current=other)
        launches = [replace(x, operation_id=other.operation_id) for x in dead]
        decision = step(c, 101, running, launches=launches)
        assert not [a for a in decision.actions if isinstance(a, CancelScale)]
        assert any("will fail and release it" in h.reason for h in decision.holds)


def test_joiners_are_whole_steps_and_never_below_launch_size() -> None:
    c = ElasticController(config(policy={"step": 2, "min_size": 2, "max_step_up": 2},
                                 launch_size=4))
    decision = step(c, 100, status(2, current=op("up", 2, 6)))
    assert [(a.spec.rank_offset, a.spec.num_ranks) for a in decision.actions] == [(4, 2)]
    assert any("below --launch-size 4" in h.reason for h in decision.holds)


def test_no_joiner_over_a_slot_that_still_runs_an_unreleased_process() -> None:
    c = ElasticController(config())
    decision = step(c, 100, status(2, current=op("up", 2, 3)), launches=[launch(2, "old")])
    assert decision.actions == ()
    assert any("older process" in h.reason for h in decision.holds)


def test_terminates_exactly_the_ranks_listed_safe_to_terminate() -> None:
    c = ElasticController(config())
    launches = [launch(2, "a"), launch(3, "b"), launch(4, "c", alive=False),
                launch(5, "d", size=2)]
    s = status(3, safe=[3, 4, 5])  # 5 is listed, 6 (the other half of "d") is not
    decision = step(c, 100, s, launches=launches, load=HOT)
    action = only(decision, Terminate)
    assert action.ranks == (3,)
    assert any("before anything else" in h.reason for h in decision.holds)  # no resize yet
    assert step(c, 101, status(3), launches=launches).actions == ()  # nothing listed: nothing


# --- self-healing ---------------------------------------------------------------------


def test_a_failed_rank_is_relaunched_in_recover_mode_once() -> None:
    c = ElasticController(config())
    e = Event()
    c.observe_event(e.failed(2))
    c.observe_event(e.required(2))  # the same fault: one failure
    s = status(3, failed=[2])
    action = only(step(c, 100, s, launches=[launch(2, "ctl-1-grow-to-3")]), Relaunch)
    assert (action.spec.rank_offset, action.spec.mode, action.spec.operation_id,
            action.attempt, action.spec.ep_size) == (2, JoinMode.RECOVER, "ctl-recover-r2-e1-1",
                                                     1, 3)
    assert not action.stuck
    replacement = launch(2, "ctl-recover-r2-e1-1", mode=JoinMode.RECOVER, started=100)
    decision = step(c, 101, s, launches=[replacement])
    assert decision.actions == () and "waiting for the replacement" in decision.holds[0].reason


def test_the_failure_event_arriving_after_the_relaunch_starts_no_second_replacement() -> None:
    c = ElasticController(config())
    s = status(3, failed=[2])
    first = only(step(c, 100, s), Relaunch)  # the status shows the fault before its event
    assert first.spec.operation_id == "ctl-recover-r2-e0-1"
    e = Event()
    c.observe_event(e.failed(2))
    c.observe_event(e.required(2))
    replacement = launch(2, first.spec.operation_id, mode=JoinMode.RECOVER, started=100)
    decision = step(c, 101, s, launches=[replacement])
    assert decision.actions == ()
    assert "waiting for the replacement" in decision.holds[0].reason
    assert first.spec.operation_id in decision.holds[0].reason
    # It dies before rejoining: the next attempt is the second, under the event's id.
    dead = launch(2, first.spec.operation_id, mode=JoinMode.RECOVER, alive=False, started=100)
    again = only(step(c, 110, s, launches=[dead]), Relaunch)
    assert (again.attempt, again.spec.operation_id) == (2, "ctl-recover-r2-e1-2")


def test_no_autoscaling_while_a_rank_is_failed() -> None:
    c = ElasticController(config(heal=False))
    decision = step(c, 100, status(3, failed=[2]), load=HOT)
    assert decision.actions == () and "--no-heal" in decision.holds[0].reason


def test_a_hole_holds_scaling_until_its_relaunch_refills_it() -> None:
    c = ElasticController(config())
    decision = step(c, 100, status(3, removed=[1], safe=[1]), load=HOT)
    assert decision.actions == (), decision
    assert "rank(s) 1 were removed where they were" in decision.holds[0].reason
    assert "--ep-join-mode recover" in decision.holds[0].reason


def test_a_rank_above_a_hole_that_fails_is_still_healed() -> None:
    c = ElasticController(config(launch_size=2))
    decision = step(c, 100, status(3, removed=[1], failed=[2]))
    relaunch = only(decision, Relaunch)
    assert relaunch.spec.rank_offset == 2 and relaunch.spec.mode is JoinMode.RECOVER
    assert relaunch.spec.ep_size == 3  # the size it rejoins into counts the hole's slot


def test_a_replacement_that_dies_before_rejoining_counts_as_a_failure() -> None:
    c = ElasticController(config(max_relaunches=2))
    s = status(3, failed=[2])
    first = only(step(c, 100, s), Relaunch)
    dead = launch(2, first.spec.operation_id, alive=False, mode=JoinMode.RECOVER)
    second = only(step(c, 110, s, launches=[dead]), Relaunch)
    assert (second.attempt, second.spec.operation_id) == (2, "ctl-recover-r2-e0-2")
    dead2 = launch(2, second.spec.operation_id, alive=False, mode=JoinMode.RECOVER)
    third = only(step(c, 120, s, launches=[dead, dead2]), ScaleTo)
    assert (third.purpose, third.target, third.operation_id) == (Purpose.REMOVE, 2,
                                                                 "ctl-1-remove-to-2")


def test_a_replacement_not_back_within_the_recover_timeout_counts_as_a_failure() -> None:
    c = ElasticController(config(recover_timeout_s=300))
    s = status(3, failed=[2])
    only(step(c, 100, s), Relaunch)
    slow = launch(2, "ctl-recover-r2-e0-1", mode=JoinMode.RECOVER, started=100)
    assert step(c, 399, s, launches=[slow]).actions == ()
    again = only(step(c, 401, s, launches=[slow]), Relaunch)
    assert again.attempt == 2  # the relaunch stops the stuck one (same ranks) first


def test_after_max_relaunches_failures_the_rank_is_removed_then_the_size_regrown() -> None:
    c = ElasticController(config(max_relaunches=2))
    e = Event()
    for _ in range(2):  # failed, relaunched, recovered: twice
        c.observe_event(e.failed(2))
        c.observe_event(e.recovered(2))
    c.observe_event(e.failed(2))  # the third failure
    decision = step(c, 100, status(3, failed=[2]), launches=[launch(2, "ctl-recover-r2-2")])
    removal = only(decision, ScaleTo)
    assert (removal.target, removal.purpose, removal.operation_id) == (2, Purpose.REMOVE,
                                                                       "ctl-1-remove-to-2")
    assert removal.inputs["give_up"] == {2: 3}

    # Committed: rank 2 is released; its process is terminated before the regrow.
    done = op("ctl-1-remove-to-2", 3, 2, result="succeeded", at=100)
    c.observe_event(e.committed("ctl-1-remove-to-2", 3, 2))
    after = status(2, safe=[2], recent=[done])
    old = launch(2, "ctl-recover-r2-2", mode=JoinMode.RECOVER)
    decision = step(c, 101, after, launches=[old], load=QUIET)
    assert only(decision, Terminate).ranks == (2,)
    # Terminated: regrow to the size before the removal, whatever the load says.
    gone = launch(2, "ctl-recover-r2-2", mode=JoinMode.RECOVER, alive=False)
    regrow = only(step(c, 102, after, launches=[gone], load=QUIET), ScaleTo)
    assert (regrow.target, regrow.purpose, regrow.operation_id) == (3, Purpose.REGROW,
                                                                    "ctl-2-regrow-to-3")
    # The regrow's joiner is a fresh rank: its failures start from zero again.
    c.observe_event(e.committed("ctl-2-regrow-to-3", 2, 3))
    c.observe_event(e.failed(2))
    regrown = op("ctl-2-regrow-to-3", 2, 3, result="succeeded", at=200)
    relaunch = only(step(c, 300, status(3, failed=[2], recent=[regrown, done])), Relaunch)
    assert relaunch.attempt == 1


def test_a_relaunch_for_an_earlier_fault_of_the_slot_does_not_count_now() -> None:
    c = ElasticController(config(max_relaunches=2))
    e = Event()
    c.observe_event(e.failed(2))  # fault 1: relaunched, came back
    c.observe_event(e.recovered(2))
    c.observe_event(e.failed(2))  # fault 3: the second failure
    earlier = launch(2, "ctl-recover-r2-e1-1", mode=JoinMode.RECOVER, alive=False)
    action = only(step(c, 100, status(3, failed=[2]), launches=[earlier]), Relaunch)
    assert (action.attempt, action.spec.operation_id) == (2, "ctl-recover-r2-e3-2")


def test_numbering_continues_past_the_launchers_joiners_after_a_server_restart() -> None:
    c = ElasticController(config())
    # An earlier server instance's joiner, long dead; the restarted server shows no operation.
    old = launch(2, "ctl-9-grow-to-3", alive=False)
    action = only(step(c, 100, status(2, instance="inst-new"), load=HOT, launches=[old]),
                  ScaleTo)
    assert action.operation_id == "ctl-10-grow-to-3"


def test_max_relaunches_zero_removes_at_the_first_failure() -> None:
    c = ElasticController(config(max_relaunches=0))
    assert only(step(c, 100, status(4, failed=[3])), ScaleTo).target == 3


def test_a_failed_joiner_below_an_active_one_is_relaunched_in_place() -> None:
    """Rank 2 failed while rank 3 serves above it: its replacement rejoins in place, so the
    controller relaunches it in recover mode like any other failed joiner; only past
    --max-relaunches does it remove ranks [2, 4) (rank 3 drains) and regrow to 4."""
    c = ElasticController(config(max_relaunches=1))
    e = Event()
    c.observe_event(e.failed(2))
    relaunch = only(step(c, 100, status(4, failed=[2])), Relaunch)
    assert (relaunch.spec.rank_offset, relaunch.spec.mode, relaunch.attempt) == \
        (2, JoinMode.RECOVER, 1)
    dead = launch(2, relaunch.spec.operation_id, mode=JoinMode.RECOVER, alive=False)
    removal = only(step(c, 101, status(4, failed=[2]), launches=[dead]), ScaleTo)
    assert (removal.target, removal.purpose) == (2, Purpose.REMOVE)
    assert "regrowing to 4" in removal.reason


def test_removal_needs_every_failed_rank_inside_the_tail() -> None:
    """Launch-time rank 1 failed too: no scale-down of this controller's ranks removes it."""
    c = ElasticController(config(max_relaunches=0))
    decision = step(c, 100, status(4, failed=[1, 2]))
    assert not any(isinstance(a, ScaleTo) for a in decision.actions)
    assert any("leaving them failed" in h.reason for h in decision.holds), decision.holds


def test_a_refused_removal_is_retried_after_heal_retry() -> None:
    c = ElasticController(config(max_relaunches=0, heal_retry_s=15))
    refused = op("ctl-1-remove-to-3", 4, 3, result="failed", at=100, error="422 not yet")
    s = status(4, failed=[3], recent=[refused])
    decision = step(c, 110, s)
    assert decision.actions == () and "retrying in 5s" in decision.holds[0].reason
    assert only(step(c, 116, s), ScaleTo).operation_id == "ctl-2-remove-to-3"


def test_a_removal_refused_without_a_record_is_asked_again_after_heal_retry() -> None:
    c = ElasticController(config(max_relaunches=0, heal_retry_s=15))
    s = status(4, failed=[3])
    first = only(step(c, 100, s), ScaleTo)
    c.observe_scale_answer(first.operation_id, accepted=False)  # e.g. 409, or no answer
    decision = step(c, 101, s)
    assert decision.actions == () and "retrying in 14s" in decision.holds[0].reason
    assert only(step(c, 115, s), ScaleTo).operation_id == "ctl-2-remove-to-3"


def test_a_failed_regrow_is_retried_after_the_cooldown() -> None:
    c = ElasticController(config(policy={"cooldown_s": 60}))
    failed = op("ctl-5-regrow-to-3", 2, 3, result="failed", at=100, error="timeout")
    s = status(2, safe=[2], recent=[failed])
    assert step(c, 130, s).actions == ()
    assert only(step(c, 161, s), ScaleTo).operation_id == "ctl-6-regrow-to-3"


def test_a_slow_rank_from_the_health_report_gets_the_same_treatment() -> None:
    c = ElasticController(config())
    action = only(step(c, 100, status(3), health_report=health(blocked=[2])), Relaunch)
    assert action.spec.rank_offset == 2 and "slow" in action.reason
    # A report from another server instance (stale across a restart) is not believed.
    other = health(blocked=[2], instance="another-server")
    decision = step(ElasticController(config()), 100, status(3), health_report=other, load=QUIET)
    assert only(decision, ScaleTo).purpose is Purpose.SHRINK


def test_a_failed_launch_time_rank_is_reported_not_relaunched() -> None:
    c = ElasticController(config(launch_size=2))
    decision = step(c, 100, status(3, failed=[1]), load=HOT)
    assert decision.actions == ()
    assert "launch-time" in decision.holds[0].reason


def stalled(s: StatusResponse, seconds: float,
            positions: Sequence[tuple[int, str, int, float]],
            relaunch: Sequence[int] = ()) -> StatusResponse:
    """``s`` stalled for ``seconds``, each scheduler at (rank, step, passes, report age);
    ``relaunch``: the report's ``ranks_to_relaunch``."""
    ranks = [RankPosition(rank=r, step=step, in_step_s=seconds, passes=passes,
                          report_age_s=age) for r, step, passes, age in positions]
    stall = StallStatus(since=1000.0 - seconds, stalled_s=seconds, waiting_requests=2,
                        phase=s.phase, ranks=ranks, ranks_to_relaunch=list(relaunch),
                        message="ranks in step 'gather'")
    return s.model_copy(update={"stalled": stall})


# Rank 0's collective never completes a pass behind; ranks 1 and 2 wait in the next one.
RANK_0_BEHIND = [(0, "gather", 40, 0.5), (1, "gather", 41, 0.5), (2, "gather", 41, 0.5)]


def test_a_stall_holds_resizes_then_its_stuck_own_rank_is_relaunched() -> None:
    c = ElasticController(config(heal_stall_after_s=120))
    early = step(c, 100, stalled(status(3), 70, RANK_0_BEHIND), load=HOT)
    assert early.actions == ()
    assert "serving stalled for 70 s" in early.holds[0].reason
    assert "--heal-stall-after 120" in early.holds[0].reason
    # Past the threshold: rank 2 (this controller's) is ended and relaunched; its end frees
    # rank 0's collective.
    action = only(step(c, 150, stalled(status(3), 130, RANK_0_BEHIND), load=HOT), Relaunch)
    assert (action.spec.rank_offset, action.spec.mode, action.spec.operation_id) == \
        (2, JoinMode.RECOVER, "ctl-recover-r2-e0-1")
    assert "waits with rank(s) [0]" in action.reason
    assert action.stuck  # its server never finishes a graceful stop: killed at once
    # The stall goes on while the survivors notice the end: no second replacement; nor once
    # the failure shows, under its event's id.
    replacement = launch(2, "ctl-recover-r2-e0-1", mode=JoinMode.RECOVER, started=150)
    gone = [(0, "gather", 40, 0.5), (1, "gather", 41, 0.5), (2, "gather", 41, 20.0)]
    later = step(c, 170, stalled(status(3), 150, gone), launches=[replacement])
    assert later.actions == () and "waiting for the replacement" in later.holds[0].reason
    # Once rank 2 shows failed, the survivors' stall is that failure's: nothing more is ended
    # and no launch-time rank is named.
    e = Event()
    c.observe_event(e.failed(2))
    waiting = [(0, "gather", 41, 0.5), (1, "gather", 41, 0.5)]
    failed = step(c, 190, stalled(status(3, failed=[2]), 170, waiting), launches=[replacement])
    assert failed.actions == ()
    assert [h.reason for h in failed.holds] == [
        "waiting for the replacement of rank(s) 2 (ctl-recover-r2-e0-1) to rejoin"]


def test_a_stopped_own_rank_is_relaunched_and_stuck_launch_time_ranks_only_reported() -> None:
    c = ElasticController(config(heal_stall_after_s=60))
    stopped = [(0, "gather", 9, 0.5), (1, "gather", 9, 0.5), (2, "forward", 9, 45.0)]
    action = only(step(c, 100, stalled(status(3), 61, stopped)), Relaunch)
    assert action.spec.rank_offset == 2 and "stopped reporting 45 s ago" in action.reason
    # Only launch-time ranks: nothing to end; the hold repeats what the server's report names
    # (rank 1 on a node of its own, whose end frees rank 0, a pass behind) and says what works.
    c = ElasticController(config(heal_stall_after_s=60))
    behind_0 = [(0, "gather", 8, 0.5), (1, "gather", 9, 0.5)]
    stuck = step(c, 100, stalled(status(2), 61, behind_0, relaunch=[1]))
    assert stuck.actions == ()
    assert [h.reason.split(" named")[0] for h in stuck.holds] == ["rank(s) 1"]
    assert "relaunch their node with --ep-join-mode recover" in stuck.holds[0].reason
    # Both in rank 0's server (the report names both): a restart.
    shared = step(ElasticController(config(heal_stall_after_s=60)), 100,
                  stalled(status(2), 61, behind_0, relaunch=[0, 1]))
    assert shared.actions == () and len(shared.holds) == 1
    assert "rank(s) 0" in shared.holds[0].reason and "restart the deployment" in \
        shared.holds[0].reason
    behind_1 = step(ElasticController(config(heal_stall_after_s=60)), 100,
                    stalled(status(2), 61, [(0, "gather", 9, 0.5), (1, "forward", 8, 0.5)]))
    assert behind_1.actions == ()
    assert "relaunch their node with --ep-join-mode recover" in behind_1.holds[0].reason


def test_a_stall_that_outlasts_mooncakes_count_out_of_a_failed_rank_is_healed() -> None:
    """Rank 3 failed; ranks 0 and 1 never complete their collective and rank 2 waits for them
    in the next. Within the time Mooncake takes to count rank 3 out, that is the failure's own
    handling; past it, the live ranks wait on each other, and ending rank 2 frees them."""
    waiting = [(0, "gather", 40, 0.5), (1, "gather", 40, 0.5), (2, "gather", 41, 0.5)]

    def counted(seconds: float, count_out_s: float) -> StatusResponse:
        s = stalled(status(4, failed=[3]), seconds, waiting)
        assert s.stalled is not None
        return s.model_copy(update={"stalled": s.stalled.model_copy(
            update={"count_out_s": count_out_s})})

    within = step(ElasticController(config(heal_stall_after_s=60)), 100, counted(130, 200))
    assert [a.spec.rank_offset for a in within.actions] == [3]  # the failed one only
    c = ElasticController(config(heal_stall_after_s=60))
    past = step(c, 100, counted(130, 67))
    relaunched = {a.spec.rank_offset: a for a in past.actions if isinstance(a, Relaunch)}
    assert sorted(relaunched) == [2, 3], past
    assert relaunched[2].stuck and "waits with rank(s) [0, 1]" in relaunched[2].reason
    assert not relaunched[3].stuck


@pytest.mark.parametrize("kw", [{"heal_stall_after_s": 0}, {"heal": False}])
def test_with_stall_healing_off_a_stall_is_only_reported(kw: dict[str, Any]) -> None:
    decision = step(ElasticController(config(**kw)), 100,
                    stalled(status(3), 500, RANK_0_BEHIND), load=HOT)
    assert decision.actions == ()
    assert "healing stalls is off" in decision.holds[0].reason


def test_a_stall_without_positions_names_what_is_missing() -> None:
    decision = step(ElasticController(config(heal_stall_after_s=60)), 100,
                    stalled(status(3), 500, []), load=HOT)
    assert decision.actions == () and "--dist-init-addr" in decision.holds[0].reason


# --- resuming from the server's state ---------------------------------------------------


def test_a_restarted_controller_resumes_counts_from_the_replayed_event_buffer() -> None:
    e = Event()
    buffer = [e.failed(2), e.required(2), e.recovered(2), e.failed(2), e.recovered(2),
              e.failed(2)]
    fresh = ElasticController(config(max_relaunches=2))
    for event in buffer + buffer:  # replays of ids it has seen are ignored
        fresh.observe_event(event)
    assert only(step(fresh, 100, status(3, failed=[2])), ScaleTo).purpose is Purpose.REMOVE


def test_a_restarted_controller_continues_a_removal_with_the_regrow() -> None:
    fresh = ElasticController(config())
    removal = op("ctl-7-remove-to-2", 3, 2, result="succeeded", at=50)
    action = only(step(fresh, 100, status(2, safe=[2], recent=[removal])), ScaleTo)
    assert action.operation_id == "ctl-8-regrow-to-3"


def test_a_restarted_controller_adopts_a_running_replacement() -> None:
    fresh = ElasticController(config())
    running = launch(2, "ctl-recover-r2-e0-1", mode=JoinMode.RECOVER, started=90)
    decision = step(fresh, 100, status(3, failed=[2]), launches=[running])
    assert decision.actions == () and "waiting for the replacement" in decision.holds[0].reason


def test_a_new_server_instance_resets_what_the_old_one_said() -> None:
    c = ElasticController(config(max_relaunches=1))
    e = Event()
    for event in (e.failed(2), e.recovered(2), e.failed(2)):
        c.observe_event(event)
    assert only(step(c, 100, status(3, failed=[2])), ScaleTo).purpose is Purpose.REMOVE
    # The server restarted: its events start again at 1 and its failures are its own.
    c.observe_scale_answer("ctl-1-remove-to-2", accepted=False)
    restarted = Event("inst-b")
    c.observe_event(restarted.failed(2))
    action = only(step(c, 200, status(3, failed=[2], instance="inst-b")), Relaunch)
    assert action.attempt == 1


def test_a_missed_notice_keeps_this_instances_counts_and_drops_anothers() -> None:
    c = ElasticController(config(max_relaunches=2))
    e = Event()
    for event in (e.failed(2), e.recovered(2), e.failed(2)):
        c.observe_event(event)
    c.observe_missed(INST)  # some events were lost: what we counted still happened
    assert only(step(c, 100, status(3, failed=[2])), Relaunch).attempt == 2
    c.observe_missed("inst-b")
    assert only(step(c, 100, status(3, failed=[2], instance="inst-b")), Relaunch).attempt == 1


def test_no_status_no_decision() -> None:
    decision = ElasticController(config()).decide(0)
    assert decision.actions == () and "no status" in decision.holds[0].reason


# --- ids and config ---------------------------------------------------------------------


def test_operation_ids_round_trip_and_foreign_ids_are_ignored() -> None:
    text = operation_id("ctl", 12, Purpose.REGROW, 4)
    assert text == "ctl-12-regrow-to-4"
    parsed = parse_operation_id("ctl", text)
    assert parsed is not None and (parsed.number, parsed.purpose, parsed.target) == (
        12, Purpose.REGROW, 4)
    assert parse_operation_id("ctl", "other-12-grow-to-4") is None
    assert parse_operation_id("ctl", "ctl-12-grow-to-4x") is None
    assert recover_operation_id("ctl", 3, 17, 2) == "ctl-recover-r3-e17-2"


@pytest.mark.parametrize("kwargs", [
    {"launch_size": 3, "policy": {"step": 2, "min_size": 2}},
    {"launch_size": 9},
    {"max_relaunches": -1},
    {"op_prefix": "bad prefix"},
    {"recover_timeout_s": -1},
    {"heal_stall_after_s": -1},
])
def test_bad_controller_config_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        config(**kwargs)


def test_a_quiet_cluster_never_shrinks_below_its_launch_ranks() -> None:
    """Ranks below --launch-size are `sglang serve`'s, not the controller's: the shrink stops
    there, and at that size the controller holds and says why."""
    c = ElasticController(config(launch_size=4))
    decision = step(c, 100, status(5), load=QUIET)
    shrink = only(decision, ScaleTo)
    assert shrink.purpose is Purpose.SHRINK and shrink.target == 4, decision
    decision = step(ElasticController(config(launch_size=4)), 100, status(4), load=QUIET)
    assert decision.actions == ()
    assert any("below --launch-size 4 belong to `sglang serve`" in h.reason for h in decision.holds)

import threading

import pytest

from sglang_elastic_ep.core.api_models import (
    OperationKind,
    OperationResult,
    RankState,
    RejectionReason,
    ScaleRequest,
)
from sglang_elastic_ep.core.events import EventLog
from sglang_elastic_ep.core.membership import Membership
from sglang_elastic_ep.core.operations import OperationRegistry, UnknownOperation
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.validation import ScaleTopology, validate_scale

TOPO = ScaleTopology(max_ep_size=8)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def events(clock: Clock) -> EventLog:
    return EventLog("inst", clock=clock)


@pytest.fixture
def registry(clock: Clock, events: EventLog) -> OperationRegistry:
    ids = iter(f"gen-{i}" for i in range(100))
    return OperationRegistry(
        "inst", history_size=3, events=events, clock=clock, new_operation_id=lambda: next(ids)
    )


def admit(
    registry: OperationRegistry,
    target: int,
    current: int,
    *,
    op: str | None = None,
    instance: str | None = None,
    failed: tuple[int, ...] = (),
):
    req = ScaleRequest(new_ep_size=target, operation_id=op, expected_instance_id=instance)
    verdict = validate_scale(target, current_size=current, topology=TOPO, failed_ranks=failed)
    return registry.admit(req, verdict, current_size=current)


def test_accepting_starts_an_operation_and_emits_scale_requested(
    registry: OperationRegistry, events: EventLog
) -> None:
    a = admit(registry, 3, 2, op="op-1")
    assert a.status == 200 and a.accepted and a.started and not a.replayed
    assert a.phase is Phase.WAITING_FOR_COHORT and a.operation_id == "op-1"
    assert a.message == "Scaling initiated from 2 to 3, polling for new ranks"
    current = registry.current
    assert current is not None and current.kind is OperationKind.SCALE_UP
    assert current.ranks == (2,)
    [ev] = events.since(0).events
    assert ev.type == "scale_requested" and ev.ranks == [2] and ev.operation_id == "op-1"
    resp = a.to_response("inst")
    assert resp.accepted and resp.instance_id == "inst" and resp.new_ep_size == 3


def test_missing_operation_id_is_generated(registry: OperationRegistry) -> None:
    assert admit(registry, 3, 2).operation_id == "gen-0"


def test_retry_with_same_id_and_target_replays_without_new_operation(
    registry: OperationRegistry, events: EventLog
) -> None:
    first = admit(registry, 3, 2, op="op-1")
    again = admit(registry, 3, 2, op="op-1")
    assert again.status == 200 and again.accepted and again.replayed and not again.started
    assert again.message == first.message and again.operation_id == "op-1"
    assert len(events.since(0).events) == 1


def test_replay_after_completion_still_answers_the_same(
    registry: OperationRegistry, clock: Clock
) -> None:
    admit(registry, 3, 2, op="op-1")
    clock.t += 5
    registry.finish("op-1")
    # The cluster is now at 3: a retry must not turn into a no-op or a new operation.
    again = admit(registry, 3, 3, op="op-1")
    assert again.replayed and again.phase is Phase.SERVING_EXPANDED
    assert again.old_ep_size == 2 and again.new_ep_size == 3


def test_replay_of_failed_operation_tells_to_use_new_id(registry: OperationRegistry) -> None:
    admit(registry, 3, 2, op="op-1")
    registry.finish("op-1", error="joiner never connected")
    again = admit(registry, 3, 2, op="op-1")
    assert again.replayed and again.phase is Phase.FAILED
    assert "joiner never connected" in again.message and "new operation_id" in again.message


def test_same_id_different_target_conflicts(registry: OperationRegistry) -> None:
    admit(registry, 3, 2, op="op-1")
    c = admit(registry, 4, 2, op="op-1")
    assert c.status == 409 and not c.accepted and c.reason is RejectionReason.OPERATION_ID_REUSED
    assert "use a new operation_id" in c.message


def test_second_operation_while_one_runs_conflicts(registry: OperationRegistry) -> None:
    admit(registry, 3, 2, op="op-1")
    registry.record_phase("op-1", Phase.PENDING)
    c = admit(registry, 4, 2, op="op-2")
    assert c.status == 409 and c.reason is RejectionReason.OPERATION_IN_PROGRESS
    assert "op-1 (2 -> 3) is in phase pending" in c.message
    assert c.phase is Phase.PENDING


def test_instance_mismatch_is_412_before_anything_else(registry: OperationRegistry) -> None:
    admit(registry, 3, 2, op="op-1")
    p = admit(registry, 3, 2, op="op-1", instance="other")
    assert p.status == 412 and p.reason is RejectionReason.INSTANCE_MISMATCH
    assert "re-read GET /elastic_ep/status" in p.message
    assert admit(registry, 3, 2, op="op-1", instance="inst").replayed


def test_validation_refusal_is_passed_through_and_not_recorded(
    registry: OperationRegistry,
) -> None:
    r = admit(registry, 9, 2, op="op-1")
    assert r.status == 400 and r.reason is RejectionReason.EXCEEDS_MAX_EP_SIZE
    assert registry.current is None
    # Fixing the request with the same id works: refusals do not burn the id.
    assert admit(registry, 3, 2, op="op-1").started


def test_failed_rank_refusal_is_409(registry: OperationRegistry) -> None:
    r = admit(registry, 5, 4, op="x", failed=(1,))
    assert r.status == 409 and "recover or remove rank(s) [1]" in r.message


def test_noop_without_id_is_not_recorded_with_id_is(registry: OperationRegistry) -> None:
    n = admit(registry, 2, 2)
    assert n.status == 200 and n.accepted and not n.started and n.operation_id is None
    assert registry.history() == []
    n2 = admit(registry, 2, 2, op="noop-1")
    assert n2.accepted and not n2.started
    [op] = registry.history()
    assert op.kind is OperationKind.NOOP and op.result is OperationResult.SUCCEEDED
    assert admit(registry, 3, 2, op="noop-1").status == 409  # the id kept its meaning
    assert registry.current_phase() is Phase.IDLE  # no-ops do not change the phase


def test_phases_and_finish_record_timestamps_duration_and_events(
    registry: OperationRegistry, clock: Clock, events: EventLog
) -> None:
    admit(registry, 2, 4, op="down")
    clock.t += 1
    registry.record_phase("down", Phase.MOVING_EXPERTS)
    registry.record_phase("down", Phase.MOVING_EXPERTS)  # repeat ignored
    clock.t += 2
    registry.record_phase("down", Phase.RELEASING)
    clock.t += 1
    op = registry.finish("down")
    assert [(s.phase, s.at) for s in op.phase_stamps] == [
        (Phase.DRAINING, 1000.0),
        (Phase.MOVING_EXPERTS, 1001.0),
        (Phase.RELEASING, 1003.0),
        (Phase.SERVING_CONTRACTED, 1004.0),
    ]
    assert op.duration_s == 4.0 and op.result is OperationResult.SUCCEEDED
    types = [e.type for e in events.since(0).events]
    assert types == ["scale_requested", "scale_committed", "safe_to_terminate"]
    committed, safe = events.since(1).events
    assert committed.duration_s == 4.0 and safe.ranks == [2, 3]
    assert registry.current is None and registry.current_phase() is Phase.SERVING_CONTRACTED


def test_failure_records_error_phase_and_event(
    registry: OperationRegistry, events: EventLog
) -> None:
    admit(registry, 3, 2, op="up")
    registry.record_phase("up", Phase.PENDING)
    op = registry.finish("up", error="timed out")
    assert op.result is OperationResult.FAILED and op.phase is Phase.FAILED
    assert registry.last_error == "timed out"
    failed = events.since(1).events[0]
    assert failed.type == "scale_failed" and failed.failed_in is Phase.PENDING
    assert failed.error == "timed out"


def test_progress_for_unknown_operation_raises(registry: OperationRegistry) -> None:
    with pytest.raises(UnknownOperation):
        registry.record_phase("nope", Phase.PENDING)
    admit(registry, 3, 2, op="a")
    with pytest.raises(UnknownOperation):
        registry.finish("b")


def test_history_is_bounded_newest_first_and_bounds_idempotency(
    registry: OperationRegistry,
) -> None:
    size = 2
    for i in range(4):
        admit(registry, size + 1, size, op=f"op-{i}")
        registry.finish(f"op-{i}")
        size += 1
    assert [op.operation_id for op in registry.history()] == ["op-3", "op-2", "op-1"]
    assert registry.get("op-0") is None
    assert registry.get("op-3") is not None


def test_status_combines_membership_and_operations(
    registry: OperationRegistry, clock: Clock
) -> None:
    admit(registry, 3, 2, op="done")
    clock.t += 3
    registry.finish("done")
    admit(registry, 4, 3, op="now")
    membership = Membership(max_size=5, effective_size=3, pending_size=4)
    status = registry.status(membership)
    assert status.instance_id == "inst" and status.phase is Phase.WAITING_FOR_COHORT
    assert [r.state for r in status.ranks] == [
        RankState.ACTIVE,
        RankState.ACTIVE,
        RankState.ACTIVE,
        RankState.PENDING,
        RankState.INACTIVE,
    ]
    assert status.current_operation is not None
    assert status.current_operation.operation_id == "now"
    assert status.recent_operations[0].operation_id == "done"
    assert status.recent_operations[0].duration_s == 3.0


def test_concurrent_admissions_start_exactly_one_operation(
    registry: OperationRegistry,
) -> None:
    results = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        results.append(admit(registry, 3, 2, op=f"c-{i}"))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.started for r in results) == 1
    assert sorted(r.status for r in results) == [200] + [409] * 7

"""The HTTP contract over InProcessControlPlane with a fake engine (no SGLang)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from eep_api_helpers import (
    INSTANCE,
    UP_PHASES,
    Clock,
    FakeEngine,
    live_server,
    make_app,
    make_plane,
    sse_messages,
)
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from sglang_elastic_ep.api.auth import decide_admin_optional, sglang_admin_auth
from sglang_elastic_ep.api.control_plane import ControlPlane, InProcessControlPlane
from sglang_elastic_ep.api.routes import build_router, mount
from sglang_elastic_ep.core.api_models import (
    EVENT_ADAPTER,
    ErrorResponse,
    ScaleResponse,
    StatusResponse,
)
from sglang_elastic_ep.core.phases import Phase


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def plane(engine: FakeEngine) -> InProcessControlPlane:
    return make_plane(engine=engine)


@pytest.fixture
def client(plane: InProcessControlPlane) -> TestClient:
    return TestClient(make_app(plane))


def post(client: TestClient, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(
        "/scale_elastic_ep",
        content=content,
        headers={"Content-Type": "application/json", **kwargs.pop("headers", {})},
        **kwargs,
    )


def snapshot(client: TestClient, plane: InProcessControlPlane, engine: FakeEngine) -> tuple:
    status = client.get("/elastic_ep/status")
    assert status.status_code == 200
    return status.json(), plane.events.last_event_id, len(engine.ops)


def sse_events(text: str) -> list[tuple[str, dict[str, Any], str | None]]:
    return [(m.event, json.loads(m.data), m.id or None) for m in sse_messages(text)]


def test_in_process_control_plane_satisfies_the_protocol(plane: InProcessControlPlane) -> None:
    assert isinstance(plane, ControlPlane)


# --- the bad input table ---------------------------------------------------------------------


def _setup_running(client: TestClient, plane: InProcessControlPlane) -> None:
    assert post(client, {"new_ep_size": 4, "operation_id": "running-op"}).status_code == 200
    plane.record_phase("running-op", Phase.PENDING)


def _setup_failed_rank(client: TestClient, plane: InProcessControlPlane) -> None:
    plane.report_rank_failed([1], "heartbeat lost")


def _setup_four_ranks_failed_rank_1(client: TestClient, plane: InProcessControlPlane) -> None:
    plane.set_membership(plane.membership.__class__(max_size=8, effective_size=4))
    plane.report_rank_failed([1], "heartbeat lost")


OVERSIZED = json.dumps({"new_ep_size": 4, "operation_id": "big-1", "pad": "x" * 70_000}).encode()

# (id, body, setup, status, reason or None, text that must appear in the answer)
BAD_INPUT = [
    ("zero", {"new_ep_size": 0}, None, 400, None, "at least 1"),
    ("negative", {"new_ep_size": -3}, None, 400, None, "at least 1"),
    ("above-max", {"new_ep_size": 9}, None, 400, "exceeds_max_ep_size", "--max-ep-size (8)"),
    ("huge", {"new_ep_size": 10**30}, None, 400, "exceeds_max_ep_size", "--max-ep-size"),
    ("float", {"new_ep_size": 4.0}, None, 400, None, "JSON integer"),
    ("fraction", {"new_ep_size": 2.5}, None, 400, None, "JSON integer"),
    ("string", {"new_ep_size": "4"}, None, 400, None, "JSON integer"),
    ("bool", {"new_ep_size": True}, None, 400, None, "JSON integer"),
    ("null", {"new_ep_size": None}, None, 400, None, "send new_ep_size"),
    ("missing", {}, None, 400, None, "send new_ep_size"),
    ("only-operation-id", {"operation_id": "op-1"}, None, 400, None, "send new_ep_size"),
    ("tp-and-ep-differ", {"new_ep_size": 4, "new_tp_size": 6}, None, 400, None, "disagree"),
    ("unknown-field", {"new_ep_size": 4, "foo": 1}, None, 400, None, "unknown field 'foo'"),
    ("bad-operation-id", {"new_ep_size": 4, "operation_id": "../x"}, None, 400, None,
     "operation_id must be"),
    ("long-operation-id", {"new_ep_size": 4, "operation_id": "a" * 200}, None, 400, None,
     "operation_id"),
    ("junk-json", b"{new_ep_size: 4", None, 400, None, "not valid JSON"),
    ("empty-body", b"", None, 400, None, "not valid JSON"),
    ("not-utf8", b'{"new_ep_size": "\xff"}', None, 400, None, "not valid JSON"),
    ("too-deep", b"[" * 50_000, None, 400, None, "nested too deeply"),
    ("array", [4], None, 400, None, "JSON object"),
    ("number", 4, None, 400, None, "JSON object"),
    ("duplicate-key", b'{"new_ep_size": 4, "new_ep_size": 6}', None, 400, None, "twice"),
    ("over-64kib", OVERSIZED, None, 413, None, "65536-byte limit"),
    ("while-another-runs", {"new_ep_size": 6, "operation_id": "second"}, _setup_running, 409,
     "operation_in_progress", "running-op"),
    ("down-while-another-runs", {"new_ep_size": 1}, _setup_running, 409,
     "operation_in_progress", "wait until"),
    ("up-while-rank-failed", {"new_ep_size": 4}, _setup_failed_rank, 409,
     "failed_ranks_present", "recover or remove rank(s) [1]"),
    ("down-not-removing-failed", {"new_ep_size": 3}, _setup_four_ranks_failed_rank_1, 409,
     "must_remove_failed_ranks", "remove exactly them"),
    ("instance-mismatch", {"new_ep_size": 4, "expected_instance_id": "other"}, None, 412,
     "instance_mismatch", "re-read GET /elastic_ep/status"),
]


@pytest.mark.parametrize(
    ("body", "setup", "status", "reason", "text"),
    [pytest.param(*row[1:], id=row[0]) for row in BAD_INPUT],
)
def test_bad_input_is_refused_and_changes_nothing(
    client: TestClient,
    plane: InProcessControlPlane,
    engine: FakeEngine,
    body: Any,
    setup: Any,
    status: int,
    reason: str | None,
    text: str,
) -> None:
    if setup is not None:
        setup(client, plane)
    before = snapshot(client, plane, engine)

    response = post(client, body)

    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["instance_id"] == INSTANCE
    assert "operation_id" in answer
    if isinstance(body, dict) and body.get("operation_id") in ("op-1", "second"):
        assert answer["operation_id"] == body["operation_id"]
    if reason is None:
        parsed = ErrorResponse.model_validate(answer)
        assert text in parsed.error
    else:
        parsed_scale = ScaleResponse.model_validate(answer)
        assert parsed_scale.accepted is False
        assert parsed_scale.reason is not None and parsed_scale.reason.value == reason
        assert text in parsed_scale.message
    assert snapshot(client, plane, engine) == before


def test_oversized_chunked_body_without_content_length_is_413(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    before = snapshot(client, plane, engine)

    def chunks():
        for _ in range(10):
            yield b"x" * 10_000

    response = client.post("/scale_elastic_ep", content=chunks())
    assert "content-length" not in response.request.headers
    assert response.status_code == 413
    assert snapshot(client, plane, engine) == before


def test_incomplete_attention_replica_is_400_with_neighbours() -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine, attn_replica_size=2, initial=2)
    client = TestClient(make_app(plane))
    before = snapshot(client, plane, engine)
    response = post(client, {"new_ep_size": 3})
    assert response.status_code == 400
    assert response.json()["reason"] == "incomplete_attention_replica"
    assert "(e.g. 4)" in response.json()["message"]  # 2 is the current size
    assert snapshot(client, plane, engine) == before


def test_body_at_the_limit_is_read() -> None:
    plane = make_plane(engine=FakeEngine())
    client = TestClient(make_app(plane, max_body_bytes=64))
    body = b'{"new_ep_size": 4}' + b" " * (64 - 18)
    assert len(body) == 64
    assert post(client, body).status_code == 200
    assert post(client, body + b" ").status_code == 413


# --- accepted requests --------------------------------------------------------------------


def test_scale_up_is_accepted_and_handed_to_the_engine(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    response = post(client, {"new_ep_size": 4, "operation_id": "op-up"})
    assert response.status_code == 200
    body = ScaleResponse.model_validate(response.json())
    assert body.accepted and not body.replayed
    assert (body.old_ep_size, body.new_ep_size) == (2, 4)
    assert body.operation_id == "op-up" and body.instance_id == INSTANCE
    assert body.phase is Phase.WAITING_FOR_COHORT
    assert [(op.operation_id, op.ranks) for op in engine.ops] == [("op-up", (2, 3))]

    status = StatusResponse.model_validate(client.get("/elastic_ep/status").json())
    assert status.pending_ep_size == 4 and status.effective_ep_size == 2
    assert [r.state.value for r in status.ranks[:5]] == [
        "active", "active", "pending", "pending", "inactive"
    ]
    assert status.current_operation is not None
    assert status.current_operation.operation_id == "op-up"
    (event,) = plane.events.since(0).events
    assert event.type == "scale_requested"


def test_server_generates_an_operation_id_when_none_is_given(
    client: TestClient, engine: FakeEngine
) -> None:
    response = post(client, {"new_tp_size": 3})  # the RFC alias alone
    assert response.status_code == 200
    assert response.json()["operation_id"] == "gen-0"
    assert response.json()["new_ep_size"] == 3
    assert engine.ops[0].operation_id == "gen-0"


def test_equal_ep_and_tp_size_are_accepted(client: TestClient, engine: FakeEngine) -> None:
    assert post(client, {"new_ep_size": 4, "new_tp_size": 4}).status_code == 200
    assert engine.ops[0].new_ep_size == 4


def test_target_equal_to_current_is_a_noop(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    response = post(client, {"new_ep_size": 2})
    assert response.status_code == 200
    assert response.json()["accepted"] is True
    assert "Already at 2" in response.json()["message"]
    # every answer names an operation id (generated here), yet nothing was recorded
    assert isinstance(response.json()["operation_id"], str) and response.json()["operation_id"]
    assert engine.ops == [] and plane.events.last_event_id == 0
    assert plane.status().recent_operations == []


def test_refusal_without_an_id_still_carries_a_generated_one(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    first = post(client, {"new_ep_size": 0})
    second = post(client, {"new_ep_size": 0})
    assert first.status_code == second.status_code == 400
    ids = {first.json()["operation_id"], second.json()["operation_id"]}
    assert len(ids) == 2 and all(isinstance(i, str) and i for i in ids)
    assert engine.ops == [] and plane.status().recent_operations == []


def test_idempotent_retry_gives_the_same_answer_and_no_new_operation(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    first = post(client, {"new_ep_size": 4, "operation_id": "op-r"})
    events_after_first = plane.events.last_event_id
    again = post(client, {"new_ep_size": 4, "operation_id": "op-r"})
    assert again.status_code == 200
    assert again.json()["replayed"] is True
    assert again.json()["message"] == first.json()["message"]
    assert again.json()["operation_id"] == "op-r"
    assert len(engine.ops) == 1
    assert plane.events.last_event_id == events_after_first

    # Still the same answer after the operation committed; the alias names the same target.
    for phase in UP_PHASES:
        plane.record_phase("op-r", phase)
    plane.finish_operation("op-r")
    late = post(client, {"new_tp_size": 4, "operation_id": "op-r"})
    assert late.status_code == 200 and late.json()["replayed"] is True
    assert late.json()["phase"] == "serving_expanded"
    assert len(engine.ops) == 1


def test_same_operation_id_with_another_target_is_409(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    post(client, {"new_ep_size": 4, "operation_id": "op-x"})
    before = snapshot(client, plane, engine)
    response = post(client, {"new_ep_size": 6, "operation_id": "op-x"})
    assert response.status_code == 409
    assert response.json()["reason"] == "operation_id_reused"
    assert "use a new operation_id" in response.json()["message"]
    assert response.json()["operation_id"] == "op-x"
    assert snapshot(client, plane, engine) == before


def test_matching_expected_instance_id_is_accepted(client: TestClient) -> None:
    response = post(client, {"new_ep_size": 4, "expected_instance_id": INSTANCE})
    assert response.status_code == 200


def test_scale_up_lifecycle_reaches_serving_expanded(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    post(client, {"new_ep_size": 4, "operation_id": "op-life"})
    for phase in UP_PHASES:
        plane.record_phase("op-life", phase)
        assert client.get("/is_scaling_elastic_ep").json()["scale_phase"] == phase.value
    plane.report_rank_joined([2, 3], "op-life")
    plane.finish_operation("op-life")

    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 4 and status["pending_ep_size"] is None
    assert status["phase"] == "serving_expanded"
    assert [r["state"] for r in status["ranks"][:4]] == ["active"] * 4
    assert status["recent_operations"][0]["result"] == "succeeded"
    types = [e.type for e in plane.events.since(0).events]
    assert types == ["scale_requested", "rank_joined", "scale_committed"]
    is_scaling = client.post("/is_scaling_elastic_ep").json()
    assert is_scaling["is_scaling_elastic_ep"] is False
    assert is_scaling["effective_ep_size"] == 4


def test_scale_down_lists_safe_to_terminate_ranks() -> None:
    plane = make_plane(engine=FakeEngine(), initial=4)
    client = TestClient(make_app(plane))
    post(client, {"new_ep_size": 2, "operation_id": "op-down"})
    status = client.get("/elastic_ep/status").json()
    assert [r["state"] for r in status["ranks"][:4]] == ["active", "active", "leaving", "leaving"]
    plane.finish_operation("op-down")

    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2
    assert status["safe_to_terminate_ranks"] == [2, 3]
    assert status["phase"] == "serving_contracted"
    last = plane.events.since(0).events[-1]
    assert last.type == "safe_to_terminate" and last.ranks == [2, 3]

    # Scaling up again reuses the slots: they are no longer safe to delete.
    post(client, {"new_ep_size": 3, "operation_id": "op-up-again"})
    assert client.get("/elastic_ep/status").json()["safe_to_terminate_ranks"] == [3]


def test_failed_scale_up_rolls_back_and_releases_the_joiners(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    post(client, {"new_ep_size": 4, "operation_id": "op-fail"})
    plane.record_phase("op-fail", Phase.PENDING)
    plane.finish_operation("op-fail", error="joiner 3 never connected")
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2 and status["pending_ep_size"] is None
    assert status["phase"] == "failed"
    assert status["last_error"] == "joiner 3 never connected"
    assert status["safe_to_terminate_ranks"] == [2, 3]
    failed, released = plane.events.since(1).events
    assert failed.type == "scale_failed" and failed.failed_in is Phase.PENDING
    assert released.type == "safe_to_terminate" and released.ranks == [2, 3]
    # A retry of the failed id is answered as a replay that says it failed.
    replay = post(client, {"new_ep_size": 4, "operation_id": "op-fail"}).json()
    assert replay["replayed"] and "has since failed" in replay["message"]


def test_engine_that_cannot_start_gives_503_and_records_the_failure(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    engine.fail = ConnectionError("scheduler socket closed")
    response = post(client, {"new_ep_size": 4, "operation_id": "op-503"})
    assert response.status_code == 503
    body = response.json()
    assert body["accepted"] is False and body["operation_id"] == "op-503"
    assert "scheduler socket closed" in body["message"]
    assert "new operation_id" in body["message"]
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2 and status["current_operation"] is None
    assert status["recent_operations"][0]["result"] == "failed"
    engine.fail = None
    assert post(client, {"new_ep_size": 4, "operation_id": "op-503b"}).status_code == 200


def test_engine_refusal_gives_422_with_its_reason_and_changes_nothing(
    client: TestClient, plane: InProcessControlPlane, engine: FakeEngine
) -> None:
    from sglang_elastic_ep.api.control_plane import EngineRefusal

    engine.fail = EngineRefusal("logical experts [3] have no replica on ranks 0..0")
    response = post(client, {"new_ep_size": 1, "operation_id": "shrink-1"})
    assert response.status_code == 422
    body = response.json()
    assert body["accepted"] is False and "no replica on ranks 0..0" in body["message"]
    assert "refused" in body["message"]
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2 and status["current_operation"] is None
    assert status["safe_to_terminate_ranks"] == [] and status["ranks"][1]["state"] == "active"


def test_removing_the_failed_tail_rank_is_allowed() -> None:
    plane = make_plane(engine=FakeEngine(), initial=4)
    client = TestClient(make_app(plane))
    plane.report_rank_failed([3], "process exited")
    assert client.get("/elastic_ep/status").json()["ranks"][3]["state"] == "failed"
    response = post(client, {"new_ep_size": 3, "operation_id": "drop-3"})
    assert response.status_code == 200, response.text
    plane.finish_operation("drop-3")
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 3
    assert status["safe_to_terminate_ranks"] == [3]
    assert status["phase"] == "serving_contracted"  # no longer degraded
    assert post(client, {"new_ep_size": 4}).status_code == 200  # healthy again: up is fine


def test_recovery_phase_shows_in_status_until_the_next_operation(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    plane.report_rank_failed([1], "heartbeat lost")
    assert client.get("/elastic_ep/status").json()["phase"] == "serving_degraded"
    plane.report_recovery_phase(Phase.REJOINING)
    assert client.get("/elastic_ep/status").json()["phase"] == "rejoining"
    plane.report_rank_recovered([1])
    status = client.get("/elastic_ep/status").json()
    assert status["phase"] == "serving_recovered"
    assert status["ranks"][1]["state"] == "active"
    assert [e.type for e in plane.events.since(0).events] == ["rank_failed", "rank_recovered"]
    with pytest.raises(ValueError):
        plane.report_recovery_phase(Phase.JOINING)
    # The next operation's phases replace it, also after the operation ended.
    post(client, {"new_ep_size": 4, "operation_id": "after-recovery"})
    assert client.get("/elastic_ep/status").json()["phase"] == "waiting_for_cohort"
    plane.finish_operation("after-recovery")
    assert client.get("/elastic_ep/status").json()["phase"] == "serving_expanded"


def test_health_reports_hard_blocked_ranks_and_emits_recovery_required(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    health = client.get("/elastic_ep/health").json()
    assert [r["rank"] for r in health["ranks"]] == [0, 1]
    decision = plane.observe_health(
        alive={0: True, 1: False},
        expert_latency={0: 0.01, 1: 0.01, 2: 0.01, 3: None},
        expert_rank={0: 0, 1: 0, 2: 1, 3: 1},
    )
    assert decision is not None and decision.ranks == (1,)
    health = client.get("/elastic_ep/health").json()
    assert health["checks"] == 1 and health["instance_id"] == INSTANCE
    assert health["ranks"][1]["hard_blocked"] is True and health["ranks"][1]["alive"] is False
    (event,) = plane.events.since(0).events
    assert event.type == "recovery_required" and event.ranks == [1]
    assert "--elastic-ep-join-mode recover" in event.suggested_action


# --- SSE ----------------------------------------------------------------------------------


def _emit_three(client: TestClient, plane: InProcessControlPlane) -> None:
    post(client, {"new_ep_size": 4, "operation_id": "sse-op"})  # event 1
    plane.report_rank_joined([2, 3], "sse-op")  # event 2
    plane.finish_operation("sse-op")  # event 3


def test_events_backlog_without_follow(client: TestClient, plane: InProcessControlPlane) -> None:
    _emit_three(client, plane)
    response = client.get("/elastic_ep/events", params={"follow": "false"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.text.startswith("retry: 2000\n")
    events = sse_events(response.text)
    assert [(t, i) for t, _, i in events] == [
        ("scale_requested", "1"), ("rank_joined", "2"), ("scale_committed", "3")
    ]
    for _, data, _ in events:
        EVENT_ADAPTER.validate_python(data)  # every data: line is a contract event


def test_events_resume_after_last_event_id(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    _emit_three(client, plane)
    response = client.get(
        "/elastic_ep/events", params={"follow": "false"}, headers={"Last-Event-ID": "1"}
    )
    assert [i for _, _, i in sse_events(response.text)] == ["2", "3"]
    # The header wins over the query parameter (EventSource keeps the URL on reconnect).
    response = client.get(
        "/elastic_ep/events",
        params={"follow": "false", "last_event_id": "0"},
        headers={"Last-Event-ID": "2"},
    )
    assert [i for _, _, i in sse_events(response.text)] == ["3"]
    response = client.get("/elastic_ep/events", params={"follow": "0", "last_event_id": "3"})
    assert sse_events(response.text) == []


def test_events_missed_notice_when_resuming_from_another_instance(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    _emit_three(client, plane)
    response = client.get(
        "/elastic_ep/events", params={"follow": "false"}, headers={"Last-Event-ID": "99"}
    )
    events = sse_events(response.text)
    assert events[0][0] == "missed"
    assert events[0][2] == "3"  # resume point moves to the newest id
    assert "re-read GET /elastic_ep/status" in events[0][1]["message"]
    assert [t for t, _, _ in events[1:]] == ["scale_requested", "rank_joined", "scale_committed"]


def test_events_missed_notice_when_the_buffer_overflowed() -> None:
    plane = make_plane(engine=FakeEngine(), event_capacity=2)
    client = TestClient(make_app(plane))
    _emit_three(client, plane)
    events = sse_events(
        client.get(
            "/elastic_ep/events", params={"follow": "false"}, headers={"Last-Event-ID": "0"}
        ).text
    )
    assert [t for t, _, _ in events] == ["missed", "rank_joined", "scale_committed"]


@pytest.mark.parametrize(
    ("params", "headers", "text"),
    [
        ({"follow": "maybe"}, {}, "follow must be true or false"),
        ({"follow": "false"}, {"Last-Event-ID": "abc"}, "Last-Event-ID must be"),
        ({"follow": "false", "last_event_id": "-1"}, {}, "Last-Event-ID must be"),
    ],
)
def test_events_bad_parameters_are_400(
    client: TestClient, params: dict[str, str], headers: dict[str, str], text: str
) -> None:
    response = client.get("/elastic_ep/events", params=params, headers=headers)
    assert response.status_code == 400
    assert text in response.json()["error"]


def test_events_follow_streams_live_events_keepalives_and_resumes() -> None:
    plane = make_plane(engine=FakeEngine())
    app = make_app(plane, keepalive_s=0.2, poll_interval_s=0.02)
    received: list[str] = []
    comments = 0
    with live_server(app) as url, httpx.Client(base_url=url, timeout=5) as http:
        with http.stream("GET", "/elastic_ep/events") as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            frame: list[str] = []
            for line in lines:
                if line.startswith(": keepalive"):
                    comments += 1
                    if comments == 1:  # the stream is live and was silent: now events come
                        plane.report_rank_failed([1], "heartbeat lost")
                        plane.report_recovery_required([1], "heartbeat lost")
                frame.append(line)
                if line == "" and any(x.startswith("data:") for x in frame):
                    (msg,) = sse_messages("\n".join(frame) + "\n")
                    received.append(msg.event)
                    frame = []
                    if len(received) == 2:
                        break
                elif line == "":
                    frame = []
        assert received == ["rank_failed", "recovery_required"]
        assert comments >= 1  # silence is kept alive (the events came after the first)
        # Reconnect after event 1: only event 2 and the newer one arrive.
        plane.report_rank_recovered([1])
        with http.stream(
            "GET", "/elastic_ep/events", headers={"Last-Event-ID": "1"}
        ) as response:
            resumed: list[str | None] = []
            frame = []
            for line in response.iter_lines():
                frame.append(line)
                if line == "":
                    resumed += [m.id for m in sse_messages("\n".join(frame) + "\n")]
                    frame = []
                    if len(resumed) == 2:
                        break
        assert resumed == ["2", "3"]


# --- auth ---------------------------------------------------------------------------------

ADMIN, USER = "admin-secret", "user-secret"


def _auth_client(api_key: str | None, admin_api_key: str | None) -> TestClient:
    plane = make_plane(engine=FakeEngine())
    check = sglang_admin_auth(api_key, admin_api_key)
    return TestClient(make_app(plane, api_key_check=check))


READS = ["/is_scaling_elastic_ep", "/elastic_ep/status", "/elastic_ep/health",
         "/elastic_ep/events?follow=false"]


def test_admin_key_is_required_for_writes_and_reads() -> None:
    client = _auth_client(USER, ADMIN)
    for headers in ({}, {"Authorization": f"Bearer {USER}"}, {"Authorization": "Bearer nope"},
                    {"Authorization": ADMIN}):
        response = post(client, {"new_ep_size": 4, "operation_id": "op-a"}, headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["instance_id"] == INSTANCE
        assert "--admin-api-key" in response.json()["error"]
        for path in READS:
            assert client.get(path, headers=headers).status_code == 401, (path, headers)
    good = {"Authorization": f"Bearer {ADMIN}"}
    status_before = client.get("/elastic_ep/status", headers=good).json()
    assert status_before["current_operation"] is None  # the 401s changed nothing
    assert post(client, {"new_ep_size": 4}, headers=good).status_code == 200
    for path in READS:
        assert client.get(path, headers=good).status_code == 200, path
    assert client.post("/is_scaling_elastic_ep", headers=good).status_code == 200


def test_api_key_alone_protects_admin_endpoints() -> None:
    client = _auth_client(USER, None)
    assert post(client, {"new_ep_size": 4}).status_code == 401
    assert client.get("/elastic_ep/status").status_code == 401
    assert "--api-key" in client.get("/elastic_ep/status").json()["error"]
    good = {"Authorization": f"bearer {USER}"}  # the scheme is case-insensitive
    assert post(client, {"new_ep_size": 4}, headers=good).status_code == 200


def test_no_keys_leaves_endpoints_open() -> None:
    assert sglang_admin_auth(None, None) is None
    assert sglang_admin_auth("", "") is None
    client = _auth_client(None, None)
    assert post(client, {"new_ep_size": 4}).status_code == 200


def _load_sglang_auth() -> ModuleType:
    """SGLang's own auth module, loaded from its file (importing sglang would load torch)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "utils" / "auth.py"
    mod_spec = importlib.util.spec_from_file_location("_sglang_auth_under_test", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_spec.name] = module  # dataclasses resolve annotations through it
    mod_spec.loader.exec_module(module)
    return module


def test_auth_decision_matches_sglang_admin_optional_rule() -> None:
    sglang_auth = _load_sglang_auth()
    keys = [None, "", USER, ADMIN]
    headers = [None, "", "Bearer", f"Bearer {USER}", f"Bearer {ADMIN}", f"bearer {ADMIN}",
               f"Basic {ADMIN}", f"Bearer  {ADMIN}", ADMIN]
    for api_key, admin_key, header in itertools.product(keys, keys, headers):
        for method, path in (("POST", "/scale_elastic_ep"), ("GET", "/elastic_ep/status"),
                             ("GET", "/elastic_ep/health")):
            theirs = sglang_auth.decide_request_auth(
                method=method,
                path=path,
                authorization_header=header,
                api_key=api_key,
                admin_api_key=admin_key,
                auth_level=sglang_auth.AuthLevel.ADMIN_OPTIONAL,
            ).allowed
            ours = decide_admin_optional(header, api_key=api_key, admin_api_key=admin_key)
            assert ours == theirs, (api_key, admin_key, header, path)


@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")
def test_mount_shadows_upstream_routes_and_works_with_sglang_middleware() -> None:
    sglang_auth = _load_sglang_auth()
    app = FastAPI()
    upstream = APIRouter()  # SGLang includes its elastic EP routes as a router, like this

    @upstream.post("/scale_elastic_ep")
    async def upstream_scale() -> dict[str, str]:
        return {"upstream": "yes"}

    @app.get("/is_scaling_elastic_ep")
    async def upstream_is_scaling() -> dict[str, str]:
        return {"upstream": "yes"}

    app.include_router(upstream)
    plane = make_plane(engine=FakeEngine())
    mount(app, build_router(plane), auth_level=sglang_auth.AuthLevel.ADMIN_OPTIONAL)
    sglang_auth.add_api_key_middleware(app, api_key=USER, admin_api_key=ADMIN)
    client = TestClient(app)

    # SGLang's middleware sees our endpoints as ADMIN_OPTIONAL: only the admin key passes.
    assert post(client, {"new_ep_size": 4}).status_code == 401
    assert post(client, {"new_ep_size": 4},
                headers={"Authorization": f"Bearer {USER}"}).status_code == 401
    assert client.get("/elastic_ep/status").status_code == 401
    good = {"Authorization": f"Bearer {ADMIN}"}
    response = post(client, {"new_ep_size": 4}, headers=good)
    assert response.status_code == 200 and "upstream" not in response.json()
    assert client.get("/is_scaling_elastic_ep", headers=good).json()["is_scaling_elastic_ep"]
    # Other routes keep SGLang's rules (NORMAL level: the plain API key works).
    assert client.get("/openapi.json", headers={"Authorization": f"Bearer {USER}"}).is_success


def test_status_times_come_from_the_injected_clock() -> None:
    clock = Clock(5000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock)
    client = TestClient(make_app(plane))
    post(client, {"new_ep_size": 4, "operation_id": "t"})
    clock.t = 5003.5
    plane.record_phase("t", Phase.PENDING)
    clock.t = 5010.0
    plane.finish_operation("t")
    op = client.get("/elastic_ep/status").json()["recent_operations"][0]
    assert op["started_at"] == 5000.0 and op["duration_s"] == 10.0
    assert [s["at"] for s in op["phase_timestamps"]] == [5000.0, 5003.5, 5010.0]


@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")
def test_include_router_would_hide_the_auth_level_from_sglang_middleware() -> None:
    """Why mount() adds top-level routes: with FastAPI's lazy include_router, SGLang's
    middleware cannot see an included endpoint's level and applies NORMAL, which leaves it
    open when only --admin-api-key is set (this also affects upstream's own elastic routes)."""
    sglang_auth = _load_sglang_auth()
    plane = make_plane(engine=FakeEngine())
    router = build_router(plane)
    for route in router.routes:
        route.endpoint._auth_level = sglang_auth.AuthLevel.ADMIN_OPTIONAL
    included = FastAPI()
    included.include_router(router)
    sglang_auth.add_api_key_middleware(included, api_key=None, admin_api_key=ADMIN)
    mounted = FastAPI()
    mount(mounted, build_router(plane), auth_level=sglang_auth.AuthLevel.ADMIN_OPTIONAL)
    sglang_auth.add_api_key_middleware(mounted, api_key=None, admin_api_key=ADMIN)
    assert TestClient(mounted).get("/elastic_ep/status").status_code == 401
    if TestClient(included).get("/elastic_ep/status").status_code == 401:
        pytest.skip("this FastAPI exposes included endpoints to the middleware again")


def test_concurrent_requests_start_exactly_one_operation() -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine)
    barrier = threading.Barrier(8)
    codes: list[int] = []
    lock = threading.Lock()
    with live_server(make_app(plane)) as url:

        def fire(i: int) -> None:
            with httpx.Client(base_url=url, timeout=10) as http:
                barrier.wait()
                response = http.post(
                    "/scale_elastic_ep", json={"new_ep_size": 3 + i % 4, "operation_id": f"c{i}"}
                )
            with lock:
                codes.append(response.status_code)

        threads = [threading.Thread(target=fire, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert sorted(codes) == [200] + [409] * 7
    assert len(engine.ops) == 1
    assert plane.events.last_event_id == 1


def test_liveness_reports_become_failed_and_recovered_events_once() -> None:
    plane = make_plane(engine=FakeEngine(), initial=4)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([2, 5], reason="peer gone")  # 5 is outside the effective size
    plane.observe_rank_liveness([2], reason="peer gone")  # no news: no second event
    health = client.get("/elastic_ep/health").json()
    rank2 = health["ranks"][2]
    assert rank2["alive"] is False and rank2["hard_blocked"] is True, health
    assert rank2["consecutive_unhealthy_checks"] == 2 and health["ranks"][0]["alive"] is True
    status = client.get("/elastic_ep/status").json()
    assert [r["state"] for r in status["ranks"][:4]] == ["active", "active", "failed", "active"]
    assert status["phase"] == "serving_degraded"
    plane.observe_rank_liveness([], reason="peer gone")
    status = client.get("/elastic_ep/status").json()
    assert status["ranks"][2]["state"] == "active" and status["phase"] == "serving_recovered"
    types = [(e.type, e.ranks) for e in plane.events.since(0).events]
    assert types == [
        ("rank_failed", [2]), ("recovery_required", [2]), ("rank_recovered", [2]),
    ], types

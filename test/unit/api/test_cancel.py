"""``DELETE /scale_elastic_ep/{operation_id}``: a scale-up that has not committed is called off,
the ranks it waited for are safe to terminate, the size stays; every other case is refused with
what works instead, and a repeat answers the same."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from eep_api_helpers import FakeEngine, make_app, make_plane
from fastapi.testclient import TestClient

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.core.operations import Operation


class FakeCanceller:
    """The schedulers' side: ``accept`` or refuse with ``message``; when accepted and
    ``drop`` is set, the schedulers drop the scale a moment later (the engine's watcher then
    sees it fail)."""

    def __init__(self) -> None:
        self.plane: InProcessControlPlane | None = None
        self.accept = True
        self.drop = True
        self.raises: Exception | None = None
        self.message = "cancel of the scale-up to 4 requested"
        self.calls: list[str] = []

    async def __call__(self, op: Operation) -> tuple[bool, str]:
        self.calls.append(op.operation_id)
        if self.raises is not None:
            raise self.raises
        if self.accept and self.drop:
            asyncio.get_running_loop().call_later(0.05, self._drop, op.operation_id)
        return self.accept, self.message

    def _drop(self, operation_id: str) -> None:
        assert self.plane is not None
        self.plane.finish_operation(operation_id, error="scale-up to 4 cancelled")


@pytest.fixture
def canceller() -> FakeCanceller:
    return FakeCanceller()


@pytest.fixture
def plane(canceller: FakeCanceller) -> InProcessControlPlane:
    plane = make_plane(engine=FakeEngine(), canceller=canceller)
    canceller.plane = plane
    return plane


@pytest.fixture
def client(plane: InProcessControlPlane) -> TestClient:
    return TestClient(make_app(plane))


def scale(client: TestClient, size: int, op: str) -> httpx.Response:
    return client.post("/scale_elastic_ep", content=json.dumps(
        {"new_ep_size": size, "operation_id": op}).encode(),
        headers={"Content-Type": "application/json"})


def cancel(client: TestClient, op: str) -> tuple[int, dict[str, Any]]:
    resp = client.delete(f"/scale_elastic_ep/{op}")
    return resp.status_code, resp.json()


def test_a_pending_scale_up_is_cancelled_and_its_joiners_released(
    client: TestClient, plane: InProcessControlPlane, canceller: FakeCanceller
) -> None:
    assert scale(client, 4, "grow").status_code == 200
    code, body = cancel(client, "grow")
    assert code == 200 and body["cancelled"] is True, body
    assert body["operation"]["result"] == "cancelled"
    assert "safe to terminate" in body["message"]
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2 and status["current_operation"] is None
    assert status["safe_to_terminate_ranks"] == [2, 3]
    types = [e.type for e in plane.events.since(0).events]
    assert types == ["scale_requested", "scale_cancelled", "safe_to_terminate"]
    # Idempotent: the same answer again, and nothing sent to the schedulers a second time.
    again_code, again = cancel(client, "grow")
    assert (again_code, again["cancelled"]) == (200, True)
    assert canceller.calls == ["grow"]
    # A retry of the cancelled id is answered as a replay that says so.
    replay = scale(client, 4, "grow").json()
    assert replay["replayed"] and "was cancelled" in replay["message"]
    # The cluster is free for the next operation.
    assert scale(client, 3, "grow-again").status_code == 200


def test_past_its_commit_point_the_schedulers_refuse_and_nothing_changes(
    client: TestClient, canceller: FakeCanceller
) -> None:
    scale(client, 4, "grow")
    canceller.accept = False
    canceller.message = "the scale-up to 4 is past its commit point (joining)"
    code, body = cancel(client, "grow")
    assert code == 409 and body["cancelled"] is False
    assert "past its commit point" in body["message"]
    assert "GET /elastic_ep/status" in body["message"]
    status = client.get("/elastic_ep/status").json()
    assert status["current_operation"]["operation_id"] == "grow"


@pytest.mark.parametrize(("setup", "op", "code", "words"), [
    (None, "nope", 404, "GET /elastic_ep/status lists"),
    ("committed", "grow", 409, "new_ep_size 2"),
    ("failed", "grow", 409, "already failed"),
    ("down", "shrink", 409, "cannot be cancelled"),
])
def test_refusals_name_what_works_and_change_nothing(
    client: TestClient, plane: InProcessControlPlane, canceller: FakeCanceller,
    setup: str | None, op: str, code: int, words: str,
) -> None:
    if setup == "committed":
        scale(client, 4, "grow")
        plane.finish_operation("grow")
    elif setup == "failed":
        scale(client, 4, "grow")
        plane.finish_operation("grow", error="joiner never connected")
    elif setup == "down":
        plane.finish_operation(scale(client, 4, "grow").json()["operation_id"])
        scale(client, 3, "shrink")
    before = client.get("/elastic_ep/status").json()
    got, body = cancel(client, op)
    assert got == code and body["cancelled"] is False and words in body["message"], body
    assert client.get("/elastic_ep/status").json() == before
    assert canceller.calls == []


def test_a_slow_drop_is_202_and_a_later_delete_finds_it_cancelled(
    client: TestClient, plane: InProcessControlPlane, canceller: FakeCanceller
) -> None:
    scale(client, 4, "grow")
    canceller.drop = False
    answer = asyncio.run(plane.cancel_operation("grow", wait_s=0.2))
    assert answer.status == 202 and answer.response.cancelled is False
    assert "DELETE again" in answer.response.message
    plane.finish_operation("grow", error="scale-up to 4 cancelled")  # the schedulers dropped it
    code, body = cancel(client, "grow")
    assert (code, body["cancelled"]) == (200, True)


def test_schedulers_that_do_not_answer_give_503_and_a_retry_works(
    client: TestClient, canceller: FakeCanceller
) -> None:
    scale(client, 4, "grow")
    canceller.raises = TimeoutError("no answer")
    code, body = cancel(client, "grow")
    assert code == 503 and "retry the DELETE" in body["message"]
    canceller.raises = None
    code, body = cancel(client, "grow")
    assert (code, body["cancelled"]) == (200, True)


def test_a_failure_that_is_not_a_cancel_stays_a_failure(
    client: TestClient, plane: InProcessControlPlane
) -> None:
    scale(client, 4, "grow")
    plane.finish_operation("grow", error="joiner never connected")
    status = client.get("/elastic_ep/status").json()
    assert status["recent_operations"][0]["result"] == "failed"

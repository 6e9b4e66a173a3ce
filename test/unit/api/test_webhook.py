"""WebhookSender against a real local HTTP receiver (http.server on a free port)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from eep_api_helpers import INSTANCE, FakeEngine, free_port, make_app, make_plane
from fastapi.testclient import TestClient

from sglang_elastic_ep.api.auth import sglang_admin_auth
from sglang_elastic_ep.api.webhook import WebhookSender, redact_url
from sglang_elastic_ep.core.api_models import EVENT_ADAPTER, EVENT_TYPES, RankFailedEvent
from sglang_elastic_ep.core.events import EventLog
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep_testbed.cluster.waits import wait_until

SECRET = "s3cr3t-admin-key"
# Bounds for things that take milliseconds here; generous so that only a broken sender, never
# a busy machine, reaches them.
SETTLE_S = 60.0
SENSITIVE_NAME = re.compile(r"key|token|secret|passw|auth|cookie|credential", re.IGNORECASE)


class Receiver:
    """Records every POST; answers from ``plan`` (status codes, then 200), optionally slowly."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.plan: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.set_cookie = False
        self.retry_after: str | None = None
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.gate.wait()  # close() opens it
                with receiver.lock:
                    receiver.requests.append(
                        {"headers": {k.lower(): v for k, v in self.headers.items()},
                         "body": body, "at": time.monotonic()}
                    )
                    status = receiver.plan.pop(0) if receiver.plan else 200
                self.send_response(status)
                if receiver.retry_after is not None and status != 200:
                    self.send_header("Retry-After", receiver.retry_after)
                if receiver.set_cookie:
                    self.send_header("Set-Cookie", "session=abc123; Path=/")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def bodies(self) -> list[dict[str, Any]]:
        with self.lock:
            return [json.loads(r["body"]) for r in self.requests]

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def sender_for(log: EventLog, url: str, **kwargs: Any) -> WebhookSender:
    kwargs.setdefault("backoff_initial_s", 0.02)
    kwargs.setdefault("poll_timeout_s", 0.05)
    kwargs.setdefault("timeout_s", SETTLE_S)
    return WebhookSender(log, url, **kwargs)


def test_every_event_is_posted_in_order_as_json(receiver: Receiver) -> None:
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url).start()
    try:
        emitted = [log.emit(RankFailedEvent, ranks=[r], reason=f"r{r}") for r in range(5)]
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert receiver.bodies() == [e.model_dump(mode="json") for e in emitted]
    for request, event in zip(receiver.requests, emitted, strict=True):
        headers = request["headers"]
        assert headers["content-type"] == "application/json"
        assert headers["x-elastic-ep-event-id"] == str(event.event_id)
        assert headers["x-elastic-ep-event-type"] == "rank_failed"
        assert headers["x-elastic-ep-instance-id"] == INSTANCE
        assert headers["x-elastic-ep-delivery-attempt"] == "1"
        EVENT_ADAPTER.validate_json(request["body"])
    assert (sender.stats.delivered, sender.stats.failed, sender.stats.dropped) == (5, 0, 0)


def test_retryable_failures_are_retried_with_exponential_backoff(receiver: Receiver) -> None:
    receiver.plan = [503, 500, 429]
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url, backoff_initial_s=0.05).start()
    try:
        log.emit(RankFailedEvent, ranks=[1], reason="x")
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    attempts = [r["headers"]["x-elastic-ep-delivery-attempt"] for r in receiver.requests]
    assert attempts == ["1", "2", "3", "4"]
    assert len({r["body"] for r in receiver.requests}) == 1  # the same event each time
    gaps = [b["at"] - a["at"] for a, b in zip(receiver.requests, receiver.requests[1:],
                                               strict=False)]
    assert gaps[0] >= 0.045 and gaps[1] >= 0.095 and gaps[2] >= 0.19  # 0.05, 0.1, 0.2 s
    assert (sender.stats.delivered, sender.stats.retries, sender.stats.failed) == (1, 3, 0)


def test_retry_after_is_honoured_up_to_the_cap(receiver: Receiver) -> None:
    receiver.plan = [429]
    # A receiver asking for an hour gets at most the 0.3 s cap (else the flush never ends).
    receiver.retry_after = "3600"
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url, backoff_initial_s=0.01, backoff_max_s=0.3).start()
    try:
        log.emit(RankFailedEvent, ranks=[1], reason="x")
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    gap = receiver.requests[1]["at"] - receiver.requests[0]["at"]
    assert gap >= 0.28  # Retry-After over the 0.01 s backoff, up to the cap


def test_client_errors_are_not_retried_and_later_events_still_go(receiver: Receiver) -> None:
    receiver.plan = [400]
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url).start()
    try:
        log.emit(RankFailedEvent, ranks=[1], reason="first")
        log.emit(RankFailedEvent, ranks=[2], reason="second")
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert [b["reason"] for b in receiver.bodies()] == ["first", "second"]
    assert (sender.stats.delivered, sender.stats.failed, sender.stats.retries) == (1, 1, 0)


def test_unreachable_receiver_gives_up_without_blocking_the_emitter() -> None:
    log = EventLog(INSTANCE)
    sender = sender_for(log, f"http://127.0.0.1:{free_port()}/hook", max_attempts=3)
    sender.start()
    try:
        # Emitting never waits on delivery: the sender follows the log from its own threads
        # (test_full_queue_drops_the_oldest_and_counts emits while the receiver hangs).
        for r in range(10):
            log.emit(RankFailedEvent, ranks=[r % 8], reason="x")
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert sender.stats.delivered == 0
    assert sender.stats.failed == 10
    assert sender.stats.retries == 20  # 2 retries per event


def test_full_queue_drops_the_oldest_and_counts(receiver: Receiver) -> None:
    receiver.gate.clear()  # the receiver hangs on the first request
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url, queue_size=2).start()
    try:
        log.emit(RankFailedEvent, ranks=[0], reason="e1")
        wait_until(lambda: not sender.queued and sender._in_flight, SETTLE_S,
                   "e1 on the wire", poll_s=0.01)
        for n in range(2, 7):
            log.emit(RankFailedEvent, ranks=[0], reason=f"e{n}")
        wait_until(lambda: sender.stats.dropped >= 3, SETTLE_S, "3 events dropped", poll_s=0.01)
        receiver.gate.set()
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert [b["reason"] for b in receiver.bodies()] == ["e1", "e5", "e6"]
    assert sender.stats.dropped == 3 and sender.stats.delivered == 3


def test_events_missed_before_the_pump_read_them_are_counted(receiver: Receiver) -> None:
    log = EventLog(INSTANCE, capacity=2)
    for r in range(5):
        log.emit(RankFailedEvent, ranks=[r], reason="x")
    sender = sender_for(log, receiver.url).start()
    try:
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert [b["event_id"] for b in receiver.bodies()] == [4, 5]
    assert sender.stats.missed == 3


def test_nothing_secret_is_ever_sent(receiver: Receiver) -> None:
    """The server has an admin key and the orchestrator sends it; the webhook never does."""
    receiver.set_cookie = True
    async def canceller(op: object) -> tuple[bool, str]:
        return True, "cancel requested"

    plane = make_plane(engine=FakeEngine(), initial=4, canceller=canceller)
    client = TestClient(make_app(plane, api_key_check=sglang_admin_auth(None, SECRET)))
    sender = sender_for(plane.events, receiver.url).start()
    try:
        auth = {"Authorization": f"Bearer {SECRET}", "Cookie": f"k={SECRET}",
                "X-Api-Key": SECRET}
        op = client.post("/scale_elastic_ep", json={"new_ep_size": 2, "operation_id": "d"},
                         headers=auth)
        assert op.status_code == 200
        plane.record_phase("d", Phase.MOVING_EXPERTS)
        plane.finish_operation("d")
        plane.report_rank_failed([1], "heartbeat lost")
        plane.report_recovery_required([1], "heartbeat lost")
        plane.report_rank_joined([1])
        plane.report_rank_recovered([1])
        client.post("/scale_elastic_ep", json={"new_ep_size": 3, "operation_id": "u"},
                    headers=auth)
        plane.finish_operation("u", error="joiner crashed")
        client.post("/scale_elastic_ep", json={"new_ep_size": 3, "operation_id": "c"},
                    headers=auth)
        assert asyncio.run(plane.cancel_operation("c", wait_s=0)).status == 202
        plane.finish_operation("c", error="scale-up to 3 cancelled")  # the schedulers dropped it
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    types = {b["type"] for b in receiver.bodies()}
    assert types == {t.model_fields["type"].default for t in EVENT_TYPES}  # every kind seen
    for request in receiver.requests:
        assert SECRET.encode() not in request["body"]
        for name, value in request["headers"].items():
            assert SECRET not in value
            assert name not in ("authorization", "cookie", "proxy-authorization", "x-api-key")
        assert request["headers"]["user-agent"].startswith("sglang-elastic-ep-webhook/")
    # And no event type can carry one: no field is named like a credential.
    for event_type in EVENT_TYPES:
        for field in event_type.model_fields:
            assert not SENSITIVE_NAME.search(field), (event_type.__name__, field)


def test_environment_proxies_and_netrc_are_not_used(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine 127.0.0.1 login user password {SECRET}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("HTTP_PROXY", f"http://user:{SECRET}@127.0.0.1:{free_port()}")
    log = EventLog(INSTANCE)
    sender = sender_for(log, receiver.url).start()
    try:
        log.emit(RankFailedEvent, ranks=[1], reason="x")
        assert sender.flush(SETTLE_S)
    finally:
        sender.stop()
    assert sender.stats.delivered == 1  # straight to the receiver, not via the proxy
    assert "authorization" not in receiver.requests[0]["headers"]


def test_bad_urls_are_refused_and_credentials_redacted_in_logs() -> None:
    log = EventLog(INSTANCE)
    with pytest.raises(ValueError, match="http"):
        WebhookSender(log, "ftp://example.com/hook")
    with pytest.raises(ValueError, match="http"):
        WebhookSender(log, "example.com/hook")
    assert redact_url("https://user:pw@hooks.example.com:8443/x?y=1") == (
        "https://***@hooks.example.com:8443/x?y=1"
    )
    assert redact_url("http://hooks.example.com/x") == "http://hooks.example.com/x"


def test_stop_interrupts_a_backoff_promptly() -> None:
    log = EventLog(INSTANCE)
    sender = sender_for(log, f"http://127.0.0.1:{free_port()}/hook",
                        backoff_initial_s=3600.0, backoff_max_s=3600.0, max_attempts=5).start()
    log.emit(RankFailedEvent, ranks=[1], reason="x")
    wait_until(lambda: sender.stats.retries >= 1, SETTLE_S, "a retry in backoff", poll_s=0.01)
    threads = list(sender._threads)
    sender.stop(timeout_s=SETTLE_S)
    # In an hour-long backoff: its thread can only have ended by stop() interrupting it.
    assert not any(t.is_alive() for t in threads), threads

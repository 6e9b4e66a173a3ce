"""What an orchestrator sees of a running cluster: status, SSE events, webhook deliveries."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx


def status(url: str) -> dict:
    return httpx.get(url + "/elastic_ep/status", timeout=30).json()


def wait_rank_state(
    url: str, rank: int, state: str, timeout_s: float, poll_s: float = 1.0
) -> dict:
    """Poll the status until ``rank`` is in ``state``; the status then."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(url)
        if current["ranks"][rank]["state"] == state:
            return current
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} not {state} in {timeout_s} s: {current}")
        time.sleep(poll_s)


def wait_operation(url: str, operation_id: str, timeout_s: float) -> dict:
    """Poll the status until ``operation_id`` finished; its entry in ``recent_operations``."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(url)
        done = [op for op in current["recent_operations"] if op["operation_id"] == operation_id]
        if done:
            return done[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"operation {operation_id} not finished in {timeout_s} s: {current}")
        time.sleep(0.5)


def post_scale(url: str, size: int, operation_id: str) -> None:
    """``POST /scale_elastic_ep`` to ``size`` under ``operation_id``; raises on a refusal."""
    httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": size, "operation_id": operation_id},
               timeout=60).raise_for_status()


def wait_experts_reported(url: str, ranks: int, timeout_s: float = 60) -> list[list[int]]:
    """The logical experts of ranks ``0..ranks-1`` once the status reports them for exactly
    that many ranks (the health poll refreshes the placement every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = status(url)
        experts = [r["experts"] for r in current["ranks"]]
        if current["effective_ep_size"] == ranks and all(e is not None for e in experts[:ranks]) \
                and all(e is None for e in experts[ranks:]):
            return experts[:ranks]
        if time.monotonic() > deadline:
            raise TimeoutError(f"experts of {ranks} ranks not reported in {timeout_s} s: {current}")
        time.sleep(1.0)


def sse_events(url: str) -> list[dict]:
    """Every buffered event, read over ``GET /elastic_ep/events`` (SSE, not followed)."""
    resp = httpx.get(url + "/elastic_ep/events", params={"follow": "false"}, timeout=30)
    resp.raise_for_status()
    if not resp.headers["content-type"].startswith("text/event-stream"):
        raise ValueError(f"not an event stream: {resp.headers['content-type']}")
    return [json.loads(line[5:]) for line in resp.text.splitlines() if line.startswith("data:")]


def operation_events(events: list[dict]) -> dict[str, list[str]]:
    """Event types per operation id, in order."""
    ops: dict[str, list[str]] = {}
    for event in events:
        if event.get("operation_id"):
            ops.setdefault(event["operation_id"], []).append(event["type"])
    return ops


def batches_run_by(log_path: Path, shard: int) -> int:
    """Prefill batches the scheduler of DP shard ``shard`` ran, from its server's log: proof
    that the primary's DP router sent it requests. (The HTTP response's dp_rank is not filled
    in for requests served by a joiner's shard.)"""
    return sum(
        1
        for line in log_path.read_text(errors="replace").splitlines()
        if f" DP{shard}] Prefill batch" in line
    )


def metric(url: str, name: str) -> float | None:
    """The first sample of ``name`` on ``/metrics`` (labels included in ``name``), or None."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


class WebhookReceiver:
    """A local HTTP endpoint (``--elastic-ep-webhook-url``) recording the JSON events posted."""

    def __init__(self) -> None:
        received: list[dict] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append(json.loads(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(
        self, predicate: Callable[[list[dict]], bool], timeout_s: float = 30.0
    ) -> list[dict]:
        """Wait until ``predicate(received)`` holds (retries are the sender's job)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(list(self.received)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

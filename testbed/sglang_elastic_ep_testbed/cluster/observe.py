"""What an orchestrator sees of a running cluster: status, SSE events, webhook deliveries."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_fixed

from sglang_elastic_ep_testbed.cluster.load import LoadClient
from sglang_elastic_ep_testbed.cluster.waits import wait_until

T = TypeVar("T")


@retry(retry=retry_if_exception_type((httpx.NetworkError, httpx.RemoteProtocolError)),
       stop=stop_after_attempt(3), wait=wait_fixed(1.0), reraise=True)
def status(url: str) -> dict:
    """``GET /elastic_ep/status``. A connection the server dropped is tried again twice, as an
    orchestrator's poll would be: a reset on one poll is not a lost server (a server that went
    away fails all three, and the error is raised). A timeout is not tried again."""
    return httpx.get(url + "/elastic_ep/status", timeout=30).json()


def wait_status(
    url: str, accept: Callable[[dict], T | None], timeout_s: float, what: str,
    poll_s: float = 1.0,
) -> T:
    """Poll the status until ``accept(status)`` is truthy; that value. The timeout names
    ``what`` and shows the last status read (no new request to a server that may be stuck)."""
    last: list[dict] = []

    def probe() -> T | None:
        last[:] = [status(url)]
        return accept(last[0])

    return wait_until(probe, timeout_s, what, poll_s, describe=lambda: last[0] if last else None)


def wait_rank_state(
    url: str, rank: int, state: str, timeout_s: float, poll_s: float = 1.0
) -> dict:
    """Poll the status until ``rank`` is in ``state``; the status then."""
    return wait_status(url, lambda s: s if s["ranks"][rank]["state"] == state else None,
                       timeout_s, f"rank {rank} {state}", poll_s)


def wait_operation(url: str, operation_id: str, timeout_s: float) -> dict:
    """Poll the status until ``operation_id`` finished; its entry in ``recent_operations``."""
    def finished(current: dict) -> dict | None:
        done = [op for op in current["recent_operations"] if op["operation_id"] == operation_id]
        return done[0] if done else None

    return wait_status(url, finished, timeout_s, f"operation {operation_id} finished", 0.5)


def post_scale(url: str, size: int, operation_id: str) -> dict:
    """``POST /scale_elastic_ep`` to ``size`` under ``operation_id``; its answer. Raises on a
    refusal."""
    resp = httpx.post(url + "/scale_elastic_ep",
                      json={"new_ep_size": size, "operation_id": operation_id}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def wait_experts_reported(url: str, ranks: int, timeout_s: float = 60) -> list[list[int]]:
    """The logical experts of ranks ``0..ranks-1`` once the status reports them for exactly
    that many ranks (the health poll refreshes the placement every 2 s)."""
    def reported(current: dict) -> list[list[int]] | None:
        experts = [r["experts"] for r in current["ranks"]]
        if current["effective_ep_size"] == ranks and all(e is not None for e in experts[:ranks]) \
                and all(e is None for e in experts[ranks:]):
            return experts[:ranks]
        return None

    return wait_status(url, reported, timeout_s, f"experts of {ranks} ranks reported")


def wait_rebalanced(url: str, size: int, seen: int, timeout_s: float) -> dict:
    """Poll the status until it lists more than ``seen`` EPLB rebalances, the newest at
    ``size`` ranks, with every rank's expert slots reported for that size; the status then."""
    def rebalanced(current: dict) -> dict | None:
        sizes = current.get("eplb_rebalances", [])
        slots = [r.get("expert_slots") for r in current["ranks"][:size]]
        if len(sizes) > seen and sizes[-1] == size and current["effective_ep_size"] == size \
                and all(s is not None for s in slots):
            return current
        return None

    return wait_status(url, rebalanced, timeout_s, f"an EPLB rebalance at {size} ranks")


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
    in for requests served by a joiner's shard.) A joiner's lines read `` DP2] Prefill
    batch``, a multi-rank server's `` DP1 TP1 EP1] Prefill batch``."""
    line = re.compile(rf" DP{shard}(?: [A-Z_]+\d+)*\] Prefill batch")
    return len(line.findall(log_path.read_text(errors="replace")))


# A shard's server log, or what lists its servers' logs now (a replacement that dies is
# relaunched with a log of its own).
ShardLogs = Path | Callable[[], Iterable[Path]]


def _paths(logs: ShardLogs) -> list[Path]:
    return [logs] if isinstance(logs, Path) else list(logs())


def wait_each_shard_serves(
    load: LoadClient, shards: Sequence[int], timeout_s: float,
    logs: Mapping[int, ShardLogs] | None = None,
) -> None:
    """Wait until each of ``shards`` served ``load`` after this call: a request started since
    completed there (its response names the shard) or, for a shard in ``logs`` (shard -> its
    server's log, or a function listing its servers' logs: a joiner's responses carry no
    dp_rank), its scheduler ran a new prefill batch in one of them.

    What a test checks after a change instead of counting requests over a fixed time, which a
    slow machine fails (fewer complete); failed requests are the caller's to check."""
    since = time.monotonic()
    logs = dict(logs or {})
    # A log first listed later was written after this call: all of its batches count.
    baseline = {shard: {path: batches_run_by(path, shard) for path in _paths(source)}
                for shard, source in logs.items()}

    def ran_a_new_batch(shard: int) -> bool:
        return any(batches_run_by(path, shard) > baseline[shard].get(path, 0)
                   for path in _paths(logs[shard]))

    def waiting() -> list[int]:
        served = {r.dp_rank for r in load.snapshot() if r.ok and r.started >= since}
        return [
            shard for shard in shards
            if (not ran_a_new_batch(shard) if shard in logs else shard not in served)
        ]

    wait_until(lambda: not waiting(), timeout_s, f"requests served by each of shards {shards}",
               poll_s=1.0, describe=lambda: f"shards {waiting()} served none yet")


def metric(url: str, name: str) -> float | None:
    """The first sample of ``name`` on ``/metrics`` (labels included in ``name``), or None."""
    text = httpx.get(url + "/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


class WebhookReceiver:
    """A local HTTP endpoint (``--elastic-ep-webhook-url``) recording the JSON events posted.

    Delivery is at least once (a retry after an answer the sender did not see in time delivers
    an event twice), so it de-duplicates on (instance id, event id) as docs/api.md tells
    receivers to; ``duplicates`` counts what it dropped."""

    def __init__(self) -> None:
        received: list[dict] = []
        seen: set[tuple[str, int]] = set()
        self.received = received
        self.duplicates = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                event = json.loads(body)
                key = (str(event.get("instance_id")), int(event.get("event_id", -1)))
                with lock:
                    if key in seen:
                        receiver.duplicates += 1
                    else:
                        seen.add(key)
                        received.append(event)
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
        """Wait until ``predicate(received)`` holds (retries are the sender's job); what was
        received then, or at the timeout (the caller's assertion shows it)."""
        try:
            wait_until(lambda: predicate(list(self.received)), timeout_s, "webhook deliveries")
        except TimeoutError:
            pass
        return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> WebhookReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_since(log: Path, offset: int) -> str:
    """What ``log`` gained after byte ``offset`` (a server log's size before an action)."""
    with open(log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")

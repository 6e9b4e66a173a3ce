"""Push every elastic EP event to an orchestrator's URL (``--elastic-ep-webhook-url``).

Two daemon threads, so serving never waits on the receiver:

- the pump follows the ``EventLog`` (``wait_since``) and appends events to a bounded queue;
  when the queue is full the oldest event is dropped and counted (``stats.dropped``);
- the sender POSTs each event as JSON, retrying connection errors, timeouts, 408, 429 and 5xx
  with exponential backoff (``Retry-After`` honoured up to the cap); other 4xx answers are
  not retried. An event that still fails is counted (``stats.failed``) and skipped.

Events carry no secrets (ids, sizes, ranks, phases, messages), and the sender adds none: no
API key, no forwarded header, no cookie, no proxy or ``.netrc`` credentials from the
environment (``trust_env=False``), no redirects. Receivers should de-duplicate on
``X-Elastic-EP-Event-Id`` + ``X-Elastic-EP-Instance-Id`` (a retry after a lost answer
delivers an event twice). Events resume from the log, so ``GET /elastic_ep/events`` with
``Last-Event-ID`` fills any gap the webhook dropped.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

from sglang_elastic_ep.core.api_models import EventModel
from sglang_elastic_ep.core.events import EventLog

logger = logging.getLogger(__name__)

USER_AGENT = "sglang-elastic-ep-webhook/0.1"
_RETRY_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def redact_url(url: str) -> str:
    """``url`` without user:password, for logs."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    return urlunsplit((parts.scheme, "***@" + host, parts.path, parts.query, parts.fragment))


@dataclass
class WebhookStats:
    delivered: int = 0
    failed: int = 0  # gave up after retries, or a non-retryable answer
    dropped: int = 0  # the queue was full: oldest event discarded
    missed: int = 0  # the event log overwrote events before the pump read them
    retries: int = 0


class WebhookSender:
    def __init__(
        self,
        events: EventLog,
        url: str,
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        queue_size: int = 1000,
        start_after_event_id: int = 0,
        poll_timeout_s: float = 1.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        scheme = urlsplit(url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"--elastic-ep-webhook-url must be http(s)://..., got {url!r}")
        if max_attempts < 1 or queue_size < 1:
            raise ValueError("max_attempts and queue_size must be >= 1")
        self.url = url
        self._events = events
        self._max_attempts = max_attempts
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._poll_timeout_s = poll_timeout_s
        self._cursor = start_after_event_id
        self._queue: deque[EventModel] = deque()
        self._queue_size = queue_size
        self._cond = threading.Condition()
        self._in_flight = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.stats = WebhookStats()
        self._client = httpx.Client(
            timeout=timeout_s,
            trust_env=False,
            follow_redirects=False,
            transport=transport,
            headers={"User-Agent": USER_AGENT},
        )

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> WebhookSender:
        if self._threads:
            return self
        for name, target in (("pump", self._pump), ("send", self._send_loop)):
            thread = threading.Thread(target=target, name=f"elastic-ep-webhook-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info("elastic EP webhook: posting events to %s", redact_url(self.url))
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both threads (a delivery in backoff gives up at once) and close the client."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads.clear()
        self._client.close()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event emitted so far was delivered or given up on."""
        target = self._events.last_event_id
        with self._cond:
            return self._cond.wait_for(
                lambda: self._cursor >= target and not self._queue and not self._in_flight,
                timeout_s,
            )

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    # --- threads ------------------------------------------------------------------------

    def _pump(self) -> None:
        while not self._stop.is_set():
            batch = self._events.wait_since(self._cursor, self._poll_timeout_s)
            with self._cond:
                if batch.missed:
                    first = batch.events[0].event_id if batch.events else batch.last_event_id + 1
                    self.stats.missed += max(0, first - self._cursor - 1)
                for event in batch.events:
                    if len(self._queue) >= self._queue_size:
                        self._queue.popleft()
                        self.stats.dropped += 1
                    self._queue.append(event)
                self._cursor = batch.last_event_id
                self._cond.notify_all()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop.is_set())
                if self._stop.is_set():
                    return
                event = self._queue.popleft()
                self._in_flight = True
            try:
                self._deliver(event)
            finally:
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()

    def _deliver(self, event: EventModel) -> None:
        body = event.model_dump_json().encode()
        headers = {
            "Content-Type": "application/json",
            "X-Elastic-EP-Event-Id": str(event.event_id),
            "X-Elastic-EP-Event-Type": event.type,
            "X-Elastic-EP-Instance-Id": event.instance_id,
        }
        for attempt in range(1, self._max_attempts + 1):
            delay = min(self._backoff_max_s, self._backoff_initial_s * 2 ** (attempt - 1))
            self._client.cookies.clear()  # never send back what a receiver set
            try:
                response = self._client.post(
                    self.url,
                    content=body,
                    headers={**headers, "X-Elastic-EP-Delivery-Attempt": str(attempt)},
                )
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.is_success:
                    self.stats.delivered += 1
                    return
                problem = f"HTTP {response.status_code}"
                if response.status_code not in _RETRY_STATUS:
                    break
                delay = min(self._backoff_max_s, max(delay, _retry_after(response)))
            if attempt == self._max_attempts:
                break
            self.stats.retries += 1
            logger.debug(
                "elastic EP webhook: event %d attempt %d failed (%s); retrying in %.2fs",
                event.event_id, attempt, problem, delay,
            )
            if self._stop.wait(delay):
                return
        self.stats.failed += 1
        logger.warning(
            "elastic EP webhook: gave up on event %d (%s) to %s: %s",
            event.event_id, event.type, redact_url(self.url), problem,
        )


def _retry_after(response: httpx.Response) -> float:
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0

"""In-memory event log with Server-Sent-Events formatting and Last-Event-ID resume."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sglang_elastic_ep.core.api_models import EventModel

E = TypeVar("E", bound=EventModel)


@dataclass(frozen=True)
class EventBatch:
    events: list[EventModel]
    last_event_id: int  # resume from here next time
    # The client's Last-Event-ID is older than the buffer (or from another instance): some
    # events are lost and it should re-read GET /elastic_ep/status.
    missed: bool = False


class EventLog:
    """Bounded ring buffer of events with ids 1, 2, 3, ...; safe to share between threads."""

    def __init__(
        self,
        instance_id: str,
        *,
        capacity: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.instance_id = instance_id
        self._events: deque[EventModel] = deque(maxlen=capacity)
        self._next_id = 1
        self._clock = clock
        self._changed = threading.Condition()

    @property
    def last_event_id(self) -> int:
        with self._changed:
            return self._next_id - 1

    def emit(self, event_type: type[E], **fields: Any) -> E:
        """Build an event of ``event_type`` with the next id and the current time; store it."""
        with self._changed:
            event = event_type(
                event_id=self._next_id,
                time=self._clock(),
                instance_id=self.instance_id,
                **fields,
            )
            self._next_id += 1
            self._events.append(event)
            self._changed.notify_all()
            return event

    def since(self, last_event_id: int) -> EventBatch:
        """Events after ``last_event_id``. New subscribers pass ``last_event_id`` of the log."""
        with self._changed:
            return self._since_locked(last_event_id)

    def wait_since(self, last_event_id: int, timeout_s: float) -> EventBatch:
        """Like since() but blocks up to ``timeout_s`` until at least one event is newer."""
        with self._changed:
            self._changed.wait_for(lambda: self._next_id - 1 != last_event_id, timeout_s)
            return self._since_locked(last_event_id)

    def _since_locked(self, last_event_id: int) -> EventBatch:
        newest = self._next_id - 1
        if last_event_id > newest:
            # An id from the future: the server restarted; replay what we have.
            return EventBatch(list(self._events), newest, missed=True)
        oldest = self._events[0].event_id if self._events else self._next_id
        missed = last_event_id < oldest - 1
        events = [e for e in self._events if e.event_id > last_event_id]
        return EventBatch(events, newest, missed=missed)


def format_sse(event: EventModel) -> str:
    """One SSE frame: ``id:``, ``event:`` and a single-line JSON ``data:`` field."""
    # model_dump_json emits no newlines, so one data: line carries the whole event.
    return f"id: {event.event_id}\nevent: {event.type}\ndata: {event.model_dump_json()}\n\n"


def format_sse_comment(text: str = "keepalive") -> str:
    """A comment frame; proxies keep idle streams open when they see one now and then."""
    return "".join(f": {line}\n" for line in text.splitlines() or [""]) + "\n"


def parse_last_event_id(header: str | None) -> int | None:
    """The ``Last-Event-ID`` header as an id, or None when absent or not a non-negative int."""
    if header is None:
        return None
    text = header.strip()
    if not text.isdigit():
        return None
    return int(text)

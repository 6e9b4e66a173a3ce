"""A Server-Sent-Events parser (the WHATWG event-stream rules we need)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class SSEMessage:
    event: str  # "message" when the frame named none
    data: str
    id: str | None  # the id: field of this frame, if any
    retry_ms: int | None = None  # a retry: field seen since the previous message


def iter_sse(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """Messages from decoded lines (without their line endings); comments are skipped.

    A ``retry:`` field sets the reconnection delay even in a block without data (the server
    sends it that way when a stream opens), so it is carried to the next message.
    """
    event = ""
    data: list[str] = []
    event_id: str | None = None
    retry: int | None = None
    for raw in lines:
        line = raw.rstrip("\r\n")
        if line == "":
            if data:
                yield SSEMessage(event or "message", "\n".join(data), event_id, retry)
                retry = None
            event, data, event_id = "", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id" and "\0" not in value:
            event_id = value
        elif name == "retry" and value.isdigit():
            retry = int(value)

import json
import threading
import time

import pytest

from sglang_elastic_ep.core.api_models import (
    EVENT_ADAPTER,
    RankFailedEvent,
    RankJoinedEvent,
    ScaleRequestedEvent,
)
from sglang_elastic_ep.core.events import (
    EventLog,
    format_sse,
    format_sse_comment,
    parse_last_event_id,
)


def _log(capacity: int = 8) -> EventLog:
    ticks = iter(range(1000))
    return EventLog("inst-1", capacity=capacity, clock=lambda: float(next(ticks)))


def test_emit_assigns_monotonic_ids_time_and_instance() -> None:
    log = _log()
    a = log.emit(RankJoinedEvent, ranks=[2], operation_id="op")
    b = log.emit(RankFailedEvent, ranks=[1], reason="gone")
    assert (a.event_id, b.event_id) == (1, 2)
    assert (a.time, b.time) == (0.0, 1.0)
    assert a.instance_id == "inst-1" and log.last_event_id == 2


def test_since_returns_only_newer_events() -> None:
    log = _log()
    for r in range(4):
        log.emit(RankJoinedEvent, ranks=[r])
    batch = log.since(2)
    assert [e.event_id for e in batch.events] == [3, 4]
    assert batch.last_event_id == 4 and not batch.missed
    assert log.since(4).events == [] and not log.since(4).missed


def test_new_subscriber_starts_at_last_event_id() -> None:
    log = _log()
    log.emit(RankJoinedEvent, ranks=[0])
    start = log.last_event_id
    log.emit(RankJoinedEvent, ranks=[1])
    assert [e.ranks for e in log.since(start).events] == [[1]]


def test_ring_buffer_drops_oldest_and_flags_missed_resume() -> None:
    log = _log(capacity=3)
    for r in range(6):
        log.emit(RankJoinedEvent, ranks=[r])
    assert [e.event_id for e in log.since(0).events] == [4, 5, 6]
    assert log.since(0).missed and log.since(2).missed
    assert not log.since(3).missed  # 4 is the next one and still held


def test_resume_from_a_future_id_means_restart_and_replays_everything() -> None:
    log = _log()
    log.emit(RankJoinedEvent, ranks=[0])
    batch = log.since(99)
    assert batch.missed and [e.event_id for e in batch.events] == [1]


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EventLog("i", capacity=0)


def test_concurrent_emitters_get_unique_contiguous_ids() -> None:
    log = EventLog("i", capacity=10_000)

    def work() -> None:
        for _ in range(200):
            log.emit(RankJoinedEvent, ranks=[0])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids = [e.event_id for e in log.since(0).events]
    assert ids == list(range(1, 801))


def test_wait_since_wakes_on_emit_and_times_out_otherwise() -> None:
    log = EventLog("i")
    t0 = time.monotonic()
    assert log.wait_since(0, timeout_s=0.02).events == []
    assert time.monotonic() - t0 >= 0.015

    timer = threading.Timer(0.01, lambda: log.emit(RankJoinedEvent, ranks=[3]))
    timer.start()
    batch = log.wait_since(0, timeout_s=60.0)  # returns at the emit; the bound is for a hang
    timer.join()
    assert [e.ranks for e in batch.events] == [[3]]


def test_format_sse_frame_parses_back_to_the_event() -> None:
    log = _log()
    event = log.emit(
        ScaleRequestedEvent, operation_id="op", old_ep_size=2, new_ep_size=3, ranks=[2]
    )
    frame = format_sse(event)
    lines = frame.split("\n")
    assert lines[0] == "id: 1"
    assert lines[1] == "event: scale_requested"
    assert lines[2].startswith("data: ")
    assert frame.endswith("\n\n") and frame.count("\n") == 4
    assert EVENT_ADAPTER.validate_python(json.loads(lines[2][6:])) == event


def test_sse_comment_and_last_event_id_parsing() -> None:
    assert format_sse_comment() == ": keepalive\n\n"
    assert format_sse_comment("a\nb") == ": a\n: b\n\n"
    assert parse_last_event_id(None) is None
    assert parse_last_event_id(" 42 ") == 42
    assert parse_last_event_id("-1") is None
    assert parse_last_event_id("abc") is None
    assert parse_last_event_id("") is None

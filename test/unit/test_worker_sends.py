"""The DP controller's sends to a worker socket with no peer (a dead joiner) do not block."""

from __future__ import annotations

import time

import pytest
import zmq

from sglang_elastic_ep.sglang import worker_sends


def plain_send(socket: zmq.Socket, obj: object, flags: int = 0) -> None:
    socket.send_pyobj(obj, flags=flags)


@pytest.fixture
def bound_push():
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield ctx, push, port
    finally:
        push.close(linger=0)
        ctx.term()


def test_no_peer_drops_with_a_warning_instead_of_blocking(
    bound_push, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, push, _ = bound_push
    monkeypatch.setattr(worker_sends, "elastic_ep_enabled", lambda: True)
    started = time.monotonic()
    assert worker_sends.send_to_worker(plain_send, push, {"rid": "r1"}) is None
    assert time.monotonic() - started < 1.0
    assert "has no peer" in caplog.text and "dropped dict" in caplog.text


def test_a_live_peer_still_receives(bound_push, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, push, port = bound_push
    monkeypatch.setattr(worker_sends, "elastic_ep_enabled", lambda: True)
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 5
        while True:  # the connection comes up asynchronously
            try:
                plain_send(push, "probe", zmq.NOBLOCK)
                break
            except zmq.Again:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        assert pull.recv_pyobj() == "probe"
        worker_sends.send_to_worker(plain_send, push, {"rid": "r2"})
        assert pull.recv_pyobj() == {"rid": "r2"}
    finally:
        pull.close(linger=0)


def test_without_elastic_ep_the_send_is_upstreams(bound_push, monkeypatch) -> None:
    _, push, _ = bound_push
    monkeypatch.setattr(worker_sends, "elastic_ep_enabled", lambda: False)
    seen: list[int] = []
    worker_sends.send_to_worker(lambda s, o, f=0: seen.append(f), push, "x")
    assert seen == [0]  # no NOBLOCK added

"""The DP controller's sends to a worker socket with no peer (a dead joiner) do not block."""

from __future__ import annotations

import pytest
import zmq

from sglang_elastic_ep.sglang import worker_sends
from sglang_elastic_ep_testbed.cluster.waits import wait_until


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
    # A blocking send with no peer would never return; the warning comes only from the
    # zmq.Again that a non-blocking one raises (no time limit needed to tell them apart).
    assert worker_sends.send_to_worker(plain_send, push, {"rid": "r1"}) is None
    assert "has no peer" in caplog.text and "dropped dict" in caplog.text


def test_a_live_peer_still_receives(bound_push, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx, push, port = bound_push
    monkeypatch.setattr(worker_sends, "elastic_ep_enabled", lambda: True)
    pull = ctx.socket(zmq.PULL)
    pull.connect(f"tcp://127.0.0.1:{port}")
    try:
        def probe_sent() -> bool:
            try:
                plain_send(push, "probe", zmq.NOBLOCK)
            except zmq.Again:
                return False
            return True

        # the connection comes up asynchronously
        wait_until(probe_sent, 30, "the PULL socket connected", poll_s=0.01)
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

"""A released scheduler's last ZeroMQ messages reach the HTTP process although it ends with
``os._exit`` (``tail_release.deliver_queued_messages``): a child process sends through a
``SenderWrapper``, as a scheduler answers a request, to a receiver that is not listening yet,
then leaves. With the delivery the answer arrives once the receiver binds; without it the
child's exit drops it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zmq

from sglang_elastic_ep_testbed.cluster.procs import free_ports

CHILD = """
import os, sys, zmq
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
from sglang_elastic_ep.sglang.tail_release import deliver_queued_messages

context = zmq.Context(2)
socket = context.socket(zmq.PUSH)
socket.connect(sys.argv[1])
sender = SenderWrapper(socket)
socket.send_pyobj({"answer": "drain confirmed"})
print("queued", flush=True)
flushed = deliver_queued_messages(linger_ms=20000) if sys.argv[2] == "deliver" else 0
print(flushed, flush=True)
os._exit(0)
"""


def _answer_after_leaving(deliver: bool) -> object | None:
    """Start the leaving child first; bind the receiver once it queued its answer (and, without
    the delivery, once it exited); what arrived."""
    address = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, address,
                              "deliver" if deliver else "drop"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "queued"
        if not deliver:
            child.wait(timeout=60)
        context = zmq.Context()
        receiver = context.socket(zmq.PULL)
        receiver.bind(address)
        try:
            if receiver.poll(15000):
                return receiver.recv_pyobj()
            return None
        finally:
            receiver.close(linger=0)
            context.term()
    finally:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0, out
        if deliver:
            assert out.strip() == "1", out  # one context: the socket's


@pytest.mark.timeout(120)
def test_a_leaving_scheduler_delivers_its_last_answer() -> None:
    assert _answer_after_leaving(deliver=True) == {"answer": "drain confirmed"}


@pytest.mark.timeout(120)
def test_without_the_delivery_the_exit_drops_the_answer() -> None:
    assert _answer_after_leaving(deliver=False) is None

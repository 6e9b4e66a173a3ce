"""Cheap idle ranks on the CPU engine.

With DP attention every idle scheduler still runs its loop, and each pass all-gathers token
counts with the other ranks: 2-rank clusters spun the machine's 2 cores at idle. Upstream's
``--sleep-on-idle`` parks a rank in ``zmq.Poller.poll(1000)``, which would delay the first
request by up to a second: the rank that receives it enters the all-gather at once, the others
only when their poll times out. Here an idle rank polls its request sockets with a short timeout
(``SGLANG_EEP_IDLE_POLL_MS``): the receiving rank wakes immediately and every other rank within
one timeout, so the first request waits at most that long. Measured on the 2-rank CPU cluster it
did not lower idle CPU (docs/benchmarks.md, ``idle_cpu``): the cores go to Mooncake's TCP
transport, which busy-polls while a rank waits in a collective. It is therefore off by default.
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV_IDLE_POLL_MS = "SGLANG_EEP_IDLE_POLL_MS"
DEFAULT_IDLE_POLL_MS = 0.0  # off: measured no gain (docs/benchmarks.md, idle_cpu)


def idle_poll_ms() -> float:
    raw = os.environ.get(ENV_IDLE_POLL_MS)
    if raw is None:
        return DEFAULT_IDLE_POLL_MS
    value = float(raw)
    if value < 0:
        raise ValueError(f"{ENV_IDLE_POLL_MS} must be >= 0 ms, got {raw}")
    return value


class ShortPollIdleSleeper:
    """Parks an idle scheduler on its request sockets for at most ``timeout_ms``."""

    def __init__(self, sockets: list[Any], timeout_ms: float) -> None:
        import zmq

        self.poller = zmq.Poller()
        for sock in sockets:
            if isinstance(sock, zmq.Socket):
                self.poller.register(sock, zmq.POLLIN)
        self.timeout_ms = timeout_ms

    def maybe_sleep(self) -> None:
        if self.poller.sockets:
            self.poller.poll(self.timeout_ms)
        else:  # no pollable socket on this rank: a plain short sleep bounds the delay the same
            time.sleep(self.timeout_ms / 1000)


def install_idle_sleeper(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_idle_sleeper``: a short-poll sleeper for every CPU rank, unless
    the user asked for upstream's own (``--sleep-on-idle``) or disabled ours (0 ms)."""
    if getattr(scheduler, "idle_sleeper", None) is not None:
        return
    timeout = idle_poll_ms()
    if timeout == 0:
        return
    channels = scheduler.ipc_channels
    sockets = [s for s in (channels.recv_from_tokenizer, channels.recv_from_rpc) if s is not None]
    scheduler.idle_sleeper = ShortPollIdleSleeper(sockets, timeout)


def dp_controller_event_loop(controller: Any) -> None:
    """REPLACE ``DataParallelController.event_loop``: upstream drains its socket with NOBLOCK
    reads in an endless loop (a quarter of a core at idle); here it blocks in ``poll`` until a
    request arrives (at most 50 ms, so the soft watchdog is still fed), then drains the same way."""
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    poller = zmq.Poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        poller.poll(50)
        while True:
            controller.soft_watchdog.feed()
            try:
                recv_req = dpc.sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(recv_req)

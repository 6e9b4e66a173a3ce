"""Shared helpers of the API tests: a fake clock and engine, an app, a real uvicorn server,
and the event stream read as the clients read it."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from httpx_sse import EventSource, ServerSentEvent

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.api.routes import build_router
from sglang_elastic_ep.core.operations import Operation
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.validation import ScaleTopology
from sglang_elastic_ep_testbed.cluster.waits import wait_until

INSTANCE = "inst-1"


def sse_messages(text: str, *, with_data_only: bool = True) -> list[ServerSentEvent]:
    """The messages of an event-stream body, decoded by httpx-sse as the CLI and the controller
    decode it; the blocks without data (the stream's opening retry:) are left out unless
    ``with_data_only`` is False."""
    response = httpx.Response(200, headers={"Content-Type": "text/event-stream"},
                              text=text)
    messages = list(EventSource(response).iter_sse())
    return [m for m in messages if m.data] if with_data_only else messages


UP_PHASES = (
    Phase.PENDING,
    Phase.JOINING,
    Phase.CONFIGURING_DATA_PLANE,
    Phase.SYNCING_NEW_WORLD,
)
DOWN_PHASES = (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeEngine:
    """Records the operations it is given; raises ``fail`` when set."""

    def __init__(self) -> None:
        self.ops: list[Operation] = []
        self.fail: Exception | None = None

    async def __call__(self, op: Operation) -> None:
        self.ops.append(op)
        if self.fail is not None:
            raise self.fail


class AutoEngine:
    """Walks every started operation through its phases on the server's loop, then ends it.

    ``error`` makes operations fail in their last phase; ``hold`` keeps them running until
    ``release`` is set.
    """

    def __init__(self, *, step_s: float = 0.02, error: str | None = None) -> None:
        self.plane: InProcessControlPlane | None = None
        self.step_s = step_s
        self.error = error
        self.hold = False
        self.release = threading.Event()
        self.ops: list[Operation] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, op: Operation) -> None:
        self.ops.append(op)
        task = asyncio.get_running_loop().create_task(self._run(op))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, op: Operation) -> None:
        assert self.plane is not None
        phases: Sequence[Phase] = UP_PHASES if op.new_ep_size > op.old_ep_size else DOWN_PHASES
        for phase in phases:
            await asyncio.sleep(self.step_s)
            self.plane.record_phase(op.operation_id, phase)
        while self.hold and not self.release.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(self.step_s)
        self.plane.finish_operation(op.operation_id, error=self.error)


def make_plane(
    *,
    max_ep_size: int = 8,
    initial: int = 2,
    attn_replica_size: int = 1,
    engine: Any = None,
    clock: Clock | None = None,
    launch_size: int | None = None,
    ranks_per_node: int = 1,
    **kwargs: Any,
) -> InProcessControlPlane:
    ids = iter(f"gen-{i}" for i in range(1000))
    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=max_ep_size, attn_replica_size=attn_replica_size,
                               launch_size=launch_size, ranks_per_node=ranks_per_node),
        initial_ep_size=initial,
        engine=engine,
        instance_id=INSTANCE,
        clock=clock or Clock(),
        new_operation_id=lambda: next(ids),
        **kwargs,
    )
    if isinstance(engine, AutoEngine):
        engine.plane = plane
    return plane


def make_app(plane: InProcessControlPlane, **router_kwargs: Any) -> FastAPI:
    app = FastAPI()
    app.include_router(build_router(plane, **router_kwargs))
    return app


@contextmanager
def live_server(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free localhost port in a thread; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> bool:
        if not server.started and not thread.is_alive():
            raise RuntimeError("uvicorn exited before it started")
        return server.started

    wait_until(started, 60, "uvicorn started", poll_s=0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def free_port() -> int:
    """A port nothing listens on (bound then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

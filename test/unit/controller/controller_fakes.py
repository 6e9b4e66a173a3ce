"""Fakes for the controller loop tests: an HTTP server over a real control plane, a launcher."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import httpx

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.controller.launchers.base import within
from sglang_elastic_ep.core.api_models import ScaleRequest
from sglang_elastic_ep.core.controller import JoinerSpec, Launch
from sglang_elastic_ep.core.events import format_sse
from sglang_elastic_ep.core.operations import Operation
from sglang_elastic_ep.core.validation import ScaleTopology

URL = "http://eep.test:30000"


def make_plane(instance: str = "inst-1", initial: int = 2, max_ep_size: int = 8,
               event_capacity: int = 1024) -> InProcessControlPlane:
    ids = iter(f"gen-{i}" for i in range(1000))
    planes: list[InProcessControlPlane] = []

    async def drop_at_once(op: Operation) -> tuple[bool, str]:
        """The schedulers take the cancel and drop the scale before the answer returns."""
        planes[0].finish_operation(op.operation_id, error=f"scale-up to {op.new_ep_size} cancelled")
        return True, "cancel requested"

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=max_ep_size), initial_ep_size=initial,
        instance_id=instance, new_operation_id=lambda: next(ids), event_capacity=event_capacity,
        canceller=drop_at_once,
    )
    planes.append(plane)
    return plane


def metrics_text(queued: float, running: float, shards: int = 2,
                 kv: float | None = None) -> str:
    lines = ["# TYPE sglang:num_queue_reqs gauge", "# TYPE sglang:num_running_reqs gauge"]
    for dp in range(shards):
        labels = f'dp_rank="{dp}",model_name="m",tp_rank="{dp}"'
        lines.append(f"sglang:num_queue_reqs{{{labels}}} {queued}")
        lines.append(f"sglang:num_running_reqs{{{labels}}} {running}")
        if kv is not None:
            lines.append(f"sglang:token_usage{{{labels}}} {kv}")
    return "\n".join(lines) + "\n"


class FakeServer:
    """The elastic EP endpoints of one server, answered by ``handle`` (an httpx transport).

    The event stream sends what is buffered after ``Last-Event-ID`` (at most
    ``events_per_connection``) and then ends, like a connection that drops: the client must
    reconnect and resume.
    """

    def __init__(self, plane: InProcessControlPlane) -> None:
        self.plane = plane
        self.metrics = metrics_text(0, 0)
        self.requests: list[httpx.Request] = []
        self.events_per_connection: int | None = None
        self.fail_next: dict[str, int] = {}  # path -> how many requests get a ConnectError
        self.down = False

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def paths(self, method: str | None = None) -> list[str]:
        return [r.url.path for r in self.requests if method is None or r.method == method]

    def posts(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests
                if r.method == "POST" and r.url.path == "/scale_elastic_ep"]

    def event_resume_ids(self) -> list[str | None]:
        return [r.headers.get("last-event-id") for r in self.requests
                if r.url.path == "/elastic_ep/events"]

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.fail_next.get(path, 0) > 0:
            self.fail_next[path] -= 1
            raise httpx.ConnectError("connection reset", request=request)
        plane = self.plane
        if path == "/elastic_ep/status":
            return httpx.Response(200, json=plane.status().model_dump(mode="json"))
        if path == "/elastic_ep/health":
            return httpx.Response(200, json=plane.health().model_dump(mode="json"))
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics)
        if path == "/scale_elastic_ep" and request.method == "POST":
            body = ScaleRequest.model_validate(json.loads(request.content))
            answer = asyncio.run(plane.request_scale(body))
            return httpx.Response(answer.status, json=answer.response.model_dump(mode="json"))
        if path.startswith("/scale_elastic_ep/") and request.method == "DELETE":
            cancel = asyncio.run(plane.cancel_operation(path.rsplit("/", 1)[1]))
            return httpx.Response(cancel.status, json=cancel.response.model_dump(mode="json"))
        if path == "/elastic_ep/events":
            return self._events(request)
        return httpx.Response(404, json={"error": "not found"})

    def _events(self, request: httpx.Request) -> httpx.Response:
        given = request.headers.get("last-event-id")
        follow = request.url.params.get("follow", "true") == "true"
        start = int(given) if given else (self.plane.events.last_event_id if follow else 0)
        batch = self.plane.events.since(start)
        frames = ["retry: 10\n: instance " + self.plane.instance_id + "\n\n"]
        if batch.missed:
            notice = {"type": "missed", "instance_id": self.plane.instance_id,
                      "last_event_id": batch.last_event_id}
            frames.append(f"id: {batch.last_event_id}\nevent: missed\n"
                          f"data: {json.dumps(notice)}\n\n")
        events = batch.events
        if follow and self.events_per_connection is not None:
            events = events[: self.events_per_connection]
        frames.extend(format_sse(e) for e in events)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content="".join(frames).encode())


class MemoryLauncher:
    """A launcher that only remembers: what it was asked, and what 'runs'."""

    name = "memory"

    def __init__(self, clock: Callable[[], float] = lambda: 0.0) -> None:
        self.launches: list[Launch] = []
        self.calls: list[tuple[str, Any]] = []
        self._clock = clock

    def launch_joiner(self, spec: JoinerSpec) -> Launch:
        self.calls.append(("launch", spec))
        return self._start(spec)

    def launch_replacement(self, spec: JoinerSpec, *, stuck: bool = False) -> Launch:
        self.calls.append(("replace_stuck" if stuck else "replace", spec))
        self._stop(spec.ranks)
        return self._start(spec)

    def terminate(self, ranks: Collection[int]) -> list[Launch]:
        self.calls.append(("terminate", tuple(ranks)))
        return self._stop(ranks)

    def list(self) -> list[Launch]:
        return list(self.launches)

    def exit(self, handle: str, code: int | None = 0) -> None:
        """The process ended by itself."""
        self.launches = [replace(x, alive=False, exit_code=code) if x.handle == handle else x
                         for x in self.launches]

    def _start(self, spec: JoinerSpec) -> Launch:
        launch = Launch(handle=f"j{len(self.launches)}", rank_offset=spec.rank_offset,
                        num_ranks=spec.num_ranks, mode=spec.mode,
                        operation_id=spec.operation_id, alive=True, started_at=self._clock())
        self.launches.append(launch)
        return launch

    def _stop(self, ranks: Collection[int]) -> list[Launch]:
        stopped = [x for x in self.launches if x.alive and within(x, ranks)]
        for launch in stopped:
            self.exit(launch.handle)
        return stopped

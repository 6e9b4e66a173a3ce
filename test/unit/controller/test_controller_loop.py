"""The controller loop against a fake HTTP server (httpx.MockTransport over a real control
plane): what it reads, what it POSTs, what it asks the launcher, and the event stream."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from typing import Any

import pytest
from controller_fakes import URL, FakeServer, MemoryLauncher, make_plane, metrics_text
from httpx_sse import ServerSentEvent
from rich.console import Console

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.controller.launchers.base import LauncherError
from sglang_elastic_ep.controller.loop import ControllerLoop, EventFollower, LoopSettings
from sglang_elastic_ep.core.api_models import ScaleRequest
from sglang_elastic_ep.core.autoscaler import AutoscalerConfig
from sglang_elastic_ep.core.controller import (
    ControllerConfig,
    ElasticController,
    JoinerSpec,
    JoinMode,
    Launch,
    Relaunch,
    ScaleTo,
)
from sglang_elastic_ep.core.phases import Phase

HOT = metrics_text(queued=10, running=10)  # 20 per rank
QUIET = metrics_text(queued=0, running=1)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def controller(**kw: Any) -> ElasticController:
    policy = dict(min_size=2, max_size=4, scale_up_load=8, scale_down_load=2, up_window_s=0,
                  down_window_s=0, cooldown_s=0, max_step_up=1)
    policy.update(kw.pop("policy", {}))
    kw.setdefault("launch_size", 2)
    return ElasticController(ControllerConfig(policy=AutoscalerConfig(**policy), **kw))


def make_loop(
    server: FakeServer,
    launcher: MemoryLauncher,
    *,
    ctl: ElasticController | None = None,
    clock: Clock | None = None,
    **settings: Any,
) -> tuple[ControllerLoop, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    loop = ControllerLoop(
        ctl or controller(), launcher, LoopSettings(url=URL, **settings), console=console,
        transport=server.transport, clock=clock or Clock(), sleep=lambda s: None,
    )
    return loop, out


def test_hot_load_posts_a_scale_up_then_launches_its_joiner() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    launcher = MemoryLauncher()
    loop, out = make_loop(server, launcher)

    decision = loop.tick()
    assert [type(a) for a in decision.actions] == [ScaleTo]
    assert server.posts() == [{"new_ep_size": 3, "operation_id": "ctl-1-grow-to-3",
                               "expected_instance_id": "inst-1"}]
    assert plane.status().current_operation is not None  # the server admitted it

    loop.tick()  # the status shows rank 2 pending: its joiner is launched
    (call,) = launcher.calls
    assert call[0] == "launch"
    spec = call[1]
    assert (spec.rank_offset, spec.num_ranks, spec.mode, spec.operation_id, spec.ep_size) == (
        2, 1, JoinMode.SCALE, "ctl-1-grow-to-3", 3)
    loop.tick()
    assert len(launcher.calls) == 1  # once
    assert len(server.posts()) == 1  # one operation at a time

    plane.record_phase("ctl-1-grow-to-3", Phase.PENDING)
    plane.finish_operation("ctl-1-grow-to-3")
    server.metrics = metrics_text(queued=2, running=3)  # 5 per rank: inside the band
    loop.tick()
    assert len(server.posts()) == 1
    text = out.getvalue()
    assert "POST new_ep_size=3 (ctl-1-grow-to-3): grow 2 -> 3: load 20.00/rank > 8" in text
    assert "load_per_rank=20.0" in text  # the decision's inputs are logged with it
    assert "ctl-1-grow-to-3: HTTP 200" in text
    assert "launch joiner for rank(s) 2 (ctl-1-grow-to-3)" in text
    loop.close()


def test_dry_run_decides_and_logs_but_never_posts_or_launches() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    launcher = MemoryLauncher()
    loop, out = make_loop(server, launcher, dry_run=True, json_log=True)
    decision = loop.tick()
    assert [a.target for a in decision.actions if isinstance(a, ScaleTo)] == [3]
    assert server.posts() == [] and launcher.calls == []
    assert plane.status().current_operation is None
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    (scale,) = [r for r in records if r["type"] == "scale"]
    assert scale["dry_run"] is True and scale["target"] == 3
    assert scale["message"].startswith("would POST new_ep_size=3")
    assert scale["inputs"]["load_per_rank"] == 20.0
    loop.close()


def test_post_is_retried_on_network_errors_with_the_same_operation_id() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    server.fail_next["/scale_elastic_ep"] = 2
    loop, _ = make_loop(server, MemoryLauncher(), retries=3)
    loop.tick()
    attempts = [r for r in server.requests if r.url.path == "/scale_elastic_ep"]
    assert len(attempts) == 3
    assert {json.loads(r.content)["operation_id"] for r in attempts} == {"ctl-1-grow-to-3"}
    assert [op.operation_id for op in [plane.status().current_operation] if op] == [
        "ctl-1-grow-to-3"]
    loop.close()


def test_an_unreachable_server_is_a_hold_said_once() -> None:
    server = FakeServer(make_plane())
    server.down = True
    launcher = MemoryLauncher()
    loop, out = make_loop(server, launcher, retries=1)
    for _ in range(3):
        decision = loop.tick()
        assert decision.actions == () and "cannot read the status" in decision.holds[0].reason
    assert out.getvalue().count("cannot read the status") == 1
    assert launcher.calls == []
    loop.close()


def test_a_failed_rank_is_relaunched_then_removed_and_regrown_across_a_controller_restart(
) -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = QUIET
    launcher = MemoryLauncher()
    clock = Clock()
    # The deployment grew to 3 earlier; rank 2 is a joiner this launcher runs.
    loop, out = make_loop(server, launcher, clock=clock, ctl=controller(max_relaunches=1))
    server.metrics = HOT
    loop.tick()
    loop.tick()
    plane.finish_operation("ctl-1-grow-to-3")
    server.metrics = metrics_text(queued=2, running=3)
    (joiner,) = launcher.launches

    # Rank 2 dies: relaunched in recover mode (its old process replaced).
    plane.report_rank_failed([2], "heartbeat lost")
    plane.report_recovery_required([2], "heartbeat lost")
    loop.follower.connect_once()  # the stream delivers them (then drops)
    decision = loop.tick()
    assert [type(a) for a in decision.actions] == [Relaunch]
    assert launcher.calls[-1][0] == "replace"
    failed_event = plane.events.last_event_id - 1  # rank_failed, then recovery_required
    assert launcher.calls[-1][1].operation_id == f"ctl-recover-r2-e{failed_event}-1"
    plane.report_rank_recovered([2])
    loop.tick()
    loop.close()

    # It fails again; meanwhile the controller restarted: a new one, nothing in memory.
    plane.report_rank_failed([2], "heartbeat lost")
    fresh, out2 = make_loop(server, launcher, clock=clock, ctl=controller(max_relaunches=1))
    fresh.prime()  # the event buffer: rank 2 failed twice
    decision = fresh.tick()
    (removal,) = decision.actions
    assert isinstance(removal, ScaleTo) and removal.operation_id == "ctl-2-remove-to-2"
    assert server.posts()[-1] == {"new_ep_size": 2, "operation_id": "ctl-2-remove-to-2",
                                  "expected_instance_id": "inst-1"}
    assert plane.status().current_operation is not None  # the failed tail's removal: admitted

    plane.finish_operation("ctl-2-remove-to-2")
    assert plane.status().safe_to_terminate_ranks == [2]
    fresh.tick()  # terminate exactly rank 2's process
    assert launcher.calls[-1] == ("terminate", (2,))
    assert not any(x.alive for x in launcher.launches)
    fresh.tick()  # then regrow to 3, and launch a new joiner for it
    assert server.posts()[-1]["operation_id"] == "ctl-3-regrow-to-3"
    fresh.tick()
    assert launcher.calls[-1][0] == "launch"
    assert launcher.calls[-1][1].operation_id == "ctl-3-regrow-to-3"
    assert joiner.handle != launcher.launches[-1].handle
    assert "failed 2 times (> --max-relaunches 1)" in out2.getvalue()
    fresh.close()


def test_event_stream_reconnects_with_last_event_id_and_delivers_each_event_once() -> None:
    plane = make_plane()
    for rank in (0, 1, 0, 1, 0):
        plane.report_rank_joined([rank])
    server = FakeServer(plane)
    server.events_per_connection = 2  # the connection drops after two events
    got: list[ServerSentEvent] = []
    stop = threading.Event()
    loop, _ = make_loop(server, MemoryLauncher())
    follower = EventFollower(loop.events_client, got.append, stop=stop)

    follower.connect_once()
    follower.connect_once()
    server.fail_next["/elastic_ep/events"] = 1  # one reconnect fails at the network

    def sleep(_: float) -> None:
        if follower.connections >= 5:
            stop.set()

    follower._sleep = sleep
    follower.run()
    assert [m.id for m in got] == ["1", "2", "3", "4", "5"]
    assert server.event_resume_ids()[:5] == ["0", "2", "4", "4", "5"]
    assert follower.retry_s == 0.01  # the server's retry: field
    loop.close()


def test_a_restarted_server_is_replayed_from_its_first_event() -> None:
    old = make_plane("inst-old")
    for rank in range(4):
        old.report_rank_joined([rank])
    server = FakeServer(old)
    got: list[ServerSentEvent] = []
    loop, _ = make_loop(server, MemoryLauncher())
    follower = EventFollower(loop.events_client, got.append, stop=threading.Event())
    follower.connect_once()
    assert [m.id for m in got] == ["1", "2", "3", "4"]

    # Restarted with 6 events already: resuming after 4 would skip its events 1-4.
    new = make_plane("inst-new")
    for rank in range(6):
        new.report_rank_joined([rank])
    server.plane = new
    follower.connect_once()
    follower.connect_once()
    new_ids = [m.id for m in got[4:]]
    assert new_ids == ["1", "2", "3", "4", "5", "6"]
    assert server.event_resume_ids() == ["0", "4", "0"]

    # Restarted again with fewer events than the last id: the server opens with 'missed',
    # from the new instance, and the follower replays that instance from its start.
    newer = make_plane("inst-newer")
    newer.report_rank_joined([0])
    server.plane = newer
    follower.connect_once()
    follower.connect_once()
    assert [(m.event, m.id) for m in got[10:]] == [("rank_joined", "1")]
    assert server.event_resume_ids()[3:] == ["6", "0"]
    loop.close()


def test_events_lost_from_the_servers_buffer_keep_the_counts_already_made() -> None:
    plane = make_plane(initial=3, event_capacity=2)
    server = FakeServer(plane)
    loop, out = make_loop(server, MemoryLauncher(), ctl=controller(max_relaunches=1))
    plane.report_rank_failed([2], "x")  # event 1
    plane.report_rank_recovered([2])  # event 2
    loop.prime()  # counted: one failure of rank 2
    plane.report_rank_failed([2], "x")  # 3: lost from the 2-event buffer
    plane.report_rank_recovered([2])  # 4
    plane.report_rank_failed([2], "x")  # 5
    loop.follower.connect_once()
    assert server.event_resume_ids()[-1] == "2"
    decision = loop.tick()
    assert "events were missed" in out.getvalue()
    # At least 2 failures (1 and 5) > --max-relaunches 1: the rank is removed.
    assert [a.operation_id for a in decision.actions if isinstance(a, ScaleTo)] == [
        "ctl-1-remove-to-2"]
    loop.close()


def test_loop_feeds_events_to_the_controller_and_survives_junk() -> None:
    plane = make_plane(initial=3)
    plane.report_rank_failed([2], "x")
    server = FakeServer(plane)
    ctl = controller(max_relaunches=0)
    loop, _ = make_loop(server, MemoryLauncher(), ctl=ctl)
    loop._deliver(ServerSentEvent("message", "not json"))
    loop._deliver(ServerSentEvent("future_event", json.dumps({"type": "future_event"}), "9"))
    loop.prime()
    decision = loop.tick()
    assert [a.target for a in decision.actions if isinstance(a, ScaleTo)] == [2]
    loop.close()


def test_run_once_primes_then_posts_and_launches_the_joiner_and_returns() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    launcher = MemoryLauncher()
    loop, _ = make_loop(server, launcher)
    loop.run(once=True)
    assert server.paths()[0] == "/elastic_ep/events"
    assert [p["new_ep_size"] for p in server.posts()] == [3]
    assert [(kind, spec.rank_offset) for kind, spec in launcher.calls] == [("launch", 2)]
    loop.close()


@pytest.mark.parametrize("down_for", [0, 2])
def test_run_stops_when_asked(down_for: int) -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.fail_next["/elastic_ep/status"] = down_for
    loop, _ = make_loop(server, MemoryLauncher(), poll_interval_s=0.01, retries=0)
    ticks = 0
    original = loop.tick

    def counting_tick() -> Any:
        nonlocal ticks
        ticks += 1
        if ticks >= 4:
            loop.request_stop()
        return original()

    loop.tick = counting_tick  # type: ignore[method-assign]
    loop.run()
    assert ticks == 4 and loop.stop.is_set()


class BrokenLauncher(MemoryLauncher):
    def launch_joiner(self, spec: JoinerSpec) -> Launch:
        self.calls.append(("launch", spec))
        raise LauncherError("no such image")


def test_a_failing_action_is_logged_and_retried_at_the_poll_pace_not_in_a_tight_loop() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    launcher = BrokenLauncher()
    loop, out = make_loop(server, launcher, poll_interval_s=0.01)
    asyncio_run_scale(plane, 3)
    waits: list[float] = []
    original_wait = loop._wake.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout or 0.0)
        if len(waits) >= 3:
            loop.request_stop()
        return original_wait(0)

    loop._wake.wait = wait  # type: ignore[method-assign]
    loop.run()
    assert len(launcher.calls) == 3  # one failed launch per poll, each followed by a wait
    assert out.getvalue().count("failed: no such image") == 3


def test_dry_run_prints_a_repeated_decision_once() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    asyncio_run_scale(plane, 3)  # someone else's scale-up: its joiner 'would' be launched
    loop, out = make_loop(server, MemoryLauncher(), dry_run=True)
    for _ in range(3):
        loop.tick()
    assert out.getvalue().count("would launch joiner for rank(s) 2") == 1
    loop.close()


def asyncio_run_scale(plane: InProcessControlPlane, size: int) -> None:
    """Someone else's scale request, straight to the control plane."""
    answer = asyncio.run(plane.request_scale(ScaleRequest(new_ep_size=size, operation_id="ext")))
    assert answer.status == 200


def test_load_from_several_metrics_urls_and_the_api_key_only_to_the_server() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    loop, _ = make_loop(server, MemoryLauncher(), api_key="sekret",
                        metrics_urls=(f"{URL}/metrics", "http://joiner.test:31002/metrics"))
    decision = loop.tick()
    scale = [a for a in decision.actions if isinstance(a, ScaleTo)]
    assert [a.inputs["load_per_rank"] for a in scale] == [20.0]
    auth = {(r.url.host, r.url.path): r.headers.get("authorization") for r in server.requests}
    assert auth[("eep.test", "/elastic_ep/status")] == "Bearer sekret"
    assert auth[("eep.test", "/metrics")] == "Bearer sekret"
    assert auth[("joiner.test", "/metrics")] is None
    loop.close()


def test_a_joiner_that_ends_is_reported_once_with_its_exit_code() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    launcher = MemoryLauncher()
    loop, out = make_loop(server, launcher)
    loop.tick()  # POST
    loop.tick()  # the joiner for rank 2 is launched
    loop.tick()  # and seen running
    (launch,) = launcher.list()
    launcher.exit(launch.handle, code=0)
    loop.tick()
    loop.tick()
    text = out.getvalue()
    assert text.count(f"joiner {launch.handle} for rank(s) 2 exited with code 0") == 1
    loop.close()


def test_a_scale_up_whose_joiner_dies_before_the_commit_is_cancelled_not_waited_out() -> None:
    plane = make_plane()
    server = FakeServer(plane)
    server.metrics = HOT
    launcher = MemoryLauncher()
    loop, out = make_loop(server, launcher)
    loop.tick()  # POST ctl-1-grow-to-3
    loop.tick()  # its joiner is launched
    (launch,) = launcher.list()
    launcher.exit(launch.handle, code=1)  # the joiner died at start-up
    loop.tick()
    assert server.paths("DELETE") == ["/scale_elastic_ep/ctl-1-grow-to-3"]
    status = plane.status()
    assert status.current_operation is None and status.effective_ep_size == 2
    assert status.recent_operations[0].result.value == "cancelled"
    assert status.safe_to_terminate_ranks == [2]
    text = out.getvalue()
    assert "DELETE /scale_elastic_ep/ctl-1-grow-to-3" in text and "HTTP 200" in text
    loop.close()

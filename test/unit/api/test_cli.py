"""``sglang-eep`` against a real uvicorn server on a free port (no SGLang)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from eep_api_helpers import (
    INSTANCE,
    AutoEngine,
    free_port,
    live_server,
    make_app,
    make_plane,
    sse_messages,
)

from sglang_elastic_ep.api.auth import sglang_admin_auth
from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.cli.main import (
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    main,
)
from sglang_elastic_ep.core.api_models import RankPosition
from sglang_elastic_ep.core.events import EventBatch
from sglang_elastic_ep_testbed.cluster.waits import wait_until


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_EEP_API_KEY", raising=False)
    monkeypatch.delenv("SGLANG_EEP_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


class Server:
    def __init__(self, plane: InProcessControlPlane, engine: AutoEngine, url: str) -> None:
        self.plane, self.engine, self.url = plane, engine, url


@contextmanager
def serving(engine: AutoEngine, *, initial: int = 2, launch_size: int | None = None,
            **router_kwargs: Any) -> Iterator[Server]:
    plane = make_plane(engine=engine, initial=initial, launch_size=launch_size, clock=time.time)
    try:
        with live_server(make_app(plane, **router_kwargs)) as url:
            yield Server(plane, engine, url)
    finally:
        engine.release.set()


@pytest.fixture
def server() -> Iterator[Server]:
    with serving(AutoEngine()) as srv:
        yield srv


def run(*argv: str) -> int:
    return main(list(argv))


def test_scale_wait_follows_phases_and_exits_0(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run("scale", "--url", server.url, "--to", "4", "--wait", "--poll-interval", "0.02",
               "--operation-id", "cli-up")
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "Scaling initiated from 2 to 4" in out
    for phase in ("pending", "joining", "configuring_data_plane", "syncing_new_world",
                  "serving_expanded"):
        assert f"-> {phase}" in out
    assert "done: 2 -> 4" in out
    assert server.plane.status().effective_ep_size == 4
    assert [op.operation_id for op in server.engine.ops] == ["cli-up"]


def test_scale_down_wait_prints_ranks_safe_to_terminate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving(AutoEngine(), initial=4) as srv:
        code = run("scale", "--url", srv.url, "--to", "2", "--wait", "--poll-interval", "0.02")
        out = capsys.readouterr().out
        assert code == EXIT_OK, out
        assert "ranks safe to terminate: [2, 3]" in out


def test_scale_remove_names_the_ranks_and_a_hole_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving(AutoEngine(), initial=4, launch_size=2) as srv:
        # The top joiner with a rank below: a tail let go, and a hole, in one request.
        code = run("scale", "--url", srv.url, "--remove", "1", "3")
        out = capsys.readouterr().out
        assert code == EXIT_USAGE, out
        assert '{"remove_ranks": [2, 3]}' in out
        code = run("scale", "--url", srv.url, "--remove", "3", "2", "--wait",
                   "--poll-interval", "0.02")
        out = capsys.readouterr().out
        assert code == EXIT_OK, out
        assert "ranks safe to terminate: [2, 3]" in out


def test_scale_without_wait_exits_0_once_accepted(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    server.engine.hold = True
    assert run("scale", "--url", server.url, "--to", "3") == EXIT_OK
    assert "Scaling initiated from 2 to 3" in capsys.readouterr().out
    assert server.plane.status().current_operation is not None


def test_failed_operation_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(AutoEngine(error="joiner 3 crashed")) as srv:
        code = run("scale", "--url", srv.url, "--to", "4", "--wait", "--poll-interval", "0.02")
        out = capsys.readouterr().out
        assert code == EXIT_FAILED, out
        assert "failed in phase syncing_new_world: joiner 3 crashed" in out
        # Retrying the failed id without --wait still reports the failure.
        op_id = srv.plane.status().recent_operations[0].operation_id
        assert run("scale", "--url", srv.url, "--to", "4", "--operation-id", op_id) == EXIT_FAILED
        assert "has since failed" in capsys.readouterr().out


def test_retry_with_the_same_operation_id_is_idempotent(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("scale", "--url", server.url, "--to", "4", "--operation-id", "same", "--wait",
            "--poll-interval", "0.02")
    assert run(*args) == EXIT_OK
    assert run(*args) == EXIT_OK
    assert len(server.engine.ops) == 1


def test_conflicts_exit_3(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    server.engine.hold = True
    assert run("scale", "--url", server.url, "--to", "4") == EXIT_OK
    capsys.readouterr()
    assert run("scale", "--url", server.url, "--to", "6") == EXIT_CONFLICT
    assert "conflict (HTTP 409)" in capsys.readouterr().out
    assert run("scale", "--url", server.url, "--to", "4",
               "--expected-instance-id", "someone-else") == EXIT_CONFLICT
    assert "HTTP 412" in capsys.readouterr().out
    assert len(server.engine.ops) == 1


def test_invalid_target_exits_2(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("scale", "--url", server.url, "--to", "9") == EXIT_USAGE
    assert "--max-ep-size" in capsys.readouterr().out
    assert server.engine.ops == []


@pytest.mark.parametrize(
    "argv",
    [
        ["scale", "--url", "http://127.0.0.1:1", "--to", "0"],
        ["scale", "--url", "http://127.0.0.1:1", "--to", "two"],
        ["scale", "--url", "http://127.0.0.1:1"],
        ["scale", "--to", "4"],
        ["events", "--url", "http://127.0.0.1:1", "--last-event-id", "-1"],
        ["frobnicate"],
        [],
    ],
)
def test_bad_usage_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(*argv) == EXIT_USAGE
    assert "usage" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--help") == EXIT_OK
    assert "exit codes: 0 done, 1 failed, 2 bad usage, 3 conflict" in capsys.readouterr().out


def test_unreachable_server_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert run("scale", "--url", url, "--to", "4", "--retries", "1") == EXIT_FAILED
    captured = capsys.readouterr()
    assert "retrying with the same id" in captured.out
    assert "cannot reach" in captured.err
    assert run("status", "--url", url) == EXIT_FAILED
    assert run("events", "--url", url) == EXIT_FAILED


def test_api_key(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with serving(AutoEngine(), api_key_check=sglang_admin_auth(None, "k-admin")) as srv:
        assert run("scale", "--url", srv.url, "--to", "4") == EXIT_USAGE
        assert "--api-key" in capsys.readouterr().out
        assert run("status", "--url", srv.url) == EXIT_USAGE
        assert run("events", "--url", srv.url) == EXIT_USAGE
        assert srv.engine.ops == []
        assert run("scale", "--url", srv.url, "--to", "4", "--api-key", "k-admin", "--wait",
                   "--poll-interval", "0.02") == EXIT_OK
        monkeypatch.setenv("SGLANG_EEP_API_KEY", "k-admin")
        assert run("status", "--url", srv.url) == EXIT_OK


def test_status_table_and_json(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    server.plane.report_rank_failed([1], "heartbeat lost")
    assert run("status", "--url", server.url) == EXIT_OK
    out = capsys.readouterr().out
    assert INSTANCE in out and "2 (max 8)" in out
    assert "failed" in out and "inactive" in out
    assert run("status", "--url", server.url, "--json") == EXIT_OK
    status = json.loads(capsys.readouterr().out)
    assert status["ranks"][1]["state"] == "failed"


def test_status_shows_a_stall_and_where_each_scheduler_is(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    positions = [RankPosition(rank=0, step="gather", in_step_s=75.0, passes=41, report_age_s=0.4),
                 RankPosition(rank=1, step="forward", in_step_s=80.0, passes=40,
                              report_age_s=0.6)]
    server.plane.observe_stall(time.time() - 75.0, waiting_requests=3, positions=positions)
    assert run("status", "--url", server.url) == EXIT_OK
    out = capsys.readouterr().out
    assert "stalled" in out and "3 requests wait" in out and "ranks [0] in step 'gather'" in out
    # Rank 1, a pass behind, holds rank 0 up: it is the one to relaunch.
    assert any(line.replace("│", " ").split()[:4] == ["to", "relaunch", "[1]", "(end"]
               for line in out.splitlines()), out
    cells = [line.replace("│", " ").split() for line in out.splitlines()]
    rows = {row[0]: row for row in cells if row and row[0] in ("0", "1")}
    assert rows["0"][1:] == ["active", "gather", "75", "s", "41", "0", "s"], out
    assert rows["1"][1:] == ["active", "forward", "80", "s", "40", "1", "s"], out
    # Once the schedulers answer, neither the row nor the columns are shown.
    server.plane.observe_stall(None, waiting_requests=0)
    assert run("status", "--url", server.url) == EXIT_OK
    out = capsys.readouterr().out
    assert "stalled" not in out and "gather" not in out


def test_events_backlog(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    server.plane.report_rank_failed([1], "heartbeat lost")
    server.plane.report_recovery_required([1], "heartbeat lost")
    assert run("events", "--url", server.url) == EXIT_OK
    out = capsys.readouterr().out
    assert "#1" in out and "rank_failed" in out and "reason=heartbeat lost" in out
    assert "#2" in out and "recovery_required" in out
    assert run("events", "--url", server.url, "--json", "--last-event-id", "1") == EXIT_OK
    lines = capsys.readouterr().out.strip().splitlines()
    assert [json.loads(line)["event_id"] for line in lines] == [2]


def test_events_follow_prints_new_events(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with serving(AutoEngine(step_s=0.05), poll_interval_s=0.02) as srv:
        # The stream reads the log with since(): once it does, the follower is connected and
        # what happens next reaches it live.
        streaming = threading.Event()
        since = srv.plane.events.since

        def since_and_tell(last_event_id: int) -> EventBatch:
            streaming.set()
            return since(last_event_id)

        monkeypatch.setattr(srv.plane.events, "since", since_and_tell)
        codes: list[int] = []
        follower = threading.Thread(target=lambda: codes.append(run(
            "events", "--url", srv.url, "--follow", "--json", "--max-events", "2",
            "--last-event-id", "0")), daemon=True)
        follower.start()
        wait_until(streaming.is_set, 60, "the follower streaming", poll_s=0.01)
        assert run("scale", "--url", srv.url, "--to", "4") == EXIT_OK
        follower.join(60)
        assert codes == [EXIT_OK]
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert [json.loads(line)["type"] for line in lines] == [
            "scale_requested", "scale_committed"
        ]


def test_the_clients_decoder_reads_the_servers_frames_as_they_expect() -> None:
    """The CLI and the controller read the stream with httpx-sse: the server's opening block
    (retry: and a comment, no data) must reach them as a message without data that carries
    the retry, and every event with its own id."""
    text = (
        "retry: 1500\n: instance inst-1\n\n"
        "id: 7\nevent: rank_failed\ndata: {\"a\":\ndata: 1}\n\n"
        ": keepalive\n\n"
        "id: 8\nevent: missed\ndata: {}\n\n"
    )
    messages = sse_messages(text, with_data_only=False)
    assert [(m.data, m.retry) for m in messages[:1]] == [("", 1500)]
    assert [(m.event, m.data, m.id) for m in messages if m.data] == [
        ("rank_failed", '{"a":\n1}', "7"),
        ("missed", "{}", "8"),
    ]


def test_cancel_exits_0_when_cancelled_3_when_committed_2_when_unknown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import asyncio

    engine = AutoEngine()
    engine.hold = True
    holder: list[InProcessControlPlane] = []

    async def canceller(op: Any) -> tuple[bool, str]:
        asyncio.get_running_loop().call_later(
            0.05, lambda: holder[0].finish_operation(op.operation_id, error="cancelled"))
        return True, "cancel requested"

    plane = make_plane(engine=engine, clock=time.time, canceller=canceller)
    holder.append(plane)
    engine.plane = plane
    try:
        with live_server(make_app(plane)) as url:
            assert run("scale", "--url", url, "--to", "4", "--operation-id", "up") == EXIT_OK
            capsys.readouterr()
            assert run("cancel", "--url", url, "up") == EXIT_OK
            assert "cancelled" in capsys.readouterr().out
            assert run("cancel", "--url", url, "up") == EXIT_OK  # idempotent
            assert run("cancel", "--url", url, "nope") == EXIT_USAGE
            assert "HTTP 404" in capsys.readouterr().out
            assert plane.status().effective_ep_size == 2
    finally:
        engine.release.set()

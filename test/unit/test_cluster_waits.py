"""The one wait helper (cluster/waits.py) and the cluster waits built on it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import LoadClient, RequestResult
from sglang_elastic_ep_testbed.cluster.observe import (
    WebhookReceiver,
    status,
    wait_each_shard_serves,
)
from sglang_elastic_ep_testbed.cluster.procs import free_port, kill_tree, stop_tree
from sglang_elastic_ep_testbed.cluster.waits import wait_until


def test_wait_until_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, [], "ready"])
    assert wait_until(lambda: next(values), 60, "a value", poll_s=0.01) == "ready"


def test_wait_until_names_what_and_shows_the_state_on_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"the thing not within 0.05 s: state 7"):
        wait_until(lambda: False, 0.05, "the thing", poll_s=0.01, describe=lambda: "state 7")


def test_wait_until_lets_a_probes_exception_through_at_once() -> None:
    calls = []

    def probe() -> bool:
        calls.append(1)
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        wait_until(probe, 60, "never")
    assert len(calls) == 1


def _server(tmp_path: Path, code: str) -> ServerProcess:
    """A ServerProcess around ``python -c code`` on a port nobody serves (no SGLang)."""
    server = ServerProcess.__new__(ServerProcess)
    server.name = "fake"
    server.url = f"http://127.0.0.1:{free_port()}"
    server.log_path = tmp_path / "fake.log"
    server.log_path.write_text("last words\n")
    server.popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    server.pid = server.popen.pid
    return server


def test_wait_ready_raises_runtime_error_once_the_process_exited(tmp_path: Path) -> None:
    server = _server(tmp_path, "raise SystemExit(3)")
    server.popen.wait(timeout=60)
    with pytest.raises(RuntimeError, match=r"fake exited with 3 before ready(.|\n)*last words"):
        server.wait_ready(60)


def test_wait_ready_raises_timeout_error_while_it_runs_unready(tmp_path: Path) -> None:
    server = _server(tmp_path, "import time; time.sleep(600)")
    try:
        with pytest.raises(TimeoutError, match=r"fake ready not within 0.1 s(.|\n)*last words"):
            server.wait_ready(0.1)
    finally:
        kill_tree(server.pid, hard=True)
        server.popen.wait(timeout=60)


def test_stop_tree_stops_the_server_and_its_child_and_kill_tree_still_ends_them(
        tmp_path: Path) -> None:
    import psutil

    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
            "'import time; time.sleep(600)']); time.sleep(600)"
    server = _server(tmp_path, child)
    try:
        def tree_with_child() -> list[int] | None:
            children = [c.pid for c in psutil.Process(server.pid).children()]
            return [server.pid, *children] if children else None

        tree = wait_until(tree_with_child, 60, "the server and its child")
        stop_tree(server.pid)
        wait_until(lambda: all(psutil.Process(pid).status() == psutil.STATUS_STOPPED
                               for pid in tree), 60, "both processes stopped")
    finally:
        kill_tree(server.pid, hard=True)
        server.popen.wait(timeout=60)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in tree)


def _result(dp_rank: int | None, started: float, ok: bool = True) -> RequestResult:
    return RequestResult("p", started, started, 200 if ok else 503, [1], dp_rank,
                         None if ok else "lost")


def test_each_shard_must_serve_after_the_call(tmp_path: Path) -> None:
    load = LoadClient("http://unused")  # never started: results are added by hand
    load.results += [_result(0, 0.0), _result(1, 0.0)]  # before the call: not counted
    joiner_log = tmp_path / "joiner.log"
    joiner_log.write_text("[x DP2] Prefill batch. old\n")  # before the call: not counted
    with pytest.raises(TimeoutError, match=r"shards \[0, 1, 2\] served none yet"):
        wait_each_shard_serves(load, [0, 1, 2], 0.1, logs={2: joiner_log})

    later = time.monotonic() + 3600  # started after any call below
    load.results += [_result(0, later), _result(1, later, ok=False)]
    with pytest.raises(TimeoutError, match=r"shards \[1, 2\] served none yet"):  # 1's failed
        wait_each_shard_serves(load, [0, 1, 2], 0.1, logs={2: joiner_log})

    load.results.append(_result(1, later))

    done = threading.Event()

    def batches() -> None:  # until the wait returns: some come after it read the log
        while not done.wait(0.05):
            with joiner_log.open("a") as f:
                f.write("[x DP2] Prefill batch. new\n")

    writer = threading.Thread(target=batches)
    writer.start()
    try:
        wait_each_shard_serves(load, [0, 1, 2], 60, logs={2: joiner_log})
    finally:
        done.set()
        writer.join()


def test_a_shards_relaunched_server_serves_in_a_log_of_its_own(tmp_path: Path) -> None:
    """A replacement that died before it served leaves its log behind; the one relaunched
    after it serves in a new log, which counts from its first batch."""
    load = LoadClient("http://unused")
    load.results += [_result(0, time.monotonic() + 3600), _result(1, time.monotonic() + 3600)]
    dead = tmp_path / "r2-recover-a.log"
    dead.write_text("[x DP2] Prefill batch. before the call\n")
    logs = {2: lambda: sorted(tmp_path.glob("r2-recover-*.log"))}
    with pytest.raises(TimeoutError, match=r"shards \[2\] served none yet"):
        wait_each_shard_serves(load, [0, 1, 2], 0.1, logs=logs)
    relaunch = threading.Timer(0.3, (tmp_path / "r2-recover-b.log").write_text,
                               ["[x DP2] Prefill batch. the relaunch\n"])
    relaunch.start()  # during the wait below
    try:
        wait_each_shard_serves(load, [0, 1, 2], 30, logs=logs)
    finally:
        relaunch.join()


def test_webhook_receiver_returns_what_came_on_success_and_on_timeout() -> None:
    with WebhookReceiver() as hook:
        httpx.post(hook.url, json={"type": "rank_failed"}, timeout=60)
        assert hook.wait_for(lambda got: len(got) == 1, 60) == [{"type": "rank_failed"}]
        assert hook.wait_for(lambda got: len(got) == 2, 0.05) == [{"type": "rank_failed"}]


def test_webhook_receiver_drops_a_redelivered_event_as_receivers_are_told_to() -> None:
    failed = {"type": "rank_failed", "event_id": 4, "instance_id": "a"}
    with WebhookReceiver() as hook:
        for event in (failed, failed, {**failed, "instance_id": "b"}, {**failed, "event_id": 5}):
            assert httpx.post(hook.url, json=event, timeout=60).status_code == 204
        got = hook.wait_for(lambda got: len(got) == 3, 60)
        assert [(e["instance_id"], e["event_id"]) for e in got] == [("a", 4), ("b", 4), ("a", 5)]
        assert hook.duplicates == 1


def test_a_status_poll_tries_a_dropped_connection_again_and_gives_up_on_a_gone_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[Exception | dict] = [httpx.ReadError("reset"), {"phase": "idle"}]
    calls: list[str] = []

    def get(url: str, timeout: float) -> httpx.Response:
        calls.append(url)
        answer = answers.pop(0) if answers else httpx.ConnectError("refused")
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(200, json=answer)

    monkeypatch.setattr(httpx, "get", get)
    monkeypatch.setattr(status.retry, "sleep", lambda _: None)  # type: ignore[attr-defined]
    assert status("http://127.0.0.1:1") == {"phase": "idle"}
    assert calls == ["http://127.0.0.1:1/elastic_ep/status"] * 2
    with pytest.raises(httpx.ConnectError):
        status("http://127.0.0.1:1")
    assert len(calls) == 5  # three tries for the server that went away

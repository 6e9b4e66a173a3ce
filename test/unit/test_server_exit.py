"""A server above node 0 exits non-zero when a rank of it crashed, and 0 when its ranks left."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from sglang_elastic_ep.sglang import server_exit

FORK = mp.get_context("fork")


def _exit_with(code: int) -> None:
    os._exit(code)


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(delay_s: float, code: int) -> None:
    time.sleep(delay_s)
    os._exit(code)


def started(target: Any, *args: Any) -> Any:
    proc = FORK.Process(target=target, args=args)
    proc.start()
    return proc


def test_only_non_zero_exit_codes_are_crashes() -> None:
    assert server_exit.crashed([0, None, 0]) == []
    assert server_exit.crashed([0, -9, 1, None, -3, -11]) == [-9, 1, -3, -11]


def test_a_server_stopped_by_sigterm_or_sigint_to_all_its_processes_is_not_a_crash() -> None:
    assert server_exit.crashed([-signal.SIGTERM, -signal.SIGINT]) == []


def test_a_scheduler_killed_beside_a_released_one_ends_the_controller_with_exit_1() -> None:
    exits: list[int] = []
    procs = [started(_exit_with, 0), started(_killed)]
    server_exit._exit_on_first_crash(procs, exits.append)
    assert exits == [server_exit.CRASH_EXIT_CODE]


def test_a_crash_is_seen_while_another_scheduler_still_runs() -> None:
    exits: list[int] = []
    slow = started(_after, 30.0, 0)
    try:
        server_exit._exit_on_first_crash([slow, started(_exit_with, 3)], exits.append)
        assert exits == [server_exit.CRASH_EXIT_CODE]
        assert slow.is_alive()  # the watcher did not wait for it
    finally:
        slow.kill()
        slow.join()


def test_schedulers_that_all_exit_0_end_nothing() -> None:
    exits: list[int] = []
    server_exit._exit_on_first_crash([started(_exit_with, 0), started(_exit_with, 0)],
                                     exits.append)
    assert exits == []


def test_the_exit_code_is_read_when_another_thread_reaped_the_process() -> None:
    proc = started(_exit_with, 5)
    proc.join()  # as the controller's own join does
    assert server_exit._exit_code(proc) == 5


@dataclass
class FakeProc:
    exitcode: int | None
    pid: int = 0

    def join(self, timeout: float | None = None) -> None:
        pass


@dataclass
class FakeInitResult:
    blocked: list[bool] = field(default_factory=list)

    def block_until_scheduler_exits(self) -> None:
        self.blocked.append(True)


def launched(codes: list[int | None]) -> tuple[FakeInitResult, list[FakeProc]]:
    return FakeInitResult(), [FakeProc(code) for code in codes]


def test_a_server_above_node_0_exits_1_after_its_controller_crashed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_exit, "_watched_server", lambda: True)
    result, procs = server_exit.exit_non_zero_after_a_crash(lambda: launched([-3]))
    with pytest.raises(SystemExit) as ended:
        result.block_until_scheduler_exits()
    assert ended.value.code == server_exit.CRASH_EXIT_CODE
    assert procs[0].exitcode == -3


def test_a_server_above_node_0_whose_ranks_left_returns_as_upstream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_exit, "_watched_server", lambda: True)
    result, _ = server_exit.exit_non_zero_after_a_crash(lambda: launched([0]))
    result.block_until_scheduler_exits()  # no SystemExit


def test_node_0_and_servers_without_elastic_ep_keep_upstreams_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_exit, "_watched_server", lambda: False)
    result, _ = server_exit.exit_non_zero_after_a_crash(lambda: launched([-9]))
    result.block_until_scheduler_exits()  # upstream's: returns
    assert result.blocked == [True]


def test_the_controller_watch_starts_only_above_node_0(monkeypatch: pytest.MonkeyPatch) -> None:
    watched: list[Any] = []
    monkeypatch.setattr(server_exit.threading, "Thread",
                        lambda **kwargs: watched.append(kwargs) or FakeThread())

    @dataclass
    class Controller:
        scheduler_procs: list[Any]

    monkeypatch.setattr(server_exit, "_watched_server", lambda: False)
    server_exit.watch_schedulers(None, Controller([FakeProc(None)]))
    assert watched == []
    monkeypatch.setattr(server_exit, "_watched_server", lambda: True)
    proc = FakeProc(None)
    server_exit.watch_schedulers(None, Controller([proc, None]))
    assert [len(kw["args"][0]) for kw in watched] == [1]
    assert proc.join.func is server_exit._join_then_exit_on_crash  # type: ignore[attr-defined]


class FakeThread:
    def start(self) -> None:
        pass


def test_the_controllers_own_join_of_a_crashed_scheduler_exits_1_before_it_returns() -> None:
    exits: list[int] = []
    proc = started(_exit_with, 7)
    join = proc.join
    server_exit._join_then_exit_on_crash(proc, join, exits.append)
    assert exits == [server_exit.CRASH_EXIT_CODE]


def test_a_join_that_timed_out_on_a_running_scheduler_exits_nothing() -> None:
    exits: list[int] = []
    proc = started(_after, 30.0, 0)
    try:
        server_exit._join_then_exit_on_crash(proc, proc.join, exits.append, 0.01)
        assert exits == []
    finally:
        proc.kill()
        proc.join()

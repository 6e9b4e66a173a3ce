"""The zygote forks servers that behave as exec'd ones to the testbed: own arguments,
environment, session and log, and ``Popen``'s exit statuses (a probe module stands in for
``sglang.launch_server``)."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sglang_elastic_ep_testbed.cluster.procs import kill_tree, processes_in_sessions
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cluster.zygote import (
    ENV_SERVER_START,
    ForkedServer,
    Zygote,
    server_start_method,
)

PROBE = textwrap.dedent("""
    import os, subprocess, sys, time
    mode = sys.argv[1]
    print("probe", mode, "PROBE_VALUE=" + os.environ.get("PROBE_VALUE", "unset"),
          "own-session" if os.getsid(0) == os.getpid() else "shared-session", flush=True)
    if mode == "exit":
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise RuntimeError("the probe failed")
    if mode == "titled-child":  # as SGLang's schedulers name themselves
        import setproctitle
        if os.fork() == 0:
            setproctitle.setproctitle("probe::child_EP1")
            time.sleep(600)
        time.sleep(600)
    if mode == "leave-a-child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", child.pid, flush=True)
        sys.exit(0)
    time.sleep(600)
""")


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("PROBE_VALUE", None)
    started = Zygote(env, tmp_path / "zygote.log", imports=("json",), module="zygote_probe")
    yield started
    started.close()


def fork(zygote: Zygote, tmp_path: Path, *args: str, value: str = "") -> ForkedServer:
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PROBE_VALUE": value}
    return zygote.fork(list(args), env, tmp_path / f"{'-'.join(args)}.log")


def test_a_forked_server_runs_with_its_own_arguments_environment_session_and_log(
        zygote: Zygote, tmp_path: Path) -> None:
    first = fork(zygote, tmp_path, "exit", "3", value="first")
    second = fork(zygote, tmp_path, "exit", "0", value="second")
    assert first.wait(timeout=60) == 3
    assert second.wait(timeout=60) == 0
    assert first.returncode == 3 and first.poll() == 3
    assert (tmp_path / "exit-3.log").read_text().splitlines() == [
        "probe exit PROBE_VALUE=first own-session"]
    assert "PROBE_VALUE=second" in (tmp_path / "exit-0.log").read_text()


def test_a_forked_servers_log_exists_once_its_pid_is_returned(zygote: Zygote,
                                                              tmp_path: Path) -> None:
    # As with Popen, which opens the log in the parent: a plan reads a replacement's log at
    # once, while the server may not have run yet.
    stale = tmp_path / "sleep.log"
    stale.write_text("an earlier server's lines\n")
    server = fork(zygote, tmp_path, "sleep")
    try:
        assert stale.exists() and "earlier" not in stale.read_text()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)


def test_a_killed_server_reads_as_popen_reads_a_signal_and_a_failed_one_exits_1(
        zygote: Zygote, tmp_path: Path) -> None:
    sleeper = fork(zygote, tmp_path, "sleep")
    failing = fork(zygote, tmp_path, "raise")
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(timeout=0.3)
    os.killpg(sleeper.pid, signal.SIGKILL)  # its own group, as the cluster kills a server
    assert sleeper.wait(timeout=60) == -signal.SIGKILL
    assert failing.wait(timeout=60) == 1
    assert "RuntimeError: the probe failed" in (tmp_path / "raise.log").read_text()


def title(proc: psutil.Process) -> str:
    return " ".join(proc.cmdline()).strip()  # a title shorter than its area ends in padding


def test_a_forked_server_and_its_children_show_their_own_titles(
        zygote: Zygote, tmp_path: Path) -> None:
    """The titles ``ps`` shows: the testbed finds each scheduler by the one SGLang sets."""
    server = fork(zygote, tmp_path, "titled-child")
    try:
        me = psutil.Process(server.pid)
        titles = wait_until(lambda: [title(c) for c in me.children()] or None, 30,
                            "the probe's child")
        assert title(me) == "python -m zygote_probe titled-child"
        assert titles == ["probe::child_EP1"]
    finally:
        kill_tree(server.pid, hard=True)
    assert server.wait(timeout=60) < 0


def test_what_a_forked_server_leaves_behind_is_found_by_its_session(
        zygote: Zygote, tmp_path: Path) -> None:
    server = fork(zygote, tmp_path, "leave-a-child")
    assert server.wait(timeout=60) == 0
    child = int((tmp_path / "leave-a-child.log").read_text().splitlines()[-1].split()[1])
    try:
        assert [p.pid for p in processes_in_sessions({server.pid})] == [child]
    finally:
        kill_tree(child, hard=True)
    assert processes_in_sessions({server.pid}) == []


def test_servers_outlive_their_zygote_which_then_reports_them_lost(
        zygote: Zygote, tmp_path: Path) -> None:
    server = fork(zygote, tmp_path, "sleep")
    zygote.close()
    assert not zygote.alive()
    assert server.poll() is None  # still running in its own session
    kill_tree(server.pid, hard=True)
    assert server.wait(timeout=60) < 0


def test_the_server_start_method_is_exec_fork_or_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SERVER_START, raising=False)
    assert server_start_method() == "exec"
    monkeypatch.setenv(ENV_SERVER_START, "fork")
    assert server_start_method() == "fork"
    monkeypatch.setenv(ENV_SERVER_START, "clone")
    with pytest.raises(ValueError, match="exec, fork"):
        server_start_method()

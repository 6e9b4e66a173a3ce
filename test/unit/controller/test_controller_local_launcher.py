"""The local launcher with harmless commands: pid tracking, kill by pid, SIGKILL fallback."""

from __future__ import annotations

import json
import shlex
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sglang_elastic_ep.controller.launchers.base import Launcher, within
from sglang_elastic_ep.controller.launchers.local import (
    ENV_DEPLOYMENT,
    ENV_JOIN_MODE,
    ENV_OPERATION_ID,
    ENV_RANK_OFFSET,
    LocalLauncher,
)
from sglang_elastic_ep.controller.launchers.template import Template, TemplateError
from sglang_elastic_ep.core.controller import JoinerSpec, JoinMode, Launch
from sglang_elastic_ep_testbed.cluster.waits import wait_until

# The placeholders land in sh's positional arguments; exec keeps the pid the joiner's.
SLEEP = "sh -c 'exec sleep 60' joiner {rank_offset} {join_mode} {operation_id}"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids the test started; whatever is left is SIGKILLed by pid at the end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for p in [*proc.children(recursive=True), proc]:
                p.kill()
        except psutil.NoSuchProcess:
            pass


def make(tmp_path: Path, command: str = SLEEP, **kw: object) -> LocalLauncher:
    kw.setdefault("deployment", f"test-{uuid.uuid4().hex[:8]}")
    kw.setdefault("kill_grace_s", 5.0)
    kw.setdefault("adopt", False)  # scanning every process's environment costs CPU
    return LocalLauncher(Template(command, "--command"), log_dir=tmp_path / "logs", **kw)  # type: ignore[arg-type]


def spec(offset: int, mode: JoinMode = JoinMode.SCALE, op: str = "ctl-1-grow-to-3",
         size: int = 1) -> JoinerSpec:
    return JoinerSpec(offset, size, mode, op, offset + size)


def pid_of(launch: Launch) -> int:
    return int(launch.handle)


def test_is_a_launcher(tmp_path: Path) -> None:
    assert isinstance(make(tmp_path), Launcher)


def test_python_joiner_gets_the_filled_command_and_tags_and_is_killed_by_pid(
    tmp_path: Path, started: list[int]
) -> None:
    out = tmp_path / "argv.json"
    script = (f"import json, os, sys, time; open({str(out)!r}, 'w').write(json.dumps("
              "[sys.argv[1:], {k: v for k, v in os.environ.items() if k.startswith('SGLANG_EEP')}"
              "])); time.sleep(60)")
    command = (f"{shlex.quote(sys.executable)} -c {shlex.quote(script)} --elastic-ep-join-rank-"
               "offset {rank_offset} --ep-join-mode {join_mode} --dist-init-addr "
               "{dist_init_addr} --port {port} --size {num_ranks} --ep {ep_size}")
    launcher = make(tmp_path, command, deployment="dep-a", dist_init_addr="10.0.0.1:5000",
                    port_base=31000)
    launch = launcher.launch_joiner(spec(2))
    started.append(pid_of(launch))
    assert (launch.rank_offset, launch.num_ranks, launch.mode, launch.alive) == (
        2, 1, JoinMode.SCALE, True)
    wait_until(out.exists, 30, "the joiner wrote its argv")
    wait_until(lambda: out.read_text().endswith("]"), 30, "the joiner finished writing")
    argv, env = json.loads(out.read_text())
    assert argv == ["--elastic-ep-join-rank-offset", "2", "--ep-join-mode", "scale",
                    "--dist-init-addr", "10.0.0.1:5000", "--port", "31002", "--size", "1",
                    "--ep", "3"]
    assert env[ENV_DEPLOYMENT] == "dep-a" and env[ENV_RANK_OFFSET] == "2"
    assert env[ENV_JOIN_MODE] == "scale" and env[ENV_OPERATION_ID] == "ctl-1-grow-to-3"
    assert psutil.Process(pid_of(launch)).is_running()

    assert launcher.terminate([3]) == []  # not its rank: untouched
    assert not gone(pid_of(launch))
    stopped = launcher.terminate([2, 3])
    assert [s.handle for s in stopped] == [launch.handle]
    assert gone(pid_of(launch))
    assert [(x.handle, x.alive) for x in launcher.list()] == [(launch.handle, False)]


def test_terminate_stops_only_joiners_wholly_inside_the_listed_ranks(
    tmp_path: Path, started: list[int]
) -> None:
    launcher = make(tmp_path)
    two = launcher.launch_joiner(spec(2))
    three = launcher.launch_joiner(spec(3))
    pair = launcher.launch_joiner(spec(4, size=2))  # ranks 4 and 5
    started.extend(pid_of(x) for x in (two, three, pair))
    stopped = launcher.terminate([3, 4])
    assert [s.handle for s in stopped] == [three.handle]
    assert gone(pid_of(three))
    assert not gone(pid_of(two)) and not gone(pid_of(pair))
    assert {x.handle: x.alive for x in launcher.list()} == {
        two.handle: True, three.handle: False, pair.handle: True}
    assert within(pair, [4, 5]) and not within(pair, [4]) and not within(pair, [])


@pytest.mark.parametrize("stuck", [False, True])
def test_a_joiner_that_outlasts_sigterm_or_is_stuck_is_sigkilled_with_its_children(
    tmp_path: Path, started: list[int], stuck: bool
) -> None:
    children = tmp_path / "child.pid"
    got = tmp_path / "signals"
    # It notes a SIGTERM and waits on: only SIGKILL ends it.
    command = (f"sh -c 'trap \"echo TERM >> {got}\" TERM; sleep 60 & echo $! > {children}; "
               "wait; wait' -- {rank_offset}")
    # A stuck rank's replacement does not wait out the grace: it kills at once.
    launcher = make(tmp_path, command, kill_grace_s=30 if stuck else 0.5)
    launch = launcher.launch_joiner(spec(2))
    started.append(pid_of(launch))
    wait_until(lambda: children.exists() and children.read_text().strip() != "", 30,
               "the joiner started its child")
    child = int(children.read_text())
    started.append(child)
    if stuck:
        new = launcher.launch_replacement(spec(2, JoinMode.RECOVER, "ctl-recover-r2-e0-1"),
                                          stuck=True)
        started.append(pid_of(new))
    else:
        launcher.terminate([2])
    assert gone(pid_of(launch)) and gone(child)
    assert got.exists() is not stuck  # SIGTERM first, unless stuck
    assert next(x for x in launcher.list() if x.handle == launch.handle).exit_code == -9


def test_terminate_lets_a_server_stop_its_children_and_keeps_its_exit_code(
    tmp_path: Path, started: list[int]
) -> None:
    children = tmp_path / "child.pid"
    # Like SGLang's launch_server: on SIGTERM it stops its own child, then exits 0.
    command = (f"sh -c 'sleep 60 & echo $! > {children}; "
               "trap \"kill $!; exit 0\" TERM; wait' -- {rank_offset}")
    launcher = make(tmp_path, command)
    launch = launcher.launch_joiner(spec(2))
    started.append(pid_of(launch))
    wait_until(lambda: children.exists() and children.read_text().strip() != "", 30,
               "the joiner started its child")
    started.append(int(children.read_text()))
    (stopped,) = launcher.terminate([2])
    assert gone(pid_of(launch)) and gone(int(children.read_text()))
    assert launcher.list()[0].exit_code == 0


def test_replacement_stops_exactly_the_failed_ranks_joiner_and_starts_recover(
    tmp_path: Path, started: list[int]
) -> None:
    launcher = make(tmp_path)
    old = launcher.launch_joiner(spec(2))
    other = launcher.launch_joiner(spec(3))
    started.extend([pid_of(old), pid_of(other)])
    new = launcher.launch_replacement(spec(2, JoinMode.RECOVER, "ctl-recover-r2-1"))
    started.append(pid_of(new))
    assert gone(pid_of(old)) and not gone(pid_of(other)) and not gone(pid_of(new))
    assert (new.mode, new.operation_id, new.rank_offset) == (
        JoinMode.RECOVER, "ctl-recover-r2-1", 2)


@pytest.mark.parametrize(("command", "code"), [("true {rank_offset}", 0),
                                               ("sh -c 'exit 3' -- {rank_offset}", 3)])
def test_an_exited_joiner_is_listed_as_not_alive_with_its_exit_code(
    tmp_path: Path, command: str, code: int
) -> None:
    launcher = make(tmp_path, command)
    launch = launcher.launch_joiner(spec(2))
    assert launch.exit_code is None
    wait_until(lambda: not launcher.list()[0].alive, 30, "the joiner exited")
    (ended,) = launcher.list()
    assert (ended.handle, ended.exit_code) == (launch.handle, code)


def test_a_restarted_controller_adopts_its_running_joiners_and_kills_them_by_pid(
    tmp_path: Path, started: list[int]
) -> None:
    command = "sh -c 'sleep 60 & wait' -- {rank_offset}"  # a joiner with a child, like SGLang
    first = make(tmp_path, command, deployment="dep-adopt-" + uuid.uuid4().hex[:6], adopt=True)
    launch = first.launch_joiner(spec(3, op="ctl-4-grow-to-4"))
    started.append(pid_of(launch))
    wait_until(lambda: psutil.Process(pid_of(launch)).children(), 30, "child started")
    child = psutil.Process(pid_of(launch)).children()[0].pid

    second = make(tmp_path, command, deployment=first.deployment, adopt=True)  # a restart
    (adopted,) = second.list()
    assert (adopted.handle, adopted.rank_offset, adopted.operation_id, adopted.alive) == (
        launch.handle, 3, "ctl-4-grow-to-4", True)
    other = make(tmp_path, command, deployment="someone-else-" + uuid.uuid4().hex[:6],
                 adopt=True)
    assert other.list() == []  # another deployment's launcher never sees it

    second.terminate([3])
    assert gone(pid_of(launch)) and gone(child)


def test_template_errors_are_found_when_the_launcher_is_built(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match=r"unknown placeholder\(s\) \{rank\}"):
        make(tmp_path, "serve --offset {rank}")
    with pytest.raises(TemplateError, match="--dist-init-addr"):
        make(tmp_path, "serve --dist-init-addr {dist_init_addr}")
    with pytest.raises(TemplateError, match="not a valid command"):
        make(tmp_path, "serve 'unclosed {rank_offset}")
    # Shell variables and JSON keep their braces.
    launcher = make(tmp_path, "sh -c 'echo ${HOME} {\"a\": 1}' {rank_offset}")
    assert launcher.template.placeholders == {"rank_offset"}

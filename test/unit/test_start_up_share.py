"""A starting server's session weighs more until its scheduler serves: on real autogroups."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from sglang_elastic_ep_testbed.cpu.start_up_share import (
    DEFAULT_START_UP_NICE,
    ENV_START_UP_NICE,
    autogroup_path,
    favour_start_up,
    session_nice,
    start_up_nice,
)
from sglang_elastic_ep_testbed.hooks import HOOKS

# A child in a session of its own that waits for a line on stdin, then calls the hook as a
# scheduler entering its event loop (or its wait for the serving ranks) does, prints its
# session's nice, and waits again.
CHILD = """
import sys
from sglang_elastic_ep_testbed.cpu.start_up_share import (
    serve_at_normal_share, session_nice, wait_at_normal_share)
sys.stdin.readline()
(wait_at_normal_share if sys.argv[1] == "wait" else serve_at_normal_share)(object())
print(session_nice("self"), flush=True)
sys.stdin.readline()
"""


@pytest.fixture(params=["serve", "wait"])
def session_child(request: pytest.FixtureRequest) -> Iterator[subprocess.Popen[str]]:
    """As a scheduler that serves, or one that starts waiting for the serving ranks."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, request.param], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield child
    finally:
        child.kill()
        child.wait(timeout=10)


def autogroups_settable(pid: int) -> bool:
    try:
        autogroup_path(pid).write_text("0\n")
    except OSError:
        return False
    return True


def test_a_started_server_weighs_more_until_its_start_up_is_done(
    session_child: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not autogroups_settable(session_child.pid):
        pytest.skip(f"{autogroup_path(session_child.pid)} is missing or not writable here "
                    "(a kernel without autogroups, or no CAP_SYS_NICE)")
    monkeypatch.delenv(ENV_START_UP_NICE, raising=False)
    # None where this test runs in the root autogroup (the kernel prints nothing for it).
    own_nice_before = session_nice("self")
    assert favour_start_up(session_child.pid)
    assert session_nice(session_child.pid) == DEFAULT_START_UP_NICE < 0
    # This test's own session is untouched.
    assert session_nice("self") == own_nice_before != DEFAULT_START_UP_NICE

    assert session_child.stdin is not None and session_child.stdout is not None
    session_child.stdin.write("serve\n")
    session_child.stdin.flush()
    assert session_child.stdout.readline().strip() == "0"
    assert session_nice(session_child.pid) == 0


def test_turned_off_it_leaves_the_session_alone(
    session_child: subprocess.Popen[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not autogroups_settable(session_child.pid):
        pytest.skip(f"{autogroup_path(session_child.pid)} is missing or not writable here")
    monkeypatch.setenv(ENV_START_UP_NICE, "0")
    assert not favour_start_up(session_child.pid)
    assert session_nice(session_child.pid) == 0


def test_no_session_to_favour_is_reported_not_raised() -> None:
    # A pid no process has (above the kernel's pid_max limit).
    assert not favour_start_up(2**22 + 1)
    assert session_nice(2**22 + 1) is None


@pytest.mark.parametrize("raw", ["-21", "20", "ten"])
def test_a_bad_nice_is_refused_with_the_range(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_START_UP_NICE, raw)
    with pytest.raises(ValueError):
        start_up_nice()


def test_the_hook_runs_before_the_event_loop() -> None:
    (hook,) = [h for h in HOOKS if h.impl == "cpu.start_up_share:serve_at_normal_share"]
    assert hook.target.endswith("managers.scheduler.Scheduler.run_event_loop")
    assert hook.kind == "BEFORE"


def test_a_joiner_and_a_replacement_take_the_normal_share_before_they_wait() -> None:
    """Both wait in Mooncake's ``join_group`` on WORLD, through upstream's one function."""
    import inspect

    from sglang.srt.elastic_ep import elastic_ep

    (hook,) = [h for h in HOOKS if h.impl == "cpu.start_up_share:wait_at_normal_share"]
    assert hook.target == "sglang.srt.elastic_ep.elastic_ep._join_world_group"
    assert hook.kind == "BEFORE"
    for waits in (elastic_ep.join_scale_process_group, elastic_ep.join_process_groups):
        assert "_join_world_group()" in inspect.getsource(waits)

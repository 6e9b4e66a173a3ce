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
# scheduler entering its event loop does, prints its session's nice, and waits again.
CHILD = """
import sys
from sglang_elastic_ep_testbed.cpu.start_up_share import serve_at_normal_share, session_nice
sys.stdin.readline()
serve_at_normal_share(object())
print(session_nice("self"), flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def session_child() -> Iterator[subprocess.Popen[str]]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
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


def test_a_started_server_weighs_more_until_its_scheduler_serves(
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

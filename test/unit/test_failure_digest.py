"""The failure digest (cluster/launcher.py): the few lines per server that scripts/test.sh
prints last when a cluster scenario fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess

LOG = """\
[2026-11-27 22:34:19 DP0 TP0 EP0] Prefill batch, #new-seq: 1
[2026-11-27 22:34:20 DP0 TP0 EP0] [elastic-ep][nixl] rank 0: connect [1] -> connected EP size 2
[2026-11-27 22:34:21 DP0 TP0 EP0] [elastic-ep] rank failure: launch-time ranks [1] failed
I1127 22:34:31.388181 23092 coordinator.cpp:888] [COORD] auto_deactivate group=mooncake_pg_2 rank=2
I1127 22:34:31.388190 23092 coordinator.cpp:888] [COORD] auto_deactivate group=mooncake_pg_3 rank=2
[2026-11-27 22:34:32 DP0 TP0 EP0] Decode batch, #running-req: 2
RuntimeError: mooncakePgBroadcast failed: invalid state: rank is not active in this group
"""


def server_with_log(tmp_path: Path, code: str) -> ServerProcess:
    """A ServerProcess over a finished child (exit code from ``code``) and the log above."""
    server = ServerProcess.__new__(ServerProcess)
    server.name, server.log_path = "joiner-scale-r2", tmp_path / "joiner.log"
    server.log_path.write_text(LOG)
    server.popen = subprocess.Popen([sys.executable, "-c", code])
    server.popen.wait()
    server.pid, server.killed = server.popen.pid, False
    return server


def test_a_digest_keeps_the_exit_code_and_the_last_telling_lines_shortened(
        tmp_path: Path) -> None:
    digest = server_with_log(tmp_path, "raise SystemExit(3)").digest(lines=3).splitlines()
    assert digest[0].endswith(": exited with 3"), digest
    assert digest[1:] == [
        "  22:34:21 DP0 [elastic-ep] rank failure: launch-time ranks [1] failed",
        "  22:34:31 [COORD] auto_deactivate rank=2",  # one line for the eviction's groups
        "  RuntimeError: mooncakePgBroadcast failed: invalid state: rank is not active in this "
        "group",
    ]


def test_a_server_the_scenario_killed_says_so_instead_of_the_code_popen_reads(
        tmp_path: Path) -> None:
    server = server_with_log(tmp_path, "pass")
    assert server.state() == "exited with 0"
    server.killed = True  # what LocalCluster.kill_server sets before its SIGKILL
    assert server.state() == "killed by the scenario"
    assert server.digest().splitlines()[0].endswith(": killed by the scenario")


STARTUP_CRASH = """\
[2026-11-29 08:50:12 DP1 TP1 EP1] [elastic-ep] replacement of launch-time rank 1: waits
[2026-11-29 08:50:29 DP1 TP1 EP1] Scheduler hit an exception: Traceback (most recent call last):
  File "scheduler.py", line 1, in run_scheduler_process
ConnectionError: joinGroup mooncake_pg_2 failed: peer 0 unreachable

Traceback (most recent call last):
    raise EOFError
EOFError
Traceback (most recent call last):
RuntimeError: Rank 0 scheduler died during initialization (exit code: -3).
"""


def test_a_digest_names_the_first_exception_when_the_last_lines_are_its_aftermath(
        tmp_path: Path) -> None:
    server = server_with_log(tmp_path, "raise SystemExit(1)")
    server.log_path.write_text(STARTUP_CRASH)
    digest = server.digest(lines=3).splitlines()
    assert digest[1] == ("  first exception: ConnectionError: joinGroup mooncake_pg_2 failed: "
                         "peer 0 unreachable"), digest
    assert digest[-1].startswith("  RuntimeError: Rank 0 scheduler died"), digest
    assert len(digest) == 5, digest


def test_a_scenario_digest_is_headed_by_the_failure_and_its_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun scenario keeps no other trace of its first failure than this digest."""
    from sglang_elastic_ep_testbed.cluster import launcher

    out = tmp_path / "failure-digest.txt"
    monkeypatch.setattr(launcher, "FAILURE_DIGEST", out)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "test/e2e/test_x.py::test_y (call)")
    cluster = launcher.LocalCluster.__new__(launcher.LocalCluster)
    cluster.primary, cluster.followers, cluster.joiners = (
        server_with_log(tmp_path, "raise SystemExit(1)"), {}, [])
    cluster.write_failure_digest(TimeoutError("rank 1 active not within 420 s: {...}"))
    lines = out.read_text().splitlines()
    assert lines[0] == "== test/e2e/test_x.py::test_y: TimeoutError: rank 1 active not within " \
                       "420 s: {...}", lines
    assert lines[1].endswith(": exited with 1"), lines

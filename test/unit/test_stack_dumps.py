"""Stack dumps of a hung cluster (cluster/procs.py): what a failed e2e prints before teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster.procs import dump_stacks, kill_tree, py_spy
from sglang_elastic_ep_testbed.cluster.waits import wait_until

SLEEPER = """
import time
def stuck_in_a_collective():
    time.sleep(600)
stuck_in_a_collective()
"""


@pytest.mark.skipif(py_spy() is None, reason="py-spy is not installed (scripts/setup.sh adds it)")
def test_dump_names_the_function_a_process_is_stuck_in(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    try:
        # Until the interpreter has reached the function (dumps into a scratch file: ``out``
        # must hold exactly one report below).
        wait_until(lambda: "stuck_in_a_collective" in dump_stacks(
            [proc.pid], tmp_path / "probe.txt", "probe"), 120, "the sleeper's stack", poll_s=0.1,
            describe=lambda: (tmp_path / "probe.txt").read_text()[-2000:])
        out = tmp_path / "stacks.txt"
        report = dump_stacks([proc.pid], out, "unit test")
        assert "stuck_in_a_collective" in report, report
        assert report.startswith("===== unit test")
        assert out.read_text() == report
        dump_stacks([proc.pid], out, "second")
        assert out.read_text().count("=====") == 2  # appended, not overwritten
    finally:
        kill_tree(proc.pid, grace_s=1.0, hard=True)


def test_a_gone_process_yields_only_the_header(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    report = dump_stacks([proc.pid], tmp_path / "s.txt", "gone")
    assert report.splitlines()[0].startswith("===== gone") or "py-spy is not installed" in report
    assert "--- pid" not in report

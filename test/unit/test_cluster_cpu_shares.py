"""CPU shares of the CPU cluster's servers: each server's session (its scheduler autogroup) is
weighed by the EP ranks it holds (cluster/launcher.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster.launcher import autogroup_nice, set_autogroup_nice
from sglang_elastic_ep_testbed.cluster.procs import kill_tree

# Linux's CFS weights of nice 0..5 (kernel/sched/core.c, sched_prio_to_weight).
WEIGHT = {0: 1024, 1: 820, 2: 655, 3: 526, 4: 423, 5: 335}


@pytest.mark.parametrize(("ranks", "largest", "share"), [(1, 2, 1 / 2), (1, 3, 1 / 3),
                                                        (2, 4, 1 / 2), (1, 4, 1 / 4)])
def test_a_smaller_server_gets_the_weight_of_its_ranks(ranks: int, largest: int,
                                                       share: float) -> None:
    nice = autogroup_nice(ranks, largest)
    weight = WEIGHT.get(nice, 1024 / 1.25 ** nice)
    assert abs(weight / 1024 - share) <= 0.05 * share + 0.01, (nice, weight)


def test_the_largest_server_and_larger_ones_keep_nice_0() -> None:
    assert autogroup_nice(2, 2) == 0
    assert autogroup_nice(3, 2) == 0
    assert autogroup_nice(1, 1) == 0
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        autogroup_nice(0, 2)


def test_a_new_session_gets_the_nice_value_written_for_it() -> None:
    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no scheduler autogroups (/proc/self/autogroup missing)")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        assert set_autogroup_nice(child.pid, 3)
        group = Path(f"/proc/{child.pid}/autogroup").read_text().split()
        assert group[-2:] == ["nice", "3"], group
        own = Path("/proc/self/autogroup").read_text().split()
        assert own[0] != group[0], "the child should have an autogroup of its own"
    finally:
        kill_tree(child.pid)
        child.wait(timeout=10)


def test_a_process_that_is_gone_is_refused_without_raising() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert not set_autogroup_nice(child.pid, 3)

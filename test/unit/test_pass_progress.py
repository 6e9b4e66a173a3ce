"""Each scheduler publishes the step it is in; a stall report says which rank waits where."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from sglang_elastic_ep.core.stall import describe_positions, positions_from_reports
from sglang_elastic_ep.sglang.pass_progress import PassProgress, read_reports
from sglang_elastic_ep_testbed.cluster.procs import free_port
from sglang_elastic_ep_testbed.cluster.waits import wait_until


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))


def test_the_step_changes_only_when_another_is_entered() -> None:
    progress = PassProgress(rank=1, since=100.0)
    progress.gathered()
    assert progress.step == "gather" and progress.passes == 1
    entered = progress.since
    progress.now_in("gather")
    assert progress.since == entered  # the same step again keeps its start
    progress.now_in("forward")
    assert progress.step == "forward" and progress.since >= entered


def test_reports_reach_the_store_and_read_back_by_rank(store: TCPStore) -> None:
    ranks = [PassProgress(rank=r) for r in (0, 1)]
    ranks[0].gathered()
    ranks[1].now_in("scale-up to 3")
    for progress in ranks:
        progress.publish_forever(lambda: store, interval_s=0.05)
    wait_until(lambda: len(read_reports(store, range(3))) == 2, 10, "both reports published",
               poll_s=0.05)
    reports = read_reports(store, range(3))  # rank 2 never published: left out
    assert [(r["rank"], r["step"], r["passes"]) for r in reports] == [
        (0, "gather", 1), (1, "scale-up to 3", 0)]


def test_a_stall_names_the_step_each_rank_is_in_and_who_stopped_reporting() -> None:
    now = 1000.0
    reports = [
        {"rank": 1, "step": "forward", "since": 990.0, "passes": 50, "at": 999.5},
        {"rank": 0, "step": "gather", "since": 960.0, "passes": 51, "at": 999.8},
        {"rank": 2, "step": "gather", "since": 970.0, "passes": 51, "at": 980.0},
    ]
    positions = positions_from_reports(reports, now)
    assert [p.rank for p in positions] == [0, 1, 2]
    assert positions[0].in_step_s == 40.0 and positions[2].report_age_s == 20.0
    assert describe_positions(positions) == (
        "ranks [0] in step 'gather' for 40 s; ranks [1] in step 'forward' for 10 s; "
        "ranks [2] stopped reporting (process stopped or dead)")
    assert "--dist-init-addr" in describe_positions([])

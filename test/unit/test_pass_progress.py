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


def test_ranks_taken_for_failed_are_logged_with_their_last_report(
        store: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """A survivor that takes ranks for failed logs where they last said they were: a fresh
    report means a live rank stuck in that step, a missing one a rank that never reported."""
    stuck = PassProgress(rank=0)
    stuck.now_in("forward")
    stuck.publish_forever(lambda: store, interval_s=0.05)
    wait_until(lambda: len(read_reports(store, [0])) == 1, 10, "rank 0's report", poll_s=0.05)
    survivor = PassProgress(rank=2)
    survivor.publish_forever(lambda: store, interval_s=0.05)
    with caplog.at_level("INFO"):
        thread = survivor.log_last_reports([0, 1])
        assert thread is not None
        thread.join(10)
    line = next(r.getMessage() for r in caplog.records if "took ranks [0, 1]" in r.getMessage())
    assert "rank 0: in forward for" in line and "rank 1: none" in line, line


def test_each_report_and_the_takers_line_carry_the_last_gathers_token_counts(
        store: TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Two survivors that decide a pass differently (one runs its forward, one idles) wait for
    each other until one takes the other for failed: the line names the token counts each of
    them took from its last gather, so the row they saw differently is in the log."""
    idle = PassProgress(rank=0)
    idle.took_tokens([0, 0, 0])
    idle.gathered()
    idle.publish_forever(lambda: store, interval_s=0.05)
    wait_until(lambda: len(read_reports(store, [0])) == 1, 10, "rank 0's report", poll_s=0.05)
    assert read_reports(store, [0])[0]["tokens"] == [0, 0, 0]
    forwarding = PassProgress(rank=2)
    forwarding.took_tokens([0, 1, 0])
    forwarding.now_in("forward")
    forwarding.publish_forever(lambda: store, interval_s=0.05)
    with caplog.at_level("INFO"):
        thread = forwarding.log_last_reports([0])
        assert thread is not None
        thread.join(10)
    line = next(r.getMessage() for r in caplog.records if "took ranks [0]" in r.getMessage())
    assert "rank 0: in gather for" in line and "its last gather's tokens [0, 0, 0]" in line, line
    assert line.endswith("this rank's last gather's tokens: [0, 1, 0]"), line


def test_nothing_is_read_without_a_store_or_ranks() -> None:
    assert PassProgress(rank=0).log_last_reports([1]) is None  # never published: no store
    progress = PassProgress(rank=0, connect=lambda: None)
    assert progress.log_last_reports([]) is None


def test_a_report_reads_as_step_duration_and_age() -> None:
    from sglang_elastic_ep.sglang.pass_progress import describe_reports

    reports = [{"rank": 0, "step": "gather", "since": 70.0, "passes": 12, "at": 99.0},
               {"rank": 1, "step": "forward", "since": 90.0, "passes": 7, "tokens": [2, 0],
                "at": 99.5}]
    assert describe_reports(reports, [0, 1, 3], now=100.0) == (
        "rank 0: in gather for 30.0 s (pass 12), reported 1.0 s ago; "
        "rank 1: in forward for 10.0 s (pass 7, its last gather's tokens [2, 0]), reported "
        "0.5 s ago; rank 3: none")

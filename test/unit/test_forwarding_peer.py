"""A survivor whose gather lost a dying peer's row, and whose repaired rows hold no work, runs
its idle forward when a live peer that received every row is in that pass's forward (it waits
there for this rank's dispatch); otherwise the pass goes on as decided."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.core.stall import in_their_forward_since, positions_from_reports
from sglang_elastic_ep.sglang import gather_repair, pass_progress, tail_recovery
from sglang_elastic_ep.sglang.pass_progress import PassProgress, report_key

DECODE = 2  # a stand-in for ForwardMode.DECODE's value
IDLE = [0, 0, 1, 0, 1, 4, 0, 0, 1, 0, 0]
STARTED = 100.0  # when this rank's gather of the pass began


def report(rank: int, step: str, since: float, at: float) -> dict[str, Any]:
    return {"rank": rank, "step": step, "since": since, "passes": 9, "at": at}


def test_only_a_fresh_forward_entered_after_the_gather_began_counts() -> None:
    reports = [
        report(1, "forward", since=101.0, at=129.5),  # this pass's forward, still in it
        report(2, "forward", since=99.0, at=129.5),  # the previous pass's forward
        report(3, "forward", since=101.0, at=120.0),  # a dead rank's last report
        report(4, "gather", since=101.0, at=129.5),  # the next pass's gather: it skipped
        report(5, "idle", since=101.0, at=129.5),
    ]
    now = 130.0
    assert in_their_forward_since(positions_from_reports(reports, now), now - STARTED) == [1]
    assert in_their_forward_since([], now - STARTED) == []


class FakeInfo:
    """What the repair reads and writes of upstream's ``MLPSyncBatchInfo``: idle rows."""

    def __init__(self, ranks: int) -> None:
        self.num_dp_ranks, self.tp_size, self.cp_size = ranks, 1, 1
        self.tp0_info_cpu = torch.tensor([IDLE] * ranks, dtype=torch.int64)
        self.global_num_tokens = [0] * ranks


class FakeStore:
    def __init__(self, reports: list[dict[str, Any]]) -> None:
        self.values = {report_key(r["rank"]): json.dumps(r).encode() for r in reports}

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()


def survivor(monkeypatch: pytest.MonkeyPatch, reports: list[dict[str, Any]],
             active: list[int]) -> Any:
    """Rank 0's elastic state, publishing into a store that holds ``reports``."""
    monkeypatch.setattr(gather_repair, "_decode_mode", lambda: DECODE)
    monkeypatch.setattr(tail_recovery.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(tail_recovery.time, "time", lambda: 130.0)
    mask = torch.tensor(active, dtype=torch.int32)
    state = SimpleNamespace(active_ranks=mask, active_ranks_cpu=mask.clone())
    store = FakeStore(reports)
    progress = PassProgress(rank=0, connect=lambda: store)
    setattr(state, pass_progress._ATTR, progress)
    return state


def test_a_peer_in_this_passs_forward_makes_the_idle_survivor_run_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Ranks 1 and 2 were killed; rank 3 received every row and waits in its forward.
    state = survivor(monkeypatch, [report(3, "forward", since=101.0, at=129.5),
                                   report(2, "forward", since=101.0, at=101.5)],
                     active=[1, 1, 1, 1])
    info = FakeInfo(4)
    assert tail_recovery.follow_a_forwarding_peer(info, state, [1], STARTED) == [3]
    assert info.global_num_tokens == [0, 1, 0, 0]
    assert info.tp0_info_cpu[1].tolist()[:6] == [1, 1, 1, 0, 1, DECODE]
    assert info.tp0_info_cpu[3].tolist() == IDLE


def test_peers_that_skipped_the_pass_or_rows_with_work_change_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = survivor(monkeypatch, [report(3, "gather", since=101.0, at=129.5)],
                     active=[1, 1, 1, 1])
    info = FakeInfo(4)
    assert tail_recovery.follow_a_forwarding_peer(info, state, [1], STARTED) == []
    assert info.global_num_tokens == [0, 0, 0, 0]
    # Work in the rows: the pass runs its forward already; no report is read.
    busy = survivor(monkeypatch, [report(3, "forward", since=101.0, at=129.5)],
                    active=[1, 1, 1, 1])
    info = FakeInfo(4)
    info.global_num_tokens = [0, 0, 2, 0]
    assert tail_recovery.follow_a_forwarding_peer(info, busy, [1], STARTED) == []
    # A peer already inactive here is not followed.
    gone = survivor(monkeypatch, [report(3, "forward", since=101.0, at=129.5)],
                    active=[1, 1, 1, 0])
    info = FakeInfo(4)
    assert tail_recovery.follow_a_forwarding_peer(info, gone, [1], STARTED) == []
    assert info.global_num_tokens == [0, 0, 0, 0]


def test_an_unreadable_store_leaves_the_pass_as_decided(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    state = survivor(monkeypatch, [], active=[1, 1, 1])

    def store_down() -> Any:
        raise TimeoutError("rank 0's store did not answer")

    pass_progress.pass_progress(state).connect = store_down
    info = FakeInfo(3)
    with caplog.at_level("INFO"):
        assert tail_recovery.follow_a_forwarding_peer(info, state, [1], STARTED) == []
    assert info.global_num_tokens == [0, 0, 0]
    assert any("no progress report of ranks [2] readable" in r.getMessage()
               for r in caplog.records)

"""A peer that dies before the DP gather's all-reduce: each survivor learns it from Mooncake
(the all-reduce did not complete with every peer, and which peer failed), takes its own row
back from what it sent, the dead peer's row as idle, and a live peer's row whose check fails as
idle too. A gather with every peer is left as it came. Real ``mooncake-cpu`` group, three
processes, the victim exits between the rounds. Before them, the same processes agree by the
fallback for passes without a gather (a host all-reduce)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import mooncake_gather_workers as W  # noqa: E402

from sglang_elastic_ep_testbed.cluster.procs import free_port  # noqa: E402

WORLD = 3
VICTIM = 2


@pytest.fixture(scope="module")
def outcomes() -> dict[int, tuple[dict, dict, list[str]]]:
    pytest.importorskip("mooncake.pg", reason="needs Mooncake's process group (mooncake.pg)")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=W.run_rank, args=(r, WORLD, port, VICTIM, results))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got: dict[int, tuple[dict, dict, list[str]]] = {}
        while len(got) < WORLD - 1:
            try:
                rank, first, second, verdicts = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"survivors reported {sorted(got)} within 120 s")
            got[rank] = (first, second, verdicts)
        return got
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=10)


def test_a_gather_with_every_peer_is_left_alone(outcomes) -> None:
    for rank, (first, _, _) in outcomes.items():
        assert first["failed"] == [], (rank, first)
        assert first["summed"] == [W.sent_row(r, 0)[0] for r in range(WORLD)], (rank, first)
        assert first["rows"] == [W.sent_row(r, 0) for r in range(WORLD)], (rank, first)


def test_a_survivor_takes_back_its_row_and_idles_the_dead_peer(outcomes) -> None:
    for rank, (_, second, _) in outcomes.items():
        assert second["failed"] == [VICTIM], (rank, second)
        rows = second["rows"]
        assert rows[rank] == W.sent_row(rank, 1), (rank, second)
        assert rows[VICTIM] == W.IDLE, (rank, second)
        # The other survivor's row, with the planted stale value, fails its check.
        other = next(r for r in range(WORLD) if r not in (rank, VICTIM))
        assert rows[other] == W.IDLE, (rank, second)
        assert second["tokens"] == [row[0] for row in rows], (rank, second)


def test_a_pass_without_a_gather_agrees_by_the_host_all_reduce(outcomes) -> None:
    # The last rank is not ready in the first round, so every rank waits; then all enter.
    for rank, (_, _, verdicts) in outcomes.items():
        assert verdicts == ["WAIT", "ENTER"], (rank, verdicts)

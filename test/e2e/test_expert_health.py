"""Per-expert latency health on the CPU cluster: a rank whose experts are slow is reported, then
blocked in the data plane, and the cluster serves on at full speed with the same outputs.

Three launch ranks (NIXL EP), every logical expert on every rank (``--ep-num-redundant-experts
32``: 48 slots, 16 per rank), static dispatch (each rank's tokens use its own replicas). Rank
2's experts really take 200x as long (``SGLANG_EEP_TEST_SLOW_EXPERTS=2:200``: it sleeps the
difference). Under a steady load the HTTP
process's health check (every second, from rank 0's gathered expert timings) marks rank 2's
experts slow; after 25 slow checks the rank is hard-blocked (``recovery_required`` names it and
says why) and its slots are skipped by the expert dispatch: tokens go to the replicas on ranks
0 and 1, which the faster completions show.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import sse_events
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep.sglang.expert_timing import ENV_TEST_SLOW_EXPERTS

BLOCKED_S = 120
WINDOW_S = 8.0  # the first one ends long before the 25th slow check


def wait_hard_blocked(url: str, rank: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/elastic_ep/health", timeout=30).json()
        if health["ranks"][rank]["hard_blocked"]:
            return health
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} not hard-blocked in {timeout_s} s: {health}")
        time.sleep(1.0)


def completions_in(load: LoadClient, seconds: float) -> int:
    before = len(load.snapshot())
    time.sleep(seconds)
    return len(load.snapshot()) - before


@pytest.mark.timeout(900)
def test_a_rank_with_slow_experts_is_reported_and_blocked(tiny_model: Path) -> None:
    spec = ClusterSpec(
        tiny_model, ep_size=3, max_ep_size=4, moe_a2a_backend="nixl",
        # static dispatch: each rank's tokens use its own replicas, so every rank's experts
        # run (and get timed); without it every token takes the first replica (rank 0's).
        extra_args=["--ep-num-redundant-experts", "32", "--ep-dispatch-algorithm", "static",
                    "--elastic-ep-health-interval", "1",
                    "--elastic-ep-slow-expert-checks", "25",
                    "--elastic-ep-slow-expert-threshold", "5"],
    )
    cluster = LocalCluster(spec)
    cluster.env[ENV_TEST_SLOW_EXPERTS] = "2:200"
    with cluster:
        url = cluster.url
        # The load starts the slow checks (rank 2's experts get their first samples), so the
        # first window ends long before the 25th slow check; the reference is taken at the
        # end: outputs must not depend on which replica served a token.
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            slow_rate = completions_in(load, WINDOW_S)
            early = httpx.get(url + "/elastic_ep/health", timeout=30).json()["ranks"][2]
            assert not early["hard_blocked"], early  # the window measured the slow rank
            health = wait_hard_blocked(url, 2, BLOCKED_S)
            time.sleep(3.0)  # the block reaches the schedulers
            fast_rate = completions_in(load, WINDOW_S)
        finally:
            results = load.stop()

        failed = [r for r in results if not r.ok]
        assert not failed, failed[:3]
        reference = greedy_reference(url)
        changed = [r for r in results if r.output_ids != reference[r.prompt]]
        assert not changed, changed[:3]

        ranks = health["ranks"]
        assert ranks[2]["alive"] is True and ranks[2]["unhealthy_experts"], ranks[2]
        assert not ranks[0]["hard_blocked"] and not ranks[1]["hard_blocked"], ranks
        # Every expert of rank 2 is slow; on ranks 0 and 1 a single expert may cross the line
        # now and then (two busy cores), never most of a rank's.
        measured = [e for e in health["experts"] if e["latency_s"] is not None]
        for rank in (0, 1, 2):
            mine = [e for e in measured if e["rank"] == rank]
            slow = [e for e in mine if not e["healthy"]]
            assert mine, (rank, health["experts"])
            if rank == 2:
                assert len(slow) == len(mine), mine
            else:
                assert len(slow) < len(mine) / 2, mine
        assert health["median_latency_s"] > 0

        required = [e for e in sse_events(url) if e["type"] == "recovery_required"]
        assert [e["ranks"] for e in required] == [[2]], required
        assert "slow experts" in required[0]["reason"], required[0]

        primary_log = cluster.primary.log_path.read_text(errors="replace")
        assert "experts of ranks [2] blocked (slow)" in primary_log
        status = read_status(url)
        assert [r["experts"] for r in status["ranks"][:3]] == [list(range(16))] * 3, status
        print(f"completions per {WINDOW_S:g} s: {slow_rate} with rank 2 slow, "
              f"{fast_rate} once blocked")
        assert fast_rate > slow_rate, (slow_rate, fast_rate)

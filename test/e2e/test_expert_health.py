"""Per-expert latency health on the CPU cluster: a rank whose experts are slow is reported, then
blocked in the data plane, and the cluster serves on without it with the same outputs.

Three launch ranks (NIXL EP), every logical expert on every rank (``--ep-num-redundant-experts
32``: 48 slots, 16 per rank), static dispatch (each rank's tokens use its own replicas). Rank
2's experts really take 200x as long (``SGLANG_EEP_TEST_SLOW_EXPERTS=2:200``: it sleeps the
difference). Under a steady load the HTTP
process's health check (every second, from rank 0's gathered expert timings) marks rank 2's
experts slow; after 5 checks that measured them slow the rank is hard-blocked
(``recovery_required`` names it and says why) and its slots are skipped by the expert
dispatch: tokens go to the replicas on ranks 0 and 1. That shows in the rows each rank's
experts computed (rank 0's report in ``/server_info``): a request served by shard 2 adds none
on rank 2.

Then the same cluster stalls on purpose: every scheduler is stopped (SIGSTOP) while requests
wait, as when all wait in a collective for a peer that does not come; after
``--elastic-ep-stall-timeout`` the status and the health report say ``stalled``, and once the
schedulers run again (SIGCONT) the report clears and every request completes. Then one
scheduler's main thread stops alone (SIGUSR1, ``cpu/fault_injection.py``) while its process
lives, a peer that never enters the collective: the others wait for it (in the pass's DP
gather or the forward's expert dispatch), and the stall report says so, rank by rank (each
scheduler's published step, all of them fresh: stuck, not stopped). Last, the same with no
request waiting: the report then comes from the published steps alone (ranks 0 and 2 in an
idle pass's gather past the threshold).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from sglang_elastic_ep.sglang.expert_health import REPORT_KEY
from sglang_elastic_ep.sglang.expert_timing import ENV_TEST_SLOW_EXPERTS
from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import metric, sse_events, wait_status
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cpu.fault_injection import ENV_STALL_S

BLOCKED_S = 300  # a check runs between batches: on three ranks over two cores, seconds apart
# No fault is injected here: a Mooncake timeout long enough that a starved rank is never taken
# for a dead one (the fault tests' 2 s is too short for three ranks on two cores).
COLLECTIVE_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 5.0
ONE_RANK_STALL_S = 20.0  # rank 1's main thread stops this long: below COLLECTIVE_TIMEOUT_S


def wait_hard_blocked(url: str, rank: int, timeout_s: float) -> dict:
    last: list[dict] = []

    def blocked() -> dict | None:
        last[:] = [httpx.get(url + "/elastic_ep/health", timeout=30).json()]
        return last[0] if last[0]["ranks"][rank]["hard_blocked"] else None

    return wait_until(blocked, timeout_s, f"rank {rank} hard-blocked",
                      poll_s=1.0, describe=lambda: last[0] if last else None)


@dataclass
class ExpertRows:
    """Token rows each rank's experts computed so far, read between ``before`` and ``after``."""

    before: float
    after: float
    per_rank: list[int]


def expert_rows(url: str) -> ExpertRows | None:
    """From rank 0's expert report (sglang/expert_health.py), None until it has one."""
    before = time.monotonic()
    states = httpx.get(url + "/server_info", timeout=30).json()["internal_states"]
    after = time.monotonic()
    report = next((s[REPORT_KEY] for s in states if isinstance(s, dict) and REPORT_KEY in s),
                  None)
    if not report or not report.get("local_slots"):
        return None
    local, rows = int(report["local_slots"]), report["rows"]
    return ExpertRows(before, after,
                      [sum(rows[r * local:(r + 1) * local]) for r in range(len(rows) // local)])


def wait_served_without(load: LoadClient, url: str, rank: int, timeout_s: float) -> None:
    """Wait until a whole request served by shard ``rank`` fell in a stretch in which the
    other ranks' experts computed rows and ``rank``'s none: its tokens went elsewhere.

    Static dispatch keeps a shard's tokens on its own rank's replicas unless that rank is
    blocked, so this cannot hold before every rank applies the block. The request must end a
    poll before the last read: the report lags the schedulers by a pass or so."""
    history: list[ExpertRows] = []

    def shown() -> bool:
        now = expert_rows(url)
        if now is None:
            return False
        history.append(now)
        # Rows only grow: ``rank`` computed nothing since the first read with its count now.
        quiet = next(i for i, h in enumerate(history) if h.per_rank[rank] == now.per_rank[rank])
        if quiet > len(history) - 3:
            return False
        start, end = history[quiet].after, history[-2].before
        others = [r for r in range(len(now.per_rank)) if r != rank]
        computed = sum(now.per_rank[r] - history[quiet].per_rank[r] for r in others)
        inside = [r for r in load.snapshot()
                  if r.ok and r.dp_rank == rank and start <= r.started and r.finished <= end]
        return computed > 0 and bool(inside)

    wait_until(shown, timeout_s, f"a request on shard {rank} computed on other ranks only",
               poll_s=1.0, describe=lambda: history[-3:])


@pytest.mark.timeout(900)
def test_a_rank_with_slow_experts_is_reported_and_blocked(tiny_model: Path) -> None:
    spec = ClusterSpec(
        tiny_model, ep_size=3, max_ep_size=4, moe_a2a_backend="nixl",
        collective_timeout_s=COLLECTIVE_TIMEOUT_S, fault_window_s=2 * COLLECTIVE_TIMEOUT_S,
        # static dispatch: each rank's tokens use its own replicas, so every rank's experts
        # run (and get timed); without it every token takes the first replica (rank 0's).
        extra_args=["--ep-num-redundant-experts", "32", "--ep-dispatch-algorithm", "static",
                    "--elastic-ep-health-interval", "1",
                    "--elastic-ep-slow-expert-checks", "5",
                    "--elastic-ep-slow-expert-threshold", "5",
                    "--elastic-ep-stall-timeout", str(STALL_TIMEOUT_S), "--enable-metrics"],
    )
    cluster = LocalCluster(spec)
    cluster.env[ENV_TEST_SLOW_EXPERTS] = "2:200"
    cluster.env[ENV_STALL_S] = str(ONE_RANK_STALL_S)
    with cluster:
        url = cluster.url
        # The load starts the slow checks (rank 2's experts get their first samples); the
        # reference is taken at the end: outputs must not depend on which replica served a
        # token.
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            health = wait_hard_blocked(url, 2, BLOCKED_S)
            # The block reaches the schedulers: shard 2's tokens go to ranks 0 and 1.
            wait_served_without(load, url, 2, BLOCKED_S)
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

        # Every scheduler stops for a while, as when they wait in a collective for a peer that
        # does not come: requests wait and nothing answers. The status and the health report
        # say "stalled" after --elastic-ep-stall-timeout, and stop saying it once the
        # schedulers run again; every request then completes.
        assert read_status(url)["stalled"] is None
        schedulers = [psutil.Process(pid) for pid in cluster.primary.scheduler_pids().values()]
        waiting = LoadClient(url, concurrency=2, max_new_tokens=4).start()
        try:
            for proc in schedulers:
                proc.suspend()
            try:
                stalled = wait_status(url, lambda s: s["stalled"], STALL_TIMEOUT_S + 30,
                                      "the status reports the stall")
                assert stalled["waiting_requests"] >= 1, stalled
                assert "no scheduler has answered" in stalled["message"], stalled
                health = httpx.get(url + "/elastic_ep/health", timeout=30).json()
                assert health["stalled"] is not None, health
                assert metric(url, "sglang:elastic_ep_stalled_seconds") >= STALL_TIMEOUT_S
            finally:
                for proc in schedulers:
                    proc.resume()
            wait_status(url, lambda s: s if s["stalled"] is None else None, 60,
                        "the stall clears once the schedulers answer")
            assert metric(url, "sglang:elastic_ep_stalled_seconds") == 0.0
        finally:
            after = waiting.stop()
        assert after and all(r.ok for r in after), after[:3]

        # Rank 1's main thread stops for ONE_RANK_STALL_S (below Mooncake's collective
        # timeout): ranks 0 and 2 wait for it.
        def stall_with_positions(status: dict) -> dict | None:
            stalled = status["stalled"]
            return stalled if stalled and len(stalled["ranks"]) == 3 else None

        waiting = LoadClient(url, concurrency=2, max_new_tokens=4).start()
        try:
            wait_until(lambda: any(r.ok for r in waiting.snapshot()), 120, "serving again",
                       poll_s=0.5)
            psutil.Process(cluster.primary.scheduler_pids()[1]).send_signal(signal.SIGUSR1)
            stalled = wait_status(url, stall_with_positions, ONE_RANK_STALL_S,
                                  "the stall reported rank by rank")
            at = {r["rank"]: r for r in stalled["ranks"]}
            # Ranks 0 and 2 wait together for rank 1: in the pass's gather, or in the forward's
            # expert dispatch (where the signal found rank 1 decides which), on the same pass.
            assert at[0]["step"] == at[2]["step"] in ("gather", "forward"), stalled
            assert at[0]["passes"] == at[2]["passes"], stalled
            # Every process lives: it reported after it entered its step, while stuck in it
            # (a stopped or dead one's last report predates that).
            assert all(r["report_age_s"] < r["in_step_s"] for r in stalled["ranks"]), stalled
            assert "stopped reporting" not in stalled["message"], stalled
            assert f"in step '{at[0]['step']}'" in stalled["message"], stalled
            wait_status(url, lambda s: s if s["stalled"] is None else None, 120,
                        "the stall clears once rank 1 runs again")
        finally:
            after = waiting.stop()
        assert after and all(r.ok for r in after), after[:3]
        assert not [e for e in sse_events(url) if e["type"] == "rank_failed"]

        # The same with no request waiting: no answer is due, so only the steps the schedulers
        # publish show it. Ranks 0 and 2 sit in an idle pass's gather while rank 1 sleeps.
        def idle_stall(status: dict) -> dict | None:
            stalled = status["stalled"]
            return stalled if stalled and stalled["waiting_requests"] == 0 else None

        psutil.Process(cluster.primary.scheduler_pids()[1]).send_signal(signal.SIGUSR1)
        stalled = wait_status(url, idle_stall, ONE_RANK_STALL_S, "the idle stall reported")
        at = {r["rank"]: r for r in stalled["ranks"]}
        assert at[0]["step"] == at[2]["step"] == "gather", stalled
        assert at[0]["in_step_s"] > STALL_TIMEOUT_S or at[2]["in_step_s"] > STALL_TIMEOUT_S, \
            stalled
        assert "no request waits" in stalled["message"], stalled
        wait_status(url, lambda s: s if s["stalled"] is None else None, 120,
                    "the idle stall clears once rank 1 runs again")
        assert not [e for e in sse_events(url) if e["type"] == "rank_failed"]
        assert greedy_reference(url) == reference

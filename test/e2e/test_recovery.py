"""Kill -9 a rank's node under load and recover it with ``--ep-join-mode recover`` (CPU cluster).

The primary runs two "nodes" (one EP rank each, NIXL EP data plane); node 1 is a separate
process tree, like a second machine. Under a steady client load node 1 is SIGKILLed: the
survivor keeps serving, the requests node 1 was running end with HTTP 503 and a message (never
a hang), the status shows rank 1 failed, and the events reach both SSE and a webhook receiver.
A process relaunched with ``--ep-join-mode recover`` rejoins; the cluster is back at full size,
serves on the recovered shard again, and every completed request decoded the reference tokens.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import DEFAULT_PROMPTS, generate, greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import (
    WebhookReceiver,
    metric,
    sse_events,
    wait_each_shard_serves,
    wait_rank_state,
)

FAULT_SEEN_S = 90
RECOVERED_S = 420
SERVES_S = 180  # for a shard to serve the load after a change (two busy cores)

def event_types(events: list[dict], ranks: list[int]) -> list[str]:
    return [e["type"] for e in events if e.get("ranks") == ranks]


@pytest.mark.timeout(1200)
def test_kill_a_node_under_load_then_recover_it(tiny_model: Path) -> None:
    hook = WebhookReceiver()
    spec = ClusterSpec(
        tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl", nodes=2,
        # Every expert also on the other rank: the survivor serves all of them while its peer
        # is down, so greedy outputs stay identical throughout.
        extra_args=["--ep-num-redundant-experts", "16", "--enable-metrics",
                    "--elastic-ep-webhook-url", hook.url],
    )
    try:
        with LocalCluster(spec) as cluster:
            url = cluster.url
            reference = greedy_reference(url)
            # Two clients, back to back: a dead rank is noticed in a forward pass that needs it,
            # and a request routed to the dead shard waits until then; with one client that
            # request alone could leave the survivor idle, and the death unnoticed.
            load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
            try:
                # Under load on both shards when node 1 dies (node 1's responses may carry no
                # dp_rank: its log shows its batches).
                wait_each_shard_serves(load, [0, 1], SERVES_S,
                                       logs={1: cluster.followers[1].log_path})
                killed_at = time.monotonic()
                cluster.kill_node(1)
                degraded = wait_rank_state(url, 1, "failed", FAULT_SEEN_S)
                assert degraded["phase"] == "serving_degraded", degraded
                assert degraded["ranks"][0]["state"] == "active"
                assert metric(url, "sglang:elastic_ep_failed_ranks") == 1.0
                health = httpx.get(url + "/elastic_ep/health", timeout=30).json()
                assert health["ranks"][1]["alive"] is False, health
                assert health["ranks"][1]["hard_blocked"] is True, health
                wait_each_shard_serves(load, [0], SERVES_S)  # the survivor keeps serving

                cli = subprocess.run(
                    [sys.executable, "-m", "sglang_elastic_ep.cli.main", "status", "--url", url],
                    capture_output=True, text=True, timeout=60,
                )
                assert cli.returncode == 0 and "serving_degraded" in cli.stdout, cli

                cluster.start_node(1, recover=True)
                recovered = wait_rank_state(url, 1, "active", RECOVERED_S)
                assert recovered["phase"] == "serving_recovered", recovered
                assert recovered["effective_ep_size"] == 2
                # Requests on both shards under load again, the recovered one's included.
                wait_each_shard_serves(load, [0, 1], SERVES_S,
                                       logs={1: cluster.followers[1].log_path})
            finally:
                results = load.stop()

            lost = [r for r in results if not r.ok]
            for r in lost:  # only what node 1 held when it died, and said so
                assert r.status == 503 and "failed before it finished" in (r.error or ""), r
                assert r.started < killed_at + FAULT_SEEN_S
            assert len(lost) <= 2, f"more requests lost than were in flight: {lost}"
            changed = [r for r in results if r.ok and r.output_ids != reference[r.prompt]]
            assert not changed, f"outputs changed: {changed[:3]}"

            with httpx.Client() as client:
                after = {p: generate(client, url, p, 8) for p in DEFAULT_PROMPTS}
            assert all(r.ok for r in after.values()), after
            assert {p: r.output_ids for p, r in after.items()} == reference
            recover_log = cluster.followers[1].log_path.read_text(errors="replace")
            assert " DP1 TP1 EP1] Prefill batch" in recover_log, "shard 1 must serve again"
            # The survivor took the join for a recovery: rank 1 served before (EPLB reset).
            survivor_log = cluster.primary.log_path.read_text(errors="replace")
            assert "ranks [1] joined by recovery (slots active before)" in survivor_log
            assert metric(url, "sglang:elastic_ep_failed_ranks") == 0.0
            assert (metric(url, "sglang:elastic_ep_degraded_seconds_total") or 0.0) > 0.0

            expected = ["rank_failed", "recovery_required", "rank_recovered"]
            events = sse_events(url)
            assert event_types(events, [1]) == expected, events
            delivered = hook.wait_for(lambda got: event_types(got, [1]) == expected)
            assert event_types(delivered, [1]) == expected, delivered
    finally:
        hook.close()

"""Runtime scale-down on the CPU cluster under steady load (NIXL EP data plane):
2 -> 3 -> 2 -> 3 -> 1.

One cluster, chained (starting a cluster costs a minute on 2 cores). The launch placement
(``--init-expert-location``) puts experts 0..7 twice on rank 0 and 8..15 twice on rank 1, so
rank 0 alone lacks half of the experts:

1. 2 -> 3 with a joiner (scale-up, covered in detail by test_scale_up.py).
2. 3 -> 2 under load: the router stops sending to shard 2, shard 2 drains, every rank commits
   on one agreed pass; a long request running there finishes normally first, and a second
   scale request meanwhile gets 409. Then the status shows
   ``serving_contracted``, rank 2 ``safe_to_terminate``; the SSE stream carries the operation's
   events; the joiner's server exits by itself with code 0.
3. 2 -> 3 again with a new joiner in the freed slot, through the orchestrator CLI
   (``sglang-eep scale --wait``, exit 0) while ``sglang-eep events --follow`` prints the
   operation's events live.
4. 3 -> 1 under load: two ranks leave at once, and experts 8..15 exist only on them. Their
   weights move P2P into rank 0's duplicate slots on the commit pass before the ranks go; the
   unchanged greedy outputs on one rank show the weights arrived intact.

Throughout: no request fails, and the fixed prompts decode to the same tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep.cluster.load import greedy_reference
from sglang_elastic_ep.cluster.observe import sse_events, wait_operation
from sglang_elastic_ep.cluster.observe import status as read_status

SCALE_TIMEOUT_S = 420
CLI = [sys.executable, "-m", "sglang_elastic_ep.cli.main"]
EXIT_TIMEOUT_S = 60


def scale(url: str, size: int, operation_id: str) -> httpx.Response:
    return httpx.post(url + "/scale_elastic_ep",
                      json={"new_ep_size": size, "operation_id": operation_id}, timeout=60)


def grow_to_3(cluster: LocalCluster, operation_id: str) -> None:
    cluster.start_joiner("scale", rank_offset=2)
    resp = scale(cluster.url, 3, operation_id)
    assert resp.status_code == 200, resp.text
    wait_operation(cluster.url, operation_id, SCALE_TIMEOUT_S)
    status = read_status(cluster.url)
    assert status["effective_ep_size"] == 3, status
    assert status["recent_operations"][0]["result"] == "succeeded", status


@pytest.mark.timeout(1500)
def wait_experts_reported(url: str, ranks: int, timeout_s: float) -> list[list[int]]:
    """The logical experts of ranks ``0..ranks-1`` once the status reports them for exactly
    that many ranks (the health poll refreshes the placement every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = read_status(url)
        experts = [r["experts"] for r in status["ranks"]]
        if all(e is not None for e in experts[:ranks]) and \
                all(e is None for e in experts[ranks:]) and status["effective_ep_size"] == ranks:
            return experts[:ranks]
        assert time.monotonic() < deadline, f"experts of {ranks} ranks not reported: {status}"
        time.sleep(1.0)


def test_scale_down_3_to_2_grow_again_then_3_to_1_moving_experts(tiny_model: Path) -> None:
    # 16 slots per rank: rank 0 holds experts 0..7 twice, rank 1 holds 8..15 twice.
    halves = [*range(8), *range(8), *range(8, 16), *range(8, 16)]
    placement = json.dumps({"physical_to_logical_map": [halves, halves]})  # both MoE layers
    spec = ClusterSpec(tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl",
                       extra_args=["--elastic-ep-drain-timeout", "60",
                                   "--ep-num-redundant-experts", "16",
                                   "--init-expert-location", placement])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)

        assert wait_experts_reported(url, ranks=2, timeout_s=60) == [
            list(range(8)), list(range(8, 16))
        ]

        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        follower: subprocess.Popen[str] | None = None
        try:
            grow_to_3(cluster, "grow-to-3")
            joiner = cluster.joiners[-1]
            time.sleep(3.0)  # load on three shards
            # The scale-up placed experts on the new rank (the status shows each rank's).
            placed = wait_experts_reported(url, ranks=3, timeout_s=60)
            assert placed[2], placed
            assert set().union(*placed) == set(range(16)), placed

            # A long request running on shard 2: the drain must wait for it to finish.
            with ThreadPoolExecutor(1) as pool:
                long_request = pool.submit(
                    httpx.post, url + "/generate", timeout=300,
                    json={"text": "a long answer", "routed_dp_rank": 2,
                          "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                              "ignore_eos": True}},
                )
                time.sleep(1.0)
                shrink = scale(url, 2, "shrink-to-2")
                assert shrink.status_code == 200, shrink.text
                assert shrink.json()["phase"] == "draining", shrink.text
                conflict = scale(url, 3, "too-early")
                assert conflict.status_code == 409, conflict.text
                drained = long_request.result()
            assert drained.status_code == 200, drained.text
            assert drained.json()["meta_info"]["completion_tokens"] == 48, drained.text
            wait_operation(url, "shrink-to-2", SCALE_TIMEOUT_S)
            status = read_status(url)
            assert status["effective_ep_size"] == 2, status
            assert status["phase"] == "serving_contracted", status
            assert status["recent_operations"][0]["result"] == "succeeded", status
            assert [r["state"] for r in status["ranks"][:3]] == [
                "active", "active", "safe_to_terminate"
            ], status
            # The plan: the staying ranks keep exactly their slots, and they hold every expert.
            assert wait_experts_reported(url, ranks=2, timeout_s=60) == placed[:2]
            assert set().union(*placed[:2]) == set(range(16)), placed
            assert read_status(url)["ranks"][2]["experts"] is None
            assert joiner.wait_exit(EXIT_TIMEOUT_S) == 0, joiner.log_tail()
            time.sleep(3.0)  # load on two shards again

            # Grow again into the freed slot, driven by the orchestrator CLI this time, with a
            # live event follower beside it.
            follower = subprocess.Popen(
                [*CLI, "events", "--url", url, "--follow", "--json", "--max-events", "3"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            time.sleep(3.0)  # the follower is connected and past the backlog
            cluster.start_joiner("scale", rank_offset=2)
            grow = subprocess.run(
                [*CLI, "scale", "--url", url, "--to", "3", "--wait", "--operation-id",
                 "grow-again", "--timeout", str(SCALE_TIMEOUT_S), "--http-timeout", "60"],
                capture_output=True, text=True, timeout=SCALE_TIMEOUT_S + 60,
            )
            assert grow.returncode == 0, (grow.returncode, grow.stdout, grow.stderr)
            followed, _ = follower.communicate(timeout=60)
            assert follower.returncode == 0, followed
            time.sleep(3.0)

            # 3 -> 1: experts 8..15 live only on the leaving ranks 1 and 2.
            regrown = wait_experts_reported(url, ranks=3, timeout_s=60)
            assert 8 not in regrown[0], regrown
            shrink = scale(url, 1, "shrink-to-1")
            assert shrink.status_code == 200, shrink.text
            wait_operation(url, "shrink-to-1", SCALE_TIMEOUT_S)
            assert wait_experts_reported(url, ranks=1, timeout_s=60) == [list(range(16))]
            status = read_status(url)
            assert [r["state"] for r in status["ranks"][:3]] == [
                "active", "safe_to_terminate", "safe_to_terminate"
            ], status
            assert cluster.joiners[-1].wait_exit(EXIT_TIMEOUT_S) == 0, \
                cluster.joiners[-1].log_tail()
            time.sleep(3.0)  # load on one rank
        finally:
            results = load.stop()
            if follower is not None and follower.poll() is None:
                follower.kill()

        failed = [r for r in results if not r.ok]
        assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
        changed = [r for r in results if r.output_ids != reference[r.prompt]]
        assert not changed, f"outputs changed: {changed[:3]}"
        assert greedy_reference(url) == reference
        types = [e["type"] for e in sse_events(url) if e.get("operation_id") == "shrink-to-2"]
        assert types == ["scale_requested", "scale_committed", "safe_to_terminate"], types
        live = [json.loads(line) for line in followed.splitlines() if line.startswith("{")]
        assert [(e["type"], e["operation_id"]) for e in live] == [
            ("scale_requested", "grow-again"), ("rank_joined", "grow-again"),
            ("scale_committed", "grow-again"),
        ], followed
        assert read_status(url)["effective_ep_size"] == 1
        primary_log = cluster.primary.log_path.read_text(errors="replace")
        assert "rank 0: moved experts into 16 slots of ranks 0..0 before ranks 1..2 leave" \
            in primary_log

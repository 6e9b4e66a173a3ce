"""A staying rank killed while a scale-down drains: every rank calls the scale-down off.

Three launch-time ranks, one per node (NIXL EP, ``--max-ep-size 4``, every expert on every
rank), under a steady load. A scale-down to 2 is POSTed while a long request runs on shard 2
(the leaving one), so the drain waits for it; node 1 (rank 1, which was to stay) is then
SIGKILLed. The promise (docs/operations.md, "Scale down"): the ranks drop the scale-down
together, the operation ends ``failed`` naming the failed staying rank, the size stays 3 with
rank 1 failed, shard 2 takes requests again and its long request completes. Node 1
relaunched with ``--ep-join-mode recover`` brings the cluster back to three ranks, and the same
scale-down then succeeds: node 2's server exits 0. No request fails except those rank 1 was
running (503 with a message), and every completed request decoded the reference tokens.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import (
    post_scale,
    wait_each_shard_serves,
    wait_operation,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.plans import (
    CHANGE_S,
    FAULT_SEEN_S,
    SERVES_S,
    assert_only_killed_requests_lost,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until

LONG_TOKENS = 64  # three ranks on two cores: a token every second or so, the drain outlasts it
LOAD_CLIENTS = 2


def long_request(url: str, shard: int, running: threading.Event) -> dict:
    """A long greedy request pinned to ``shard``, streamed; its last chunk."""
    body = {"text": "a long answer", "routed_dp_rank": shard, "stream": True,
            "sampling_params": {"max_new_tokens": LONG_TOKENS, "temperature": 0,
                                "ignore_eos": True}}
    last: dict = {}
    with httpx.stream("POST", url + "/generate", json=body, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                last = json.loads(line[5:])
                running.set()
    return last


def states(status: dict) -> list[str]:
    return [r["state"] for r in status["ranks"]]


@pytest.mark.timeout(1800)
def test_a_staying_rank_killed_during_the_drain_calls_the_scale_down_off(
    tiny_model: Path,
) -> None:
    spec = ClusterSpec(tiny_model, ep_size=3, max_ep_size=4, nodes=3, moe_a2a_backend="nixl",
                       extra_args=["--ep-num-redundant-experts", "32"])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        load = LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8).start()
        kills: list[float] = []
        try:
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S,
                                   logs={n: s.log_path for n, s in cluster.followers.items()})
            running = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                on_shard_2 = pool.submit(long_request, url, 2, running)
                wait_until(lambda: running.is_set() or on_shard_2.done(), SERVES_S,
                           "the long request running on shard 2", poll_s=0.1)
                assert running.is_set(), on_shard_2.result()
                post_scale(url, 2, "drain-then-fault")
                wait_status(url, lambda s: s if s["phase"] == "draining" else None, 60,
                            "the scale-down draining")

                # 1. Rank 1 dies while rank 2 drains: the scale-down is called off.
                kills.append(time.monotonic())
                cluster.kill_node(1)
                called_off = wait_operation(url, "drain-then-fault", FAULT_SEEN_S)
                assert called_off["result"] == "failed", called_off
                assert "a staying rank failed during the drain" in called_off["error"], called_off
                after = wait_status(
                    url, lambda s: s if states(s)[:3] == ["active", "failed", "active"] else None,
                    FAULT_SEEN_S, "ranks 0 and 2 active, rank 1 failed")
                assert after["effective_ep_size"] == 3, after
                last = on_shard_2.result()
            assert "error" not in last, last
            assert last["meta_info"]["completion_tokens"] == LONG_TOKENS, last
            wait_each_shard_serves(load, [0, 2], SERVES_S,
                                   logs={2: cluster.followers[2].log_path})

            # 2. Node 1 comes back in recover mode: three ranks again.
            cluster.start_node(1, recover=True)
            wait_status(url, lambda s: s if states(s)[:3] == ["active"] * 3 else None,
                        CHANGE_S, "rank 1 recovered")
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S,
                                   logs={n: s.log_path for n, s in cluster.followers.items()})

            # 3. The same scale-down now goes through; node 2 (rank 2 alone) exits 0.
            post_scale(url, 2, "drain-again")
            done = wait_operation(url, "drain-again", CHANGE_S)
            assert done["result"] == "succeeded", done
            assert cluster.followers[2].wait_exit(SERVES_S) == 0, cluster.followers[2].log_tail()
            wait_each_shard_serves(load, [0, 1], SERVES_S,
                                   logs={1: cluster.followers[1].log_path})
        finally:
            results = load.stop()
        assert_only_killed_requests_lost(results, kills, reference, LOAD_CLIENTS)

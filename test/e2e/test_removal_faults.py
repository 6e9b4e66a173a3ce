"""A live rank killed while its removal below the tail drains (CPU cluster, three nodes).

``{"remove_ranks": [1]}`` with a long request running on shard 1, then node 1 SIGKILLed once
the removal drains. The promise (docs/operations.md, "Faults"), the same as for a leaving rank
of a tail scale-down: the long request ends at once with HTTP 503 and a message (not at the
drain timeout), the removal goes through without the dead rank (no ``rank_failed``: it was
leaving), rank 1 is ``safe_to_terminate`` and the cluster serves on [0, 2]; a scale-up to 3 and
node 1's relaunch with ``--ep-join-mode recover`` then refill the hole. Outside the suite
(``long``): about 6 minutes on a cluster of its own.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep.sglang.args import FAULT_WINDOW_PAST_HEARTBEAT_S
from sglang_elastic_ep_testbed.cluster import LocalCluster
from sglang_elastic_ep_testbed.cluster.load import LoadClient, greedy_reference, stream_on_shard
from sglang_elastic_ep_testbed.cluster.observe import (
    post_scale,
    sse_events,
    wait_each_shard_serves,
    wait_operation,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep_testbed.cluster.plans import (
    CHANGE_S,
    FAULT_SEEN_S,
    SERVES_S,
    assert_only_killed_requests_lost,
    plan_spec,
    steps_of,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until

LONG_TOKENS = 160  # long enough to be running when its rank is killed
DRAIN_TIMEOUT_S = 180
LOST_WITH_SHARD = "failed before it finished"


@pytest.mark.long
@pytest.mark.timeout(1500)
def test_a_live_rank_killed_while_its_removal_drains(tiny_model: Path) -> None:
    spec = plan_spec(tiny_model, steps_of([[0, 1, 2], [0, 2], [0, 1, 2]]))
    assert spec.nodes == 3
    spec.fault_window_s = FAULT_WINDOW_PAST_HEARTBEAT_S  # rank 1 dies below survivor 2
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        kills: list[float] = []
        try:
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S,
                                   logs={r: cluster.followers[r].log_path for r in (1, 2)})
            running = threading.Event()
            with ThreadPoolExecutor(1) as pool:
                long_request = pool.submit(stream_on_shard, url, 1, LONG_TOKENS, running,
                                           DRAIN_TIMEOUT_S + 200)
                wait_until(lambda: running.is_set() or long_request.done(), SERVES_S,
                           "the long request running on shard 1", poll_s=0.1)
                assert running.is_set(), long_request.result()
                answer = httpx.post(url + "/scale_elastic_ep", timeout=60,
                                    json={"remove_ranks": [1], "operation_id": "rm"})
                assert answer.status_code == 200, answer.text
                wait_status(url, lambda s: s if s["phase"] == "draining" else None, 60,
                            "the removal draining")
                assert not long_request.done(), long_request.result()
                kills.append(time.monotonic())
                cluster.kill_server(cluster.followers[1])
                last = long_request.result(timeout=FAULT_SEEN_S)[-1]
            assert LOST_WITH_SHARD in json.dumps(last), last

            operation = wait_operation(url, "rm", FAULT_SEEN_S)
            assert operation["result"] == "succeeded", operation
            status = read_status(url)
            states = [r["state"] for r in status["ranks"][:3]]
            assert (status["effective_ep_size"], states) == \
                (2, ["active", "safe_to_terminate", "active"]), status
            assert "rank_failed" not in [e["type"] for e in sse_events(url)
                                         if e.get("ranks") == [1]]
            wait_each_shard_serves(load, [0, 2], SERVES_S,
                                   logs={2: cluster.followers[2].log_path})

            # The hole is refilled as after any removal.
            post_scale(url, 3, "refill")
            relaunch = cluster.start_node(1, recover=True)
            operation = wait_operation(url, "refill", CHANGE_S)
            assert operation["result"] == "succeeded", operation
            assert read_status(url)["effective_ep_size"] == 3
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S,
                                   logs={1: relaunch.log_path, 2: cluster.followers[2].log_path})
        finally:
            results = load.stop()
    assert_only_killed_requests_lost(results, kills, reference, in_flight=2)

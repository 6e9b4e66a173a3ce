"""A staying rank killed with SIGKILL while a scale-down drains (docs/operations.md, "Faults"). A
leaving rank killed mid-drain is a step of the suite's chain in test_scale_down.py.

Two launch ranks, one node each (NIXL EP, ``--max-ep-size 4``, every expert on every rank), a
steady greedy load, grown to 3 by a scale joiner, then 3 -> 2 while a long request runs on
shard 2, and node 1 (rank 1, a staying rank) is killed mid-drain. The promise: every rank calls
the scale-down off on one agreed pass (the release would hand rank 1's slots to a dead rank),
the operation fails naming the staying rank, the size stays 3 with rank 1 failed, and shard 2
takes requests again. The long request finishes on shard 2 with every token, unless a forward
of it ran while rank 1 died: then it ends with 503 saying so, as every request of such a pass
does (it decodes on every pass, so that is the usual case).

The cluster runs a fault window past Mooncake's heartbeat timeout, as the phase plans do: with
only the joiner's report of rank 1 in a shorter window, Mooncake can evict the joiner in its
place (docs/cpu-testbed.md, "Mooncake deactivated a healthy survivor"). Marker ``long`` (about
3.5 minutes).

Throughout, no request fails except those the killed rank was running (503 with a message), and
every completed request decoded the reference tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_elastic_ep.sglang.args import FAULT_WINDOW_PAST_HEARTBEAT_S
from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import greedy_reference, stream_on_shard
from sglang_elastic_ep_testbed.cluster.observe import (
    operation_events,
    post_scale,
    sse_events,
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

LONG_TOKENS = 160  # long enough to be running when the rank is killed
DRAIN_TIMEOUT_S = 400  # far above the fault detection: a 503 by the drain timeout is told apart
LOAD_CLIENTS = 2
LOST_WITH_SHARD = "failed before it finished"


def states(status: dict) -> list[str]:
    return [r["state"] for r in status["ranks"]]


def drain_then(url: str, operation_id: str, fault: Callable[[], None]
               ) -> tuple[Future[list[dict]], float]:
    """POST 3 -> 2 while a long request runs on shard 2, then run ``fault`` once the
    scale-down drains. The long request's future (its chunks) and when the fault ran."""
    running = threading.Event()
    pool = ThreadPoolExecutor(1)
    on_shard_2 = pool.submit(stream_on_shard, url, 2, LONG_TOKENS, running,
                             DRAIN_TIMEOUT_S + 200)
    pool.shutdown(wait=False)
    wait_until(lambda: running.is_set() or on_shard_2.done(), SERVES_S,
               "the long request running on shard 2", poll_s=0.1)
    assert running.is_set(), on_shard_2.result()
    post_scale(url, 2, operation_id)
    wait_status(url, lambda s: s if s["phase"] == "draining" else None, 60,
                f"{operation_id} draining")
    assert not on_shard_2.done(), on_shard_2.result()
    killed_at = time.monotonic()
    fault()
    return on_shard_2, killed_at


def grow_to_3(cluster: LocalCluster, operation_id: str) -> ServerProcess:
    joiner = cluster.start_joiner("scale", rank_offset=2)
    post_scale(cluster.url, 3, operation_id)
    done = wait_operation(cluster.url, operation_id, CHANGE_S)
    assert done["result"] == "succeeded", done
    return joiner


def _spec(tiny_model: Path, nodes: int) -> ClusterSpec:
    spec = ClusterSpec(tiny_model, ep_size=2, max_ep_size=4, nodes=nodes, moe_a2a_backend="nixl",
                       extra_args=["--ep-num-redundant-experts", "16",
                                   "--elastic-ep-drain-timeout", str(DRAIN_TIMEOUT_S)])
    # Rank 1 dies below the survivor 2: if only rank 2's report reaches Mooncake within the
    # window, Mooncake evicts rank 2 in its place (docs/cpu-testbed.md, "Mooncake
    # deactivated a healthy survivor"); a window past its heartbeat timeout avoids that.
    spec.fault_window_s = FAULT_WINDOW_PAST_HEARTBEAT_S
    return spec


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_a_staying_rank_killed_mid_drain(tiny_model: Path) -> None:
    with LocalCluster(_spec(tiny_model, nodes=2)) as cluster:
        url = cluster.url
        node1 = cluster.followers[1]
        reference = greedy_reference(url)
        load = LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8).start()
        kills: list[float] = []
        try:
            joiner = grow_to_3(cluster, "grow")
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S,
                                   logs={1: node1.log_path, 2: joiner.log_path})
            kept, killed_at = drain_then(url, "shrink", lambda: cluster.kill_node(1))
            kills.append(killed_at)
            called_off = wait_operation(url, "shrink", FAULT_SEEN_S)
            assert called_off["result"] == "failed", called_off
            assert "a staying rank failed during the drain" in called_off["error"], called_off
            after = wait_status(
                url, lambda s: s if states(s)[:3] == ["active", "failed", "active"] else None,
                FAULT_SEEN_S, "ranks 0 and 2 active, rank 1 failed")
            assert after["effective_ep_size"] == 3, after
            last = kept.result(timeout=DRAIN_TIMEOUT_S)[-1]
            finish = last["meta_info"].get("finish_reason") or {}
            if finish.get("status_code") == 503:
                # Its forward ran while rank 1 died: ended as the server promises for any
                # request of such a pass (docs/operations.md, "Faults"), not kept.
                assert "failed during this request's forward pass" in finish["message"], last
            else:  # otherwise it finishes on its shard, which stays
                assert "error" not in last, last
                assert last["meta_info"]["completion_tokens"] == LONG_TOKENS, last
            wait_each_shard_serves(load, [0, 2], SERVES_S, logs={2: joiner.log_path})
        finally:
            results = load.stop()
        assert operation_events(sse_events(url))["shrink"][-1] == "scale_failed"
        assert_only_killed_requests_lost(results, kills, reference, LOAD_CLIENTS)

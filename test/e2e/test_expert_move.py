"""Experts move before ranks leave (#5 item 3), end to end on the CPU cluster under load.

Three launch ranks with 8 slots each (16 experts + 8 redundant) and a placement in which the
leaving rank 2 holds experts 12..15 that no staying rank has:

    rank 0: 0..7    rank 1: 8..11, 0..3    rank 2: 12..15, 4..7

A scale-down to 2 must first move 12..15 into slots of ranks 0 and 1 that hold surplus copies
(0..3 are on both), on the agreed commit pass (``sglang/expert_moves.py``: P2P from rank 2,
which still serves), and only then let rank 2 go. Checked: every rank reports the experts the
pure planner (``core/placement.scale_down_map``) gives, the log names the moved slots, no
request fails, and the fixed prompts decode to the same tokens before, during and after (the
moved weights are the right ones). Rank 2 shares its server with ranks 0 and 1, so it parks
instead of exiting; the status lists it as safe to terminate.

The deployment is launched at its ``--max-ep-size`` (3) and still shrinks
(``sglang/args.reserve_room_to_grow``), and grows back: slot 2 is a launch-time slot, the
shrink's answer says it comes back as a scale joiner, and a joiner launched for it
(``--elastic-ep-join-rank-offset 2``, below the launch size) takes it while the parked rank
stays parked; outputs stay identical through both changes. A request above the maximum gets
400 at every size.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep.core.placement import experts_per_rank, scale_down_map
from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import (
    operation_events,
    sse_events,
    status,
    wait_each_shard_serves,
    wait_experts_reported,
    wait_operation,
)

SLOTS = 8
LAUNCH_ROW = [*range(8), 8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7]
SHRINK_TIMEOUT_S = 300
GROW_TIMEOUT_S = 600  # a joiner starting beside two busy ranks on two cores
SERVES_S = 180  # for every shard to serve the load (two busy cores)


@pytest.mark.timeout(1500)
def test_scale_down_moves_the_leaving_ranks_unique_experts_under_load(tiny_model: Path) -> None:
    placement = json.dumps({"physical_to_logical_map": [LAUNCH_ROW, LAUNCH_ROW]})  # 2 MoE layers
    # Launched at its maximum: it can shrink and grow back, never above 3.
    spec = ClusterSpec(tiny_model, ep_size=3, max_ep_size=3, moe_a2a_backend="nixl",
                       extra_args=["--ep-num-redundant-experts", "8",
                                   "--init-expert-location", placement])
    planned = experts_per_rank(scale_down_map([LAUNCH_ROW], 3, 2, 16)[0][:2 * SLOTS], SLOTS)
    assert planned != experts_per_rank(LAUNCH_ROW[:2 * SLOTS], SLOTS), "the plan must move"
    assert set().union(*planned.values()) == set(range(16)), planned
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        launch = experts_per_rank(LAUNCH_ROW, SLOTS)
        assert wait_experts_reported(url, 3) == [launch[r] for r in range(3)]

        with LoadClient(url, concurrency=1, max_new_tokens=8, pause_s=0.2) as load:
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S)  # load before the shrink
            shrink = httpx.post(url + "/scale_elastic_ep",
                                json={"new_ep_size": 2, "operation_id": "shrink-with-move"},
                                timeout=60)
            assert shrink.status_code == 200, shrink.text
            assert "come back as scale joiners" in shrink.json()["message"]
            operation = wait_operation(url, "shrink-with-move", SHRINK_TIMEOUT_S)
            assert operation["result"] == "succeeded", operation
            wait_each_shard_serves(load, [0, 1], SERVES_S)  # load after the shrink
            above = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 4}, timeout=60)
            assert above.status_code == 400 and "max" in above.text, above.text
            shrunk = status(url)
            assert shrunk["effective_ep_size"] == 2 and shrunk["max_ep_size"] == 3, shrunk
            assert len(shrunk["ranks"]) == 3, shrunk
            assert shrunk["safe_to_terminate_ranks"] == [2], shrunk
            assert wait_experts_reported(url, 2) == [planned[0], planned[1]]

            joiner = cluster.start_joiner("scale", rank_offset=2)
            back = httpx.post(url + "/scale_elastic_ep",
                              json={"new_ep_size": 3, "operation_id": "grow-back"}, timeout=60)
            assert back.status_code == 200, back.text
            operation = wait_operation(url, "grow-back", GROW_TIMEOUT_S)
            assert operation["result"] == "succeeded", operation
            # The joiner serves slot 2 (its responses carry no dp_rank: read its log).
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: joiner.log_path})
            above = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 4}, timeout=60)
            assert above.status_code == 400 and "max" in above.text, above.text
        results = load.snapshot()

        after = status(url)
        assert after["effective_ep_size"] == 3 and after["max_ep_size"] == 3, after
        grown = wait_experts_reported(url, 3)
        assert grown[:2] == [planned[0], planned[1]] and grown[2], grown
        assert joiner.alive(), joiner.log_tail()
        failed = [r for r in results if not r.ok]
        assert results and not failed, f"{len(failed)} of {len(results)} failed: {failed[:3]}"
        changed = [r for r in results if r.output_ids != reference[r.prompt]]
        assert not changed, f"outputs changed: {changed[:3]}"
        assert greedy_reference(url) == reference
        events = operation_events(sse_events(url))
        assert events["shrink-with-move"] == [
            "scale_requested", "scale_committed", "safe_to_terminate"]
        assert events["grow-back"][0] == "scale_requested", events
        assert "scale_committed" in events["grow-back"], events
        primary_log = cluster.primary.log_path.read_text(errors="replace")
        assert "moved experts into" in primary_log
        assert "ranks [2] joined by scale-up (new slots)" in primary_log

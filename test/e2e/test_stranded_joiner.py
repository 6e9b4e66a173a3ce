"""A scale joiner killed below a live one (CPU cluster, four ranks): shrunk past it, or, with a
launch-time rank failed too, the live joiner above stopped so the failed joiners are a tail.

Two launch ranks grow to four with two joiners; the first joiner (rank 2) is killed with
SIGKILL while rank 3 serves above it. A scale-joined rank has no in-place rejoin (its
replacement joins at the tail, once the survivors let the failed tail go), and rank 3 keeps
rank 2 from being a tail, so rank 2 is stranded: a relaunch cannot bring it back. What works
from there, and what every refusal names, is a scale-down past it: ``new_ep_size`` 2 removes
the dead rank 2 together with rank 3, which drains first; a later scale-up refills the slots.
The plan is ``test/plans/kill_a_joiner_below_a_live_one_then_shrink_past_it.json``
(``[[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1], [0, 1, 2]]``).

With a launch-time rank failed together with the stranded joiner, no scale-down is accepted
(it would be called off for the failed staying rank); the refusal names what still works
short of a restart, and the second test follows it: stop the server of the live joiner above
(here SIGKILL, the harshest stop), so the failed joiners are a tail the survivors let go, then
relaunch the launch-time node and the joiners in recover mode. Its plan is
``test/plans/kill_a_node_and_a_joiner_below_a_live_one_then_stop_the_joiner_above.json``
(``[[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, -1, -2, 3], [0, -3], [0, 1], [0, 1, 2, 3]]``).

Marker ``long``: the second joiner starts beside three ranks on two cores (about 6 minutes).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import LocalCluster
from sglang_elastic_ep_testbed.cluster.observe import sse_events
from sglang_elastic_ep_testbed.cluster.plans import Step, load_plan, plan_spec, run_plan

PLANS = Path(__file__).parents[1] / "plans"
PLAN = PLANS / "kill_a_joiner_below_a_live_one_then_shrink_past_it.json"
MIXED_PLAN = PLANS / "kill_a_node_and_a_joiner_below_a_live_one_then_stop_the_joiner_above.json"


@pytest.mark.long
@pytest.mark.timeout(2700)
def test_a_killed_joiner_below_a_live_one_is_shrunk_past(tiny_model: Path) -> None:
    """Every step of the plan is checked by the runner (sets, serving shards, lost requests,
    outputs); at the kill, the refusals of what cannot work name the shrink past rank 2."""
    steps = load_plan(PLAN)
    spec = plan_spec(tiny_model, steps, extra_args=["--enable-metrics"])
    assert spec.nodes == 1  # the launch ranks share one server; each joiner has its own

    def stranded_then_shrunk(step: Step, current: dict) -> None:
        url = cluster.url
        if step.kind == "kill":
            assert current["phase"] == "serving_degraded", current
            assert current["ranks"][2]["state"] == "failed", current
            remove = httpx.post(url + "/scale_elastic_ep", json={"remove_ranks": [2]},
                                timeout=60)
            assert remove.status_code == 422, remove.text
            assert "scale down to 2 instead" in remove.json()["message"], remove.text
            short = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 3}, timeout=60)
            assert short.status_code == 409, short.text  # not past rank 2
            assert "scale down to 2 instead" in short.json()["message"], short.text
            after = httpx.get(url + "/elastic_ep/status", timeout=30).json()
            assert after["effective_ep_size"] == 4 and after["current_operation"] is None, after
        elif step.kind == "shrink":
            assert current["effective_ep_size"] == 2, current
            assert [current["ranks"][r]["state"] for r in (2, 3)] == \
                ["safe_to_terminate", "safe_to_terminate"], current

    with LocalCluster(spec) as cluster:
        run_plan(cluster, steps, after_step=stranded_then_shrunk)
        events = sse_events(cluster.url)
        shrink = [e["type"] for e in events if e.get("operation_id") == "plan-4-shrink"]
        assert shrink == ["scale_requested", "scale_committed", "safe_to_terminate"], events
        faults = [e["type"] for e in events
                  if e.get("ranks") == [2] and e.get("operation_id") is None]
        assert faults and faults[0] == "rank_failed" and "rank_recovered" not in faults, events


@pytest.mark.long
@pytest.mark.timeout(3600)
def test_a_launch_node_failed_with_a_stranded_joiner_recovers_once_the_joiner_above_stops(
        tiny_model: Path) -> None:
    """At the double kill every size change is refused with the way out (stop rank 3); after
    rank 3 stops, the failed joiners [2, 3] are a tail the survivor lets go, node 1 rejoins in
    place, and the joiners' relaunches bring the cluster back to four ranks. The runner checks
    every step (sets, serving shards, lost requests, outputs)."""
    steps = load_plan(MIXED_PLAN)
    spec = plan_spec(tiny_model, steps)
    assert spec.nodes == 2  # node 1 dies and comes back alone

    def refused_then_recovered(step: Step, current: dict) -> None:
        url = cluster.url
        if step.index == 3:
            assert current["phase"] == "serving_degraded", current
            for size in (2, 3):
                refused = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": size},
                                     timeout=60)
                assert refused.status_code == 409, refused.text
                message = refused.json()["message"]
                assert "Stop the servers of ranks [3]" in message, message
            after = httpx.get(url + "/elastic_ep/status", timeout=30).json()
            assert after["effective_ep_size"] == 4 and after["current_operation"] is None, after
        elif step.index == 6:
            assert current["effective_ep_size"] == 4, current

    with LocalCluster(spec) as cluster:
        run_plan(cluster, steps, after_step=refused_then_recovered)
        events = sse_events(cluster.url)
        recovered = {rank for e in events if e["type"] == "rank_recovered"
                     for rank in e.get("ranks", [])}
        assert 1 in recovered, events

"""A scale joiner killed below a live one (CPU cluster, four ranks): relaunched in place,
shrunk past, or let go once the live joiner above dies too.

Two launch ranks grow to four with two joiners; the first joiner (rank 2) is killed with
SIGKILL while rank 3 serves above it. Rank 2 is no failed tail the survivors could let go, so
they await its replacement where it is, as for a launch-time rank: its relaunch with
``--ep-join-mode recover`` rejoins through upstream's recovery over WORLD and takes on the
survivors' size. Plan
``test/plans/kill_a_joiner_below_a_live_one_and_relaunch_it_in_place.json``
(``[[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, 2, 3], [0, -1, -2, 3],
[0, 1, 2, 3]]``): rank 2 alone, then node 1 and rank 2 together, rank 2's relaunch first.

Or it is removed where it is, live (drained first) or failed, and its relaunch refills the
hole (``remove_a_joiner_below_a_live_one_then_refill_it.json``, ``[[0, 1], [0, 1, 2],
[0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, 3], [0, 1, -3], [0, 1, 2, 3]]``);
the last kill leaves the hole with no live rank above, so the failed tail takes it in.

The suite runs these two on one cluster of two nodes: the in-place plan from its start, the
removal plan from its four-rank step, where the first ended (one cluster start, and no step
that only rebuilds a state). Their operation ids carry each plan's own prefix.

Two more ways out run with ``--long`` (``test/plans/long/``), on a cluster of their own: a
scale-down past it, where ``new_ep_size`` 2 removes the dead rank 2 together with rank 3, which
drains first, and a later scale-up refills the slots
(``kill_a_joiner_below_a_live_one_then_shrink_past_it.json``); and, when the live joiner above
dies too, the failed joiners are a tail the survivors let go, and the launch-time rank that
failed with them rejoins first
(``kill_a_node_and_a_joiner_below_a_live_one_then_stop_the_joiner_above.json``). Their kills
repeat states the suite's plans reach (a joiner killed below a live one, then a launch-time
rank with it); what each then does is asserted in that long test.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import LocalCluster
from sglang_elastic_ep_testbed.cluster.observe import log_since, sse_events
from sglang_elastic_ep_testbed.cluster.plans import (
    PlanRunner,
    Step,
    load_plan,
    plan_spec,
    run_plan,
)

PLANS = Path(__file__).parents[1] / "plans"
IN_PLACE_PLAN = PLANS / "kill_a_joiner_below_a_live_one_and_relaunch_it_in_place.json"
REMOVAL_PLAN = PLANS / "remove_a_joiner_below_a_live_one_then_refill_it.json"
SHRUNK_PAST_PLAN = PLANS / "long" / "kill_a_joiner_below_a_live_one_then_shrink_past_it.json"
MIXED_PLAN = (PLANS / "long"
              / "kill_a_node_and_a_joiner_below_a_live_one_then_stop_the_joiner_above.json")


def events_after(url: str, last_id: int) -> list[dict]:
    """The events with ids above ``last_id``: those of the plans run since."""
    return [e for e in sse_events(url) if e["event_id"] > last_id]


def last_event_id(url: str) -> int:
    return max((e["event_id"] for e in sse_events(url)), default=0)


@pytest.mark.timeout(3600)
def test_a_joiner_below_a_live_one_rejoins_in_place_or_is_removed_and_refilled(
        tiny_model: Path) -> None:
    """The in-place plan from its start, then the removal plan from its four-rank step, where
    the first ended, on one cluster of two nodes."""
    in_place, removal = (load_plan(path) for path in (IN_PLACE_PLAN, REMOVAL_PLAN))
    spec = plan_spec(tiny_model, [*in_place, *removal], extra_args=["--enable-metrics"])
    assert spec.nodes == 2  # node 1 dies and comes back alone
    with LocalCluster(spec) as cluster:
        runner = rejoins_in_place(cluster, in_place)
        removed_where_it_is_and_refilled(cluster, removal, runner)


@pytest.mark.long  # about 5 minutes on a cluster of its own: outside the suite
@pytest.mark.timeout(3600)
def test_a_joiner_below_a_live_one_is_let_go_with_the_one_above_or_shrunk_past(
        tiny_model: Path) -> None:
    """The let-go plan from its start, then the shrink-past plan from its four-rank step,
    where the first ended, on one cluster of two nodes."""
    mixed, shrunk_past = (load_plan(path) for path in (MIXED_PLAN, SHRUNK_PAST_PLAN))
    spec = plan_spec(tiny_model, [*mixed, *shrunk_past])
    assert spec.nodes == 2  # node 1 dies and comes back alone
    with LocalCluster(spec) as cluster:
        runner = let_go_with_the_one_above(cluster, mixed)
        shrunk_past_it(cluster, shrunk_past, runner)


def rejoins_in_place(cluster: LocalCluster, steps: list[Step]) -> PlanRunner:
    """Rank 2 killed while rank 3 serves: its relaunch rejoins in place at 4 ranks, rank 3
    serving throughout. Then node 1 and rank 2 are killed together and relaunched, rank 2's
    first (node 1's starts once rank 2's waits): the survivors take both back on one agreed
    pass."""
    runner = run_plan(cluster, steps, concurrency=4, relaunch_order="highest_first",
                      operation_prefix="in-place")
    survivor_log = cluster.primary.log_path.read_text(errors="replace")
    assert "ranks [2] rejoined: serving on 4 ranks again" in survivor_log
    assert "ranks [1, 2] rejoined: serving on 4 ranks again" in survivor_log
    assert "the survivors let go" not in survivor_log  # nothing left the layout
    above = runner.joiners[3].log_path.read_text(errors="replace")
    assert "ranks [1, 2] rejoined: serving on 4 ranks again" in above
    replacement = runner.joiners[2].log_path.read_text(errors="replace")
    assert "rank 2 rejoins at the size the survivors serve on: 4 ranks" in replacement
    assert "registered its cohort" not in replacement
    recovered = [e["ranks"] for e in sse_events(cluster.url) if e["type"] == "rank_recovered"]
    assert any(2 in ranks for ranks in recovered), recovered
    return runner


def removed_where_it_is_and_refilled(cluster: LocalCluster, steps: list[Step],
                                     before: PlanRunner) -> PlanRunner:
    """Rank 2 removed live (its shard drains, its server exits 0) and refilled by its
    relaunch, which rejoins in place; then killed, removed failed, and rank 3 killed too: the
    hole joins the failed tail, and the tail's relaunches bring the cluster back to four."""
    survivor_log_size = cluster.primary.log_path.stat().st_size
    last_id = last_event_id(cluster.url)
    rejoined: list[str] = []

    def holes_then_tail(step: Step, current: dict) -> None:
        if step.index == 5:  # rank 2 killed below the live rank 3
            assert_a_shrink_short_of_rank_2_names_the_ways_out(cluster.url, current)
        elif step.kind == "remove":
            assert current["effective_ep_size"] == 3, current
            assert current["ranks"][2]["state"] == "safe_to_terminate", current
            refused = httpx.post(cluster.url + "/scale_elastic_ep", json={"new_ep_size": 2},
                                 timeout=60)
            assert refused.status_code == 409, refused.text
            assert refused.json()["reason"] == "removed_ranks_present", refused.text
        elif step.index == 4:  # the replacement that refilled the hole: the newest one
            logs = sorted(cluster.spec.log_dir.glob("joiner-recover-r2-*.log"),
                          key=lambda path: path.stat().st_mtime)
            rejoined.append(logs[-1].read_text(errors="replace"))

    runner = run_plan(cluster, steps, after=before, from_step=2, after_step=holes_then_tail,
                      operation_prefix="removal")
    text = log_since(cluster.primary.log_path, survivor_log_size)
    assert "ranks [2] removed where they were" in text
    assert "ranks [2] rejoined: serving on 4 ranks again" in text
    assert rejoined and "rank 2 rejoins at the size the survivors serve on: 4 ranks" \
        in rejoined[0]
    assert "registered its cohort" not in rejoined[0]
    events = events_after(cluster.url, last_id)
    taken_in = [e for e in events if e["type"] == "rank_failed" and e.get("ranks") == [2]
                and "relaunch them all" in e.get("reason", "")]
    assert taken_in, events
    return runner


def assert_a_shrink_short_of_rank_2_names_the_ways_out(url: str, current: dict) -> None:
    """With rank 2 failed below the live rank 3 at four ranks, a scale-down to 3 (not past rank
    2) is refused, naming the three ways that work, and changes nothing."""
    assert current["phase"] == "serving_degraded", current
    assert current["ranks"][2]["state"] == "failed", current
    short = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 3}, timeout=60)
    assert short.status_code == 409, short.text
    for way in ("scale down to 2 instead", "they rejoin in place",
                'remove them where they are: {"remove_ranks": [2]}'):
        assert way in short.json()["message"], short.text
    after = httpx.get(url + "/elastic_ep/status", timeout=30).json()
    assert after["effective_ep_size"] == 4 and after["current_operation"] is None, after


def let_go_with_the_one_above(cluster: LocalCluster, steps: list[Step]) -> PlanRunner:
    """From the plan's start (two launch ranks grown to four): at the double kill every size change
    is refused with the way out (their relaunch: they rejoin in place); rank 3 then dies too, so the
    failed joiners [2, 3] are a tail the survivor lets go, node 1 rejoins in place, and the joiners'
    relaunches bring the cluster back to four ranks."""
    last_id = last_event_id(cluster.url)

    def refused_then_recovered(step: Step, current: dict) -> None:
        if step.index == 3:
            assert current["phase"] == "serving_degraded", current
            for size in (2, 3):
                refused = httpx.post(cluster.url + "/scale_elastic_ep",
                                     json={"new_ep_size": size}, timeout=60)
                assert refused.status_code == 409, refused.text
                message = refused.json()["message"]
                assert "relaunch them with --elastic-ep-join-mode recover" in message, message
            after = httpx.get(cluster.url + "/elastic_ep/status", timeout=30).json()
            assert after["effective_ep_size"] == 4 and after["current_operation"] is None, after
        elif step.index == 6:
            assert current["effective_ep_size"] == 4, current

    runner = run_plan(cluster, steps, after_step=refused_then_recovered,
                      operation_prefix="mixed")
    recovered = {rank for e in events_after(cluster.url, last_id)
                 if e["type"] == "rank_recovered" for rank in e.get("ranks", [])}
    assert 1 in recovered, recovered
    return runner


def shrunk_past_it(cluster: LocalCluster, steps: list[Step], before: PlanRunner) -> None:
    """At the kill, the refusal of a size that cannot work names the three ways that do: the
    relaunch, the shrink past rank 2 and its removal where it is; the shrink past it lets both
    joiners go, and a scale-up refills a slot."""
    last_id = last_event_id(cluster.url)

    def refused_then_shrunk_past(step: Step, current: dict) -> None:
        if step.kind == "kill":
            assert_a_shrink_short_of_rank_2_names_the_ways_out(cluster.url, current)
        elif step.kind == "shrink":
            assert current["effective_ep_size"] == 2, current
            assert [current["ranks"][r]["state"] for r in (2, 3)] == \
                ["safe_to_terminate", "safe_to_terminate"], current

    run_plan(cluster, steps, after=before, from_step=2, after_step=refused_then_shrunk_past,
             operation_prefix="shrunk-past")
    events = events_after(cluster.url, last_id)
    shrink = [e["type"] for e in events if e.get("operation_id") == "shrunk-past-4-shrink"]
    assert shrink == ["scale_requested", "scale_committed", "safe_to_terminate"], events
    faults = [e["type"] for e in events
              if e.get("ranks") == [2] and e.get("operation_id") is None]
    assert faults and faults[0] == "rank_failed" and "rank_recovered" not in faults, events

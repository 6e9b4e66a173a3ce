"""Kill -9 a rank's node under load and recover it with ``--ep-join-mode recover`` (CPU cluster).

The primary runs two "nodes" (one EP rank each, NIXL EP data plane); node 1 is a separate
process tree, like a second machine. Under a steady client load node 1 is SIGKILLed: the
survivor keeps serving, the requests node 1 was running end with HTTP 503 and a message (never
a hang), the status shows rank 1 failed, and the events reach both SSE and a webhook receiver.
A process relaunched with ``--ep-join-mode recover`` rejoins; the cluster is back at full size,
serves on the recovered shard again, and every completed request decoded the reference tokens.
Then the same on the same cluster after a scale-up to 3 (upstream answers
``recovery_unsupported`` there): node 1 is killed again, and this time the operator removes it
where it is (``{"remove_ranks": [1]}``: the cluster serves on ranks [0, 2], not degraded, and
rank 1 is safe to terminate); later a scale-up to 3 refills the hole: its relaunch, with the
same arguments, rejoins in place at 3 ranks while the scale-joined rank 2 serves on, and the
operation commits. The steps are the phase plan
``test/plans/kill_a_node_and_recover_it.json``.

The same cluster then goes on from its step ``[0, 1, 2]``: node 1 and the scale joiner are
killed together (``kill_a_node_and_its_joiner_together``) and both come back (one cluster for
both saves a start-up and a scale-up of the suite's time). With ``--long``, on a cluster of its
own: the same with the failed ranks relaunched the highest first, and both joiners of a 4-rank
cluster killed and relaunched so
(``test/plans/long/kill_a_node_and_joiners_then_relaunch_them_highest_first``); the suite's
plan of a joiner killed below a live one relaunches node 1 and that joiner the highest first
too. A second test, on
three nodes, first kills a launch-time node before any scale, which both survivors take back
(``kill_a_launch_node_with_two_survivors``); on the same cluster it kills two launch-time nodes at
once after a scale-up to 4 and brings both back (``kill_two_launch_nodes_at_once``), then removes
a live launch-time node where it is and refills its hole with a relaunch, shrinks the deployment
below its launch size, kills and recovers a launch-time node at the smaller size, and refills
the released launch slot with a joiner (``remove_a_live_node_then_shrink_recover_and_refill``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep.sglang.args import FAULT_WINDOW_PAST_HEARTBEAT_S
from sglang_elastic_ep_testbed.cluster import LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import DEFAULT_PROMPTS, generate, greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import (
    WebhookReceiver,
    log_since,
    metric,
    sse_events,
    wait_each_shard_serves,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep_testbed.cluster.plans import (
    CHANGE_S,
    FAULT_SEEN_S,
    SERVES_S,
    PlanRunner,
    Step,
    load_plan,
    plan_spec,
    run_plan,
    steps_of,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cpu.fault_injection import ENV_STALL_S


def event_types(events: list[dict], ranks: list[int]) -> list[str]:
    return [e["type"] for e in events if e.get("ranks") == ranks]


PLAN = Path(__file__).parents[1] / "plans" / "kill_a_node_and_recover_it.json"


@pytest.mark.timeout(3000)
def test_kill_a_node_under_load_then_recover_it(tiny_model: Path) -> None:
    """The plan [[0, 1], [0, -1], [0, 1], [0, 1, 2], [0, -1, 2], [0, 2], [0, 1, 2]] (the runner
    checks the set, the serving shards, the lost requests and the outputs at each step), plus
    what an orchestrator sees on the way; then node 1 and the joiner killed together
    (``node_and_joiner_killed_together``)."""
    steps = load_plan(PLAN)
    hook = WebhookReceiver()
    spec = plan_spec(tiny_model, steps, extra_args=["--enable-metrics",
                                                    "--elastic-ep-webhook-url", hook.url])
    assert spec.nodes == 2  # node 1 is a separate process tree, like a second machine

    def degraded_then_recovered(step: Step, current: dict) -> None:
        url = cluster.url
        if step.kind == "kill":
            assert current["phase"] == "serving_degraded", current
            assert metric(url, "sglang:elastic_ep_failed_ranks") == 1.0
            health = httpx.get(url + "/elastic_ep/health", timeout=30).json()
            assert health["ranks"][1]["alive"] is False, health
            assert health["ranks"][1]["hard_blocked"] is True, health
            cli = subprocess.run(
                [sys.executable, "-m", "sglang_elastic_ep.cli.main", "status", "--url", url],
                capture_output=True, text=True, timeout=60,
            )
            assert cli.returncode == 0 and "serving_degraded" in cli.stdout, cli
        elif step.kind == "remove":
            assert current["phase"] == "serving_contracted", current
            assert current["effective_ep_size"] == 2, current
            assert current["ranks"][1]["state"] == "safe_to_terminate", current
            assert metric(url, "sglang:elastic_ep_failed_ranks") == 0.0
            health = httpx.get(url + "/elastic_ep/health", timeout=30).json()
            assert [r["rank"] for r in health["ranks"]] == [0, 2], health
            refused = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 4}, timeout=30)
            assert refused.status_code == 409, refused.text
            assert refused.json()["reason"] == "removed_ranks_present", refused.text
        elif step.kind == "recover":
            refilled = steps[step.index - 1].kind == "remove"  # by a scale-up to 3
            assert current["phase"] == ("serving_expanded" if refilled
                                        else "serving_recovered"), current
            assert current["effective_ep_size"] == len(step.active), current

    try:
        with LocalCluster(spec) as cluster:
            url = cluster.url
            # Two clients, back to back: a dead rank is noticed in a forward pass that needs it,
            # and a request routed to the dead shard waits until then; with one client that
            # request alone could leave the survivor idle, and the death unnoticed.
            runner = run_plan(cluster, steps, concurrency=2, after_step=degraded_then_recovered)
            reference = runner.reference
            with httpx.Client() as client:
                after = {p: generate(client, url, p, 8) for p in DEFAULT_PROMPTS}
            assert all(r.ok for r in after.values()), after
            assert {p: r.output_ids for p, r in after.items()} == reference
            # The second replacement (after the scale-up) took on the survivors' size.
            recover_log = cluster.followers[1].log_path.read_text(errors="replace")
            assert "rank 1 rejoins at the size the survivors serve on: 3 ranks (launched at 2)" \
                in recover_log
            assert " DP1 TP1 EP1] Prefill batch" in recover_log, "shard 1 must serve again"
            # The survivors took the join for a recovery: rank 1 served before (EPLB reset);
            # after the scale-up both took it back in place, the scale-joined rank 2 too.
            survivor_log = cluster.primary.log_path.read_text(errors="replace")
            assert "ranks [1] joined by recovery (slots active before)" in survivor_log
            joiner_log = runner.joiners[2].log_path.read_text(errors="replace")
            for log in (survivor_log, joiner_log):
                assert "launch-time ranks [1] rejoined: serving on 3 ranks again" in log
            assert metric(url, "sglang:elastic_ep_failed_ranks") == 0.0
            assert (metric(url, "sglang:elastic_ep_degraded_seconds_total") or 0.0) > 0.0

            expected = ["rank_failed", "recovery_required", "rank_recovered",
                        "rank_failed", "recovery_required",
                        "scale_requested", "scale_committed", "safe_to_terminate",
                        "scale_requested", "rank_recovered", "scale_committed"]
            events = sse_events(url)
            assert event_types(events, [1]) == expected, events
            delivered = hook.wait_for(lambda got: event_types(got, [1]) == expected)
            assert event_types(delivered, [1]) == expected, delivered

            # The same cluster goes on with the next plan, from its step [0, 1, 2].
            node_and_joiner_killed_together(cluster, runner)
    finally:
        hook.close()


TOGETHER = Path(__file__).parents[1] / "plans" / "kill_a_node_and_its_joiner_together.json"
HIGHEST_FIRST = (Path(__file__).parents[1] / "plans" / "long"
                 / "kill_a_node_and_joiners_then_relaunch_them_highest_first.json")


def node_and_joiner_killed_together(cluster: LocalCluster, before: PlanRunner) -> PlanRunner:
    """The plan [[0, 1], [0, 1, 2], [0, -1, -2], [0, 1, 2]] from its step [0, 1, 2] (where
    ``before`` left ``cluster``): node 1 (launch-time rank 1) and the scale joiner (rank 2) are
    killed together. Rank 0 lets slot 2 go and serves alone; node 1's relaunch rejoins at 2
    ranks and waits with rank 0 for slot 2's replacement, which both then admit back to 3. Four
    clients: a death is noticed by a forward pass that needs the dead rank, so rank 0 must hold
    a request when the two die (docs/cpu-testbed.md, "A known gap")."""
    steps = load_plan(TOGETHER)
    assert plan_spec(cluster.spec.model_path, steps).nodes == cluster.spec.nodes
    runner = run_plan(cluster, steps, concurrency=4, after=before, from_step=1)
    survivor_log = cluster.primary.log_path.read_text(errors="replace")
    assert "ranks 2..2 failed; the survivors let go of their slots and serve on 2" \
        in survivor_log
    assert "launch-time ranks [1] rejoined: serving on 2 ranks again" in survivor_log
    node1_log = cluster.followers[1].log_path.read_text(errors="replace")
    for line in ("rank 1 rejoins at the size the survivors serve on: 2 ranks",
                 "the survivors wait for the replacement of ranks 2..2: this rank waits "
                 "with them",
                 "replacement of launch-time rank 1 serves again; its rejoin: rejoining",
                 "replacement for ranks 2..2 registered: re-admitting it"):
        assert line in node1_log, line
    joiner_log = runner.joiners[2].log_path.read_text(errors="replace")
    assert "scale joiner serves EP ranks [2] at EP size 3" in joiner_log
    assert read_status(cluster.url)["effective_ep_size"] == 3
    return runner


@pytest.mark.long  # about 7 minutes on a cluster of its own: outside the suite
@pytest.mark.timeout(1800)
def test_a_node_hung_beside_a_killed_joiner_is_named_by_the_stall_and_both_come_back(
        tiny_model: Path) -> None:
    """The plan of ``node_and_joiner_killed_together`` with node 1 hung in its pass instead of
    killed (SIGUSR1: its process and its Mooncake agent stay alive), beside the joiner's kill:
    rank 0 waits for node 1 in its collective for good, and Mooncake never fails a live peer.
    The stall report names rank 2 (dead) at once, and node 1 as well once Mooncake has had the
    time to count rank 2 out; ending what it names, as an orchestrator does, frees rank 0,
    which serves alone until both relaunches are back at 3 ranks."""
    steps = load_plan(TOGETHER)
    spec = replace(plan_spec(tiny_model, steps), extra_env={ENV_STALL_S: "3600"})
    with LocalCluster(spec) as cluster:
        run_plan(cluster, steps, concurrency=4, kill="hang_first")
        survivor_log = cluster.primary.log_path.read_text(errors="replace")
        assert "elastic EP: serving stalled" in survivor_log
        assert "elastic EP: serving resumed after a stall" in survivor_log
        assert "ranks 2..2 failed; the survivors let go of their slots and serve on 2" \
            in survivor_log
        assert "launch-time ranks [1] rejoined: serving on 2 ranks again" in survivor_log
        assert read_status(cluster.url)["effective_ep_size"] == 3


@pytest.mark.long  # about 8 minutes on a cluster of its own: outside the suite
@pytest.mark.timeout(1800)
def test_a_replacement_killed_as_it_is_taken_back_is_failed_and_relaunched(
        tiny_model: Path) -> None:
    """The plan [[0, 1], [0, 1, 2], [0, -1, -2], [0, 1, 2]], with node 1's first replacement
    SIGKILLed the moment rank 0 logs that it takes it back (the fault row "a replacement killed
    during its own recovery"). Wherever the kill lands (inside the take-back, or just after
    it), the promise is the same: rank 0 serves on, rank 1 shows failed, and the next relaunch
    is taken back."""
    steps = load_plan(TOGETHER)
    killed_in_recovery: list[str] = []
    with LocalCluster(plan_spec(tiny_model, steps)) as cluster:

        def kill_the_first_replacement_as_it_is_taken_back(runner: PlanRunner, rank: int,
                                                           server: ServerProcess) -> None:
            """Kill the first replacement as rank 0 takes it back; relaunch once it shows
            failed and rank 0 serves alone."""
            if killed_in_recovery:
                return
            taking_back = f"takes back launch-time ranks [{rank}]"
            log = cluster.primary.log_path
            offset = log.stat().st_size
            wait_until(lambda: taking_back in log_since(log, offset), CHANGE_S,
                       f"rank 0 taking back rank {rank}", poll_s=0.05)
            runner.kills.append(time.monotonic())
            cluster.kill_server(server)
            killed_in_recovery.append(log_since(log, offset))
            wait_status(cluster.url, lambda s: s if s["ranks"][rank]["state"] == "failed" else None,
                        FAULT_SEEN_S, f"rank {rank} failed again")
            wait_each_shard_serves(runner.load, [0], SERVES_S)
            cluster.start_node(rank, recover=True)

        run_plan(cluster, steps, concurrency=4,
                 on_relaunch=kill_the_first_replacement_as_it_is_taken_back)
        assert killed_in_recovery, "the first replacement was never killed"


BEFORE_ANY_SCALE = (Path(__file__).parents[1] / "plans"
                    / "kill_a_launch_node_with_two_survivors.json")
TWO_AT_ONCE = Path(__file__).parents[1] / "plans" / "kill_two_launch_nodes_at_once.json"
AFTER_A_LIVE_REMOVAL = (Path(__file__).parents[1] / "plans"
                        / "remove_a_live_node_then_shrink_recover_and_refill.json")


@pytest.mark.timeout(2700)
def test_launch_nodes_killed_one_then_two_at_once_then_a_live_node_removed_and_refilled(
        tiny_model: Path) -> None:
    """Three plans on one cluster of three nodes, under load.

    First [[0, 1, 2], [0, -1, 2], [0, 1, 2]] (``kill_a_launch_node_with_two_survivors``): node 1
    killed before any scale, ranks 0 and 2 serve on, and both take its relaunch back on one
    agreed pass (upstream's own recovery has each survivor enter on the pass it sees the
    replacement).

    Then nodes 1 and 2 killed together after a scale-up to 4 (``two_launch_nodes_killed_at_once``).

    Then, from the last step, [[0, 1, 2], [0, 2], [0, 1, 2], [0, 1], [0, -1], [0, 1], [0, 1, 2]]
    (``remove_a_live_node_then_shrink_recover_and_refill``). ``remove_ranks: [1]`` with node 1
    serving: its shard drains, every rank lets it go on one agreed pass and its server exits 0;
    the cluster serves on [0, 2], rank 1 safe to terminate and not failed; a scale-up to 3 and
    node 1's relaunch in recover mode refill the hole. Then the shrink releases launch-time
    rank 2 (its server exits 0) and lowers the launch-group boundary to 2. At 2 ranks node 1's
    scheduler alone is killed, as the OOM killer would: its server must exit non-zero by itself
    (the runner checks), so that an orchestrator relaunches it; it rejoins in place at 2 (its
    replacement reads the boundary from the store); then a scale joiner refills slot 2."""
    first = load_plan(BEFORE_ANY_SCALE)
    steps = load_plan(AFTER_A_LIVE_REMOVAL)
    # The fault window the first two need.
    spec = plan_spec(tiny_model, [*first, *load_plan(TWO_AT_ONCE), *steps])
    assert spec.nodes == 3 and spec.fault_window_s == FAULT_WINDOW_PAST_HEARTBEAT_S

    def recovered(step: Step, status: dict) -> None:
        if step.kind == "recover":
            assert status["phase"] == "serving_recovered", status

    def hole_then_refilled(step: Step, status: dict) -> None:
        if step.index == 1:  # removed where it was: a hole, not a failure
            states = [r["state"] for r in status["ranks"][:3]]
            assert (status["effective_ep_size"], states) == \
                (2, ["active", "safe_to_terminate", "active"]), status
            assert status["recent_operations"][0]["result"] == "succeeded", status
        if step.index == 2:
            assert status["effective_ep_size"] == 3, status

    with LocalCluster(spec) as cluster:
        before = run_plan(cluster, first, after_step=recovered)
        for rank, server in ((0, cluster.primary), (2, cluster.followers[2])):
            log = server.log_path.read_text(errors="replace")
            assert f"rank {rank} takes back launch-time ranks [1] at 3 ranks" in log
            assert "launch-time ranks [1] rejoined: serving on 3 ranks again" in log

        before = two_launch_nodes_killed_at_once(cluster, before)
        runner = run_plan(cluster, steps, after=before, after_step=hole_then_refilled,
                          kill="scheduler")
        node1_log = cluster.followers[1].log_path.read_text(errors="replace")
        assert "rank 1 rejoins at the size the survivors serve on: 2 ranks (launched at 3)" \
            in node1_log
        joiner_log = runner.joiners[2].log_path.read_text(errors="replace")
        assert "scale joiner serves EP ranks [2] at EP size 3" in joiner_log
        primary_log = cluster.primary.log_path.read_text(errors="replace")
        assert "ranks [1] removed where they were: serving on [0, 2]" in primary_log
        assert "ranks [2] joined by scale-up (new slots)" in primary_log
        assert read_status(cluster.url)["effective_ep_size"] == 3


def two_launch_nodes_killed_at_once(cluster: LocalCluster, before: PlanRunner) -> PlanRunner:
    """The plan [[0, 1, 2], [0, 1, 2, 3], [0, -1, -2, 3], [0, 1, 2, 3], [0, 1, 2]]
    (``kill_two_launch_nodes_at_once``) where ``before`` left ``cluster``: after a scale-up to
    4, launch-time nodes 1 and 2 are killed together while the scale joiner serves on; both are
    relaunched in recover mode at once, the survivors (rank 3 too) wait until both replacements
    are in WORLD and take them back on one agreed pass, at 4 ranks; a shrink then releases the
    joiner."""
    steps = load_plan(TWO_AT_ONCE)
    assert plan_spec(cluster.spec.model_path, steps).nodes == cluster.spec.nodes
    survivor_log_before = len(cluster.primary.log_path.read_text(errors="replace"))
    joiners_before = len(cluster.joiners)
    runner = run_plan(cluster, steps, after=before)
    survivor_log = cluster.primary.log_path.read_text(errors="replace")[survivor_log_before:]
    assert "launch-time ranks [1, 2] rejoined: serving on 4 ranks again" in survivor_log
    # The shrink released the plan's one joiner (rank 3): the runner no longer lists it.
    (joiner,) = cluster.joiners[joiners_before:]
    assert 3 not in runner.joiners and joiner.wait_exit(60) == 0, joiner.state()
    joiner_log = joiner.log_path.read_text(errors="replace")
    assert "launch-time ranks [1, 2] rejoined: serving on 4 ranks again" in joiner_log
    for node in (1, 2):
        log = cluster.followers[node].log_path.read_text(errors="replace")
        assert f"rank {node} rejoins at the size the survivors serve on: 4 ranks (launched " \
            "at 3)" in log
    assert read_status(cluster.url)["effective_ep_size"] == 3
    return runner


@pytest.mark.long  # about 4 minutes on a cluster of its own: outside the suite
@pytest.mark.timeout(1800)
def test_failed_ranks_relaunched_at_once_highest_first(tiny_model: Path) -> None:
    """The plan [[0, 1], [0, 1, 2], [0, -1, -2], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, -3],
    [0, 1, 2, 3]] on two nodes, with every recover step relaunching its failed ranks the highest
    first, the joiners before the launch-time node, each started once the one before waits for
    the survivors (an orchestrator restarting failed pods in any order). First node 1 and joiner
    2 die together: joiner 2's replacement registers first and waits in its admission until node
    1's replacement has rejoined in place. Then, at four ranks, both joiners die: rank 3's
    replacement registers first and waits until rank 2's is re-admitted at 3 ranks, then comes
    in at 4. The runner checks every step (sets, serving shards, lost requests, outputs); four
    clients, as in the plan of a node and its joiner killed together."""
    steps = load_plan(HIGHEST_FIRST)
    spec = plan_spec(tiny_model, steps)
    assert spec.nodes == 2  # node 1 dies and comes back alone
    with LocalCluster(spec) as cluster:
        runner = run_plan(cluster, steps, concurrency=4, relaunch_order="highest_first")
        survivor_log = cluster.primary.log_path.read_text(errors="replace")
        assert read_status(cluster.url)["effective_ep_size"] == 4
    rejoined = survivor_log.index("launch-time ranks [1] rejoined: serving on 2 ranks again")
    readmitted = survivor_log.index("replacement for ranks 2..2 registered: re-admitting it")
    assert rejoined < readmitted  # the joiner started first waited for the node
    assert "ranks [2] are back (3 ranks); ranks 3..3 await their replacement" in survivor_log
    assert "recovered ranks that joined by scale-up: back at 4 ranks" in survivor_log
    for rank in (2, 3):
        log = runner.joiners[rank].log_path.read_text(errors="replace")
        assert f"scale joiner serves EP ranks [{rank}] at EP size {rank + 1}" in log, rank


@pytest.mark.timeout(900)
def test_a_rank_that_dies_while_every_rank_idles_is_reported(tiny_model: Path) -> None:
    """Two nodes and no request running: node 1 is SIGKILLed while both ranks idle. No
    forward pass runs to notice it; Mooncake evicts rank 1 from its groups, and rank 0's idle
    iterations carry that to the status (rank 1 failed, ``serving_degraded``) instead of
    leaving shard 1 in routing. Requests sent afterwards go to shard 0 and decode the
    reference tokens."""
    spec = plan_spec(tiny_model, steps_of([[0, 1], [0, -1]]))
    assert spec.nodes == 2
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        cluster.kill_node(1)
        current = wait_status(url, lambda s: s if s["ranks"][1]["state"] == "failed" else None,
                              FAULT_SEEN_S, "rank 1 failed while every rank idled")
        assert current["phase"] == "serving_degraded", current
        with httpx.Client() as client:
            after = {p: generate(client, url, p, 8) for p in DEFAULT_PROMPTS}
        assert all(r.ok for r in after.values()), after
        assert {p: r.output_ids for p, r in after.items()} == reference
        log = cluster.primary.log_path.read_text(errors="replace")
        assert "ranks [1] evicted by Mooncake while this rank idled" in log

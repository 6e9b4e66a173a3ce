"""Runtime scale-up, recovery after it and scale-down on the CPU cluster under steady load
(NIXL EP), with EPLB rebalancing at every size.

The launch placement puts each half of the experts twice on one rank (``HALVES``: rank 0 holds
experts 0..7 in all 16 slots, rank 1 holds 8..15), the layout whose outputs once changed after
a scale-up (upstream loaded only one of a rank's two replicas of an expert). EPLB is on with a
short interval and ``--elastic-ep-expert-min-ranks 2``, so every layout it installs keeps each
expert on two ranks and a rank fault never leaves an expert without a replica: that is what
keeps greedy outputs exact through the fault below.

1. At 2 ranks EPLB rebalances (the status lists a rebalance at 2 and both ranks hold every
   expert: the layout is no longer the launch one).
2. 2 -> 3 with the joiner launched before the POST and rank 1 injected 3 passes late. The
   existing ranks keep serving, the DP router sends requests to the new shard, the
   operation's events arrive over SSE and at a webhook receiver in order, and rank 0's log
   says the join was a scale-up (new slots: EPLB re-armed). EPLB rebalances at 3.
3. The joiner is killed with SIGKILL and relaunched with ``--ep-join-mode recover`` (upstream
   answers ``recovery_unsupported`` after a scale): the survivors keep serving, let go of its
   slot and re-admit the replacement, each step held back by the late rank; EPLB rebalances
   at 3 again.
4. 3 -> 2: the experts only rank 2 holds move first; EPLB rebalances at 2 again.

Throughout: no request fails except those the killed rank held (503 with a message), and the
fixed prompts decode to the same tokens before, during and after. Steps 2-4 are the phase plan
``test/plans/grow_kill_the_joiner_recover_shrink.json``, run by the plan runner. Killing the
replacement in turn and removing it is a second test, outside the suite (``long``), on two
nodes: the survivors have been seen waiting on each other inside Mooncake after that kill, and
the stall report then names node 1 to relaunch.

2 -> 3 -> 4 (joiners launched before the POST) and 2 -> 4 (the joiner launched after the POST)
are in test_scale_down.py's chain.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep.sglang.gather_agreement import ENV_TEST_SKEW
from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import (
    RequestResult,
    greedy_reference,
    most_lost_to_a_kill,
)
from sglang_elastic_ep_testbed.cluster.observe import (
    WebhookReceiver,
    batches_run_by,
    metric,
    operation_events,
    sse_events,
    wait_each_shard_serves,
    wait_operation,
    wait_rank_state,
    wait_rebalanced,
)
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep_testbed.cluster.plans import (
    FAULT_SEEN_S,
    PlanRunner,
    Step,
    load_plan,
    run_plan,
    wait_failed_or_follow_the_stall,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until

SCALE_TIMEOUT_S = 420

def wait_for_phase(url: str, operation_id: str, timeout_s: float) -> dict:
    """The status once ``operation_id`` finished."""
    wait_operation(url, operation_id, timeout_s)
    return read_status(url)


SCALE_EVENTS = ["scale_requested", "rank_joined", "scale_committed"]


def assert_growing_2_to_3_refuses_another_scale(url: str, answer: dict) -> None:
    """``answer``, the accepted POST 2 -> 3, says so; a second scale request meanwhile gets 409,
    from the API and from the orchestrator CLI (exit code 3)."""
    assert answer["message"] == "Scaling initiated from 2 to 3, polling for new ranks"
    assert (answer["old_ep_size"], answer["new_ep_size"]) == (2, 3), answer
    conflict = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 4}, timeout=60)
    assert conflict.status_code == 409, conflict.text
    cli = subprocess.run(
        [sys.executable, "-m", "sglang_elastic_ep.cli.main", "scale", "--url", url, "--to", "4",
         "--http-timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == 3 and "conflict" in cli.stdout, (cli.returncode, cli.stdout)


def assert_followed_across_processes(cluster: LocalCluster, operation_id: str) -> None:
    """Each launch-time scheduler's lines carry ``operation_id`` (rank 1's are in its node's
    log when it has one)."""
    for rank in (0, 1):
        server = cluster.followers.get(rank, cluster.primary)
        log = server.log_path.read_text(errors="replace")
        assert f"EP{rank}] [op {operation_id}] [elastic-ep] scale request" in log


def grow_2_to_3_joiner_first(cluster: LocalCluster, operation_id: str) -> ServerProcess:
    """Launch the joiner, POST 2 -> 3, check the answer and the 409 for a second request, and
    wait for the commit; returns the joiner."""
    url = cluster.url
    joiner = cluster.start_joiner("scale", rank_offset=2)
    resp = httpx.post(url + "/scale_elastic_ep",
                      json={"new_ep_size": 3, "operation_id": operation_id}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert_growing_2_to_3_refuses_another_scale(url, resp.json())
    status = wait_for_phase(url, operation_id, SCALE_TIMEOUT_S)
    assert status["effective_ep_size"] == 3, status
    assert status["recent_operations"][0]["result"] == "succeeded", status
    assert status["phase"] == "serving_expanded", status
    assert_followed_across_processes(cluster, operation_id)
    return joiner


def assert_nothing_lost(results: list[RequestResult], reference: dict[str, list[int]]) -> None:
    failed = [r for r in results if not r.ok]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    changed = [r for r in results if r.output_ids != reference[r.prompt]]
    assert not changed, f"outputs changed during scaling: {changed[:3]}"
    # How many completed says how fast the machine is, not whether serving continued: the
    # test waits for requests on every live shard after each change instead.
    assert results


# Three ranks on two cores are slow right after a commit (the first batch of a new shard
# takes a while: docs/cpu-testbed.md); also the bound for serving to resume after a change.
JOINER_SERVES_S = 180


def wait_until_served(log_path: Path, shard: int, timeout_s: float) -> int:
    """Prefill batches shard ``shard`` ran, once there is at least one."""
    return wait_until(lambda: batches_run_by(log_path, shard), timeout_s,
                      f"a batch run by shard {shard}", poll_s=1.0)


def rank_events(events: list[dict], rank: int) -> list[str]:
    return [e["type"] for e in events if e.get("ranks") == [rank] and not e.get("operation_id")]


RECOVERY_EVENTS = ["rank_failed", "recovery_required", "rank_recovered"]
# Two clients, back to back: a dead rank is noticed in a forward pass that needs it, and a
# request routed to the dead shard waits until then; with one client that request alone could
# leave every live rank idle, and the death unnoticed (docs/cpu-testbed.md).
LOAD_CLIENTS = 2


def rebalances(url: str) -> int:
    return len(read_status(url)["eplb_rebalances"])


def assert_every_expert_on_two_ranks(current: dict, size: int) -> None:
    """What ``--elastic-ep-expert-min-ranks 2`` promises of an installed layout."""
    held: dict[int, set[int]] = {}
    for rank in current["ranks"][:size]:
        for expert in rank["expert_slots"]:
            held.setdefault(expert, set()).add(rank["rank"])
    assert sorted(held) == list(range(16)), current["ranks"]
    assert all(len(ranks) >= 2 for ranks in held.values()), held


def grow_kill_and_recover(
    cluster: LocalCluster, load: LoadClient
) -> tuple[ServerProcess, float, int]:
    """2 -> 3 with the joiner first, an EPLB rebalance at 3, SIGKILL of the joiner, its relaunch
    with ``--ep-join-mode recover``; returns the replacement, when the joiner was killed and
    the batches the joiner ran."""
    url = cluster.url
    seen = rebalances(url)
    joiner = grow_2_to_3_joiner_first(cluster, "grow-to-3")
    primary_log = cluster.primary.log_path.read_text(errors="replace")
    assert "ranks [2] joined by scale-up (new slots)" in primary_log
    # Kill it once it serves: a death during its first handshake is the NIXL buffer's test
    # (test_joiner_dying_in_its_first_handshake_...).
    served_by_joiner = wait_until_served(joiner.log_path, 2, JOINER_SERVES_S)
    assert_every_expert_on_two_ranks(wait_rebalanced(url, 3, seen, REBALANCED_S), 3)

    killed_at = time.monotonic()
    cluster.kill_server(joiner)
    degraded = wait_rank_state(url, 2, "failed", FAULT_SEEN_S)
    assert degraded["phase"] == "serving_degraded", degraded
    assert degraded["effective_ep_size"] == 3, degraded
    # The survivors keep serving.
    wait_each_shard_serves(load, [0, 1], JOINER_SERVES_S)

    seen = rebalances(url)
    replacement = cluster.start_joiner("recover", rank_offset=2)
    recovered = wait_rank_state(url, 2, "active", SCALE_TIMEOUT_S)
    assert recovered["phase"] == "serving_recovered", recovered
    assert recovered["effective_ep_size"] == 3, recovered
    # Load on three shards again, the replacement's included.
    wait_each_shard_serves(load, [0, 1, 2], JOINER_SERVES_S, logs={2: replacement.log_path})
    assert_every_expert_on_two_ranks(wait_rebalanced(url, 3, seen, REBALANCED_S), 3)
    return replacement, killed_at, served_by_joiner


HALVES = [*range(8), *range(8), *range(8, 16), *range(8, 16)]  # 2 ranks x 16 slots
EPLB_PASSES = 30  # forward passes between rebalances (seconds under this load)
REBALANCED_S = 240  # for a rebalance at a new size (three busy ranks on two cores)


def skewed_cluster(tiny_model: Path, hook: WebhookReceiver, nodes: int = 1) -> LocalCluster:
    placement = json.dumps({"physical_to_logical_map": [HALVES, HALVES]})  # both MoE layers
    spec = ClusterSpec(
        tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl", nodes=nodes,
        extra_args=["--ep-num-redundant-experts", "16", "--enable-metrics",
                    "--elastic-ep-webhook-url", hook.url, "--init-expert-location", placement,
                    "--enable-eplb", "--eplb-rebalance-num-iterations", str(EPLB_PASSES),
                    "--expert-distribution-recorder-buffer-size", str(EPLB_PASSES),
                    "--elastic-ep-expert-min-ranks", "2"],
    )
    cluster = LocalCluster(spec)
    cluster.env[ENV_TEST_SKEW] = "1:3"
    return cluster


PLAN = Path(__file__).parents[1] / "plans" / "grow_kill_the_joiner_recover_shrink.json"


@pytest.mark.timeout(1500)
def test_grow_recover_the_joiner_and_shrink_with_eplb_and_a_late_rank(tiny_model: Path) -> None:
    """The plan [[0, 1], [0, 1, 2], [0, 1, -2], [0, 1, 2], [0, 1]] (the runner checks the set,
    the serving shards, the lost requests and the outputs at each step), rank 1 seeing each
    membership change 3 passes late (injected skew).

    2 -> 3 under load, the POST before the joiner starts (a second scale request meanwhile is
    refused, and the operation cannot end before the joiner is up): rank 0 keeps serving until
    rank 1 catches up, then both admit the joiner on the same pass. Then the joiner (rank 2,
    which joined by scale-up: upstream answers ``recovery_unsupported``) is killed with
    SIGKILL under load and relaunched with ``--ep-join-mode recover``: the survivors let go of
    its slot and re-admit the replacement, again held back by the late rank; back at 3 ranks,
    shard 2 serves again. Then 3 -> 2.
    EPLB rebalances at each size on the way (module docstring)."""
    steps = load_plan(PLAN)
    seen: list[int] = []  # EPLB rebalances listed before the step that changes the size

    def conflicts_while_growing(runner: PlanRunner, step: Step, operation_id: str,
                                answer: dict) -> None:
        if step.kind == "grow":
            assert_growing_2_to_3_refuses_another_scale(runner.cluster.url, answer)

    def rebalanced_at_each_size(step: Step, current: dict) -> None:
        url = cluster.url
        if step.kind == "kill":
            assert current["phase"] == "serving_degraded", current
            assert current["effective_ep_size"] == 3, current
        else:
            phase = {"grow": "serving_expanded", "recover": "serving_recovered",
                     "shrink": "serving_contracted"}[step.kind]
            assert current["phase"] == phase, current
            size = len(step.active)
            assert_every_expert_on_two_ranks(wait_rebalanced(url, size, seen[-1],
                                                             REBALANCED_S), size)
        if step.kind == "grow":
            assert_followed_across_processes(cluster, f"plan-{step.index}-grow-2")
            log = cluster.primary.log_path.read_text(errors="replace")
            assert "ranks [2] joined by scale-up (new slots)" in log
        seen.append(rebalances(url))

    with WebhookReceiver() as hook, skewed_cluster(tiny_model, hook) as cluster:
        url = cluster.url
        with LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8) as load:
            at_launch = wait_rebalanced(url, 2, 0, REBALANCED_S)
        assert all(r.ok for r in load.snapshot()), load.snapshot()
        assert [r["expert_slots"] for r in at_launch["ranks"][:2]] != [HALVES[:16],
                                                                     HALVES[16:]]
        assert_every_expert_on_two_ranks(at_launch, 2)
        seen.append(rebalances(url))
        runner = run_plan(cluster, steps, concurrency=LOAD_CLIENTS,
                          after_step=rebalanced_at_each_size,
                          on_scale_posted=conflicts_while_growing, grow_order="post_first")

        assert greedy_reference(url) == runner.reference
        sizes = read_status(url)["eplb_rebalances"]
        assert sizes[0] == 2 and sizes.count(3) >= 2 and sizes[-1] == 2, sizes
        primary_log = cluster.primary.log_path.read_text(errors="replace")
        for size in (3, 2):  # the scale-up, then letting go of the failed slot
            assert f"rank 1 holds back readiness for size {size} (pass 3 of 3)" in primary_log
        assert primary_log.count("holds back readiness for size 3 (pass 3 of 3)") == 2, \
            "the re-admission must wait for the late rank too"
        assert metric(url, "sglang:elastic_ep_effective_size") == 2.0
        assert metric(url, "sglang:elastic_ep_failed_ranks") == 0.0
        assert metric(
            url, 'sglang:elastic_ep_operations_total{kind="scale_up",result="succeeded"}'
        ) == 1.0
        grow, shrink = "plan-1-grow-2", "plan-4-shrink"
        events = sse_events(url)
        assert operation_events(events)[grow] == SCALE_EVENTS
        assert operation_events(events)[shrink] == [
            "scale_requested", "scale_committed", "safe_to_terminate"]
        assert rank_events(events, 2) == RECOVERY_EVENTS, events
        delivered = hook.wait_for(
            lambda got: operation_events(got).get(grow) == SCALE_EVENTS
            and rank_events(got, 2) == RECOVERY_EVENTS
        )
        assert operation_events(delivered)[grow] == SCALE_EVENTS, delivered
        assert rank_events(delivered, 2) == RECOVERY_EVENTS, delivered


@pytest.mark.long  # about 5 minutes on a cluster of its own: outside the suite
@pytest.mark.timeout(1500)
def test_the_recovered_joiner_killed_again_is_removed(tiny_model: Path) -> None:
    """The replacement fails again; this time the orchestrator removes it instead of replacing
    it: the one scale-down allowed while a rank is failed (vLLM's rule). Both survivors have
    been seen blocking for good after that kill, inside Mooncake (docs/cpu-testbed.md, "A known
    hang"); the stall report then names rank 1, on a node of its own here, and the test does
    what it says: node 1 ended, then relaunched in recover mode."""
    with WebhookReceiver() as hook, skewed_cluster(tiny_model, hook, nodes=2) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        load = LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8).start()
        kills = 2
        try:
            replacement, _, _ = grow_kill_and_recover(cluster, load)
            cluster.kill_server(replacement)
            if wait_failed_or_follow_the_stall(cluster, 2, replacement) is not None:
                kills += 1
            grow = httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 4}, timeout=60)
            assert grow.status_code == 409, grow.text  # not while a rank is failed
            removal = remove_failed_tail(url, new_ep_size=2, timeout_s=FAULT_SEEN_S)
            assert wait_operation(url, removal, SCALE_TIMEOUT_S)["result"] == "succeeded"
            removed = read_status(url)
            assert removed["effective_ep_size"] == 2, removed
            assert removed["ranks"][2]["state"] == "safe_to_terminate", removed
            assert removed["safe_to_terminate_ranks"] == [2], removed
            wait_each_shard_serves(load, [0, 1], JOINER_SERVES_S)  # serving on two shards
        finally:
            results = load.stop()
        lost = [r for r in results if not r.ok]
        for r in lost:  # only what rank 2 held when it died, each time, and said so
            assert r.lost_to_a_fault, r
        assert len(lost) <= kills * most_lost_to_a_kill(LOAD_CLIENTS), \
            f"more lost than {kills} kills may cost: {lost}"
        assert_nothing_lost([r for r in results if r.ok], reference)
        assert greedy_reference(url) == reference
        assert metric(url, "sglang:elastic_ep_effective_size") == 2.0
        ops = operation_events(sse_events(url))
        assert ops[removal] == ["scale_requested", "scale_committed", "safe_to_terminate"]


def remove_failed_tail(url: str, new_ep_size: int, timeout_s: float) -> str:
    """POST the scale-down that removes the failed tail; retried (new operation id) while the
    survivors have not let go of the slot yet (422 for a few passes after the failure)."""
    attempts = itertools.count()
    refusals: list[str] = []

    def accepted() -> str | None:
        operation_id = f"remove-failed-{next(attempts)}"
        resp = httpx.post(url + "/scale_elastic_ep",
                          json={"new_ep_size": new_ep_size, "operation_id": operation_id},
                          timeout=60)
        if resp.status_code == 200:
            return operation_id
        assert resp.status_code == 422, resp.text
        refusals[:] = [resp.text]
        return None

    return wait_until(accepted, timeout_s, "the removal accepted", poll_s=2.0,
                      describe=lambda: f"still refused: {refusals[-1] if refusals else ''}")

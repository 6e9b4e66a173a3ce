"""Runtime scale-down and scale-up on the CPU cluster under steady load (NIXL EP), one cluster
per chain (starting one costs a minute on 2 cores).

The suite's chain, 2 -> 3 -> 2 -> 3 -> 2 -> 3, launches each joiner beside two ranks:
0. A scale-up to 3 whose joiner never starts is cancelled with ``sglang-eep cancel``: the size
   stays 2, slot 2 is listed safe to terminate, a second DELETE answers the same.
1. 2 -> 3 with the joiner launched before the POST, which uses the RFC's ``new_tp_size``; the
   same operation id again is replayed.
2. 3 -> 2 under load: a long request running on shard 2 finishes first (drain); a second scale
   request meanwhile gets 409; rank 2 becomes ``safe_to_terminate`` and its server exits 0.
   The staying ranks keep exactly their slots.
3. 2 -> 3 again into the freed slot, the POST first (the orchestrator CLI's
   ``sglang-eep scale --wait``, exit 0) and the new joiner launched after it, while
   ``sglang-eep events --follow`` prints the operation's events live.
4. 3 -> 1 is refused with 422 (attention DP needs two DP ranks; upstream asserts it every
   pass, and a shrink to one crashed every scheduler), then 3 -> 2 with nothing to move, while
   a long request runs on shard 2 and its joiner is killed with SIGKILL mid-drain. The promise
   (docs/operations.md, "Faults"): the long request ends at once with HTTP 503 and a message
   (not at the drain timeout), the scale-down goes through without the dead rank (its slot is
   released and listed safe to terminate, no ``rank_failed``: it was leaving).
5. 2 -> 3 into that slot once more: the fault left nothing behind.

The long chain (marker ``long``: outside the 30-minute suite, ``bash scripts/test.sh --long``)
goes to four ranks: 2 -> 3 -> 2 -> 3 -> 4 -> 2 -> 3 -> 4 -> 3 -> 2, covering 4 -> 3, 4 -> 2,
3 -> 2 -> 3 and 4 -> 2 -> 4 with new joiners. Two of its joiners start beside three ranks, about
6 minutes each on two cores, which is why it is not in the suite.

The suite's chain launches with ``--init-expert-location`` putting each half of the experts
twice on one rank (``HALVES``: rank 0 holds 0..7 in its 16 slots, rank 1 holds 8..15); a
joiner's slots get copies of every expert. With this layout outputs used to change once a
joiner came in: SGLang loaded only one of a rank's two replicas of an expert
(docs/design.md, "Every replica is loaded"). The long chain keeps upstream's trivial layout.

The long chain's steps:
1. 2 -> 3 with the joiner launched before the POST.
2. 3 -> 2 under load: a long request running on shard 2 finishes first (drain); a second scale
   request meanwhile gets 409; rank 2 becomes ``safe_to_terminate`` and its server exits 0.
   The staying ranks keep exactly their slots.
3. 2 -> 3 again into the freed slot, the POST first (the orchestrator CLI's
   ``sglang-eep scale --wait``, exit 0) and the new joiner launched after it, while
   ``sglang-eep events --follow`` prints the operation's events live.
4. 3 -> 4 with the RFC's ``new_tp_size`` (replayed by operation id), the joiner after the POST.
   The DP router sends requests to shards 2 and 3; every rank reports experts.
5. 4 -> 2 with a long request on shard 2: ranks 2 and 3 become ``safe_to_terminate`` together
   and both servers exit 0.
6. 2 -> 3 -> 4 with new joiners into both freed slots. Mooncake keeps WORLD at the four ranks
   it reached; the slot-2 joiner registers for four (sglang/world_registration.py), else Mooncake
   refuses it.
7. 4 -> 3 with a long request on shard 3; its server exits 0.
8. 3 -> 1 is refused with 422 (attention DP needs two DP ranks; upstream asserts it every
   pass, and a shrink to one crashed every scheduler), then 3 -> 2 with nothing to move.

Nothing moves here: joiners only hold copies, and ranks 0 and 1 hold every expert. The move of
experts that only leaving ranks hold is test_expert_move.py.

One joiner starts at a time: one admitted while the next was starting beside it went quiet
past Mooncake's heartbeat timeout and was evicted (docs/cpu-testbed.md). A joiner starting
beside three ranks takes about 6 minutes on two cores (one load client, 1 s between requests;
the pause did not make it faster).

Throughout: no request fails (in the suite's chain, except what the killed leaving rank was
running: 503 with a message), and the fixed prompts decode to the same tokens; the released
ranks' servers exiting, or dying while they leave, raises no ``rank_failed`` or
``recovery_required`` event.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import (
    DEFAULT_PROMPTS,
    generate,
    greedy_reference,
    stream_on_shard,
)
from sglang_elastic_ep_testbed.cluster.observe import (
    batches_run_by,
    operation_events,
    sse_events,
    wait_each_shard_serves,
    wait_experts_reported,
    wait_operation,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.observe import status as read_status
from sglang_elastic_ep_testbed.cluster.plans import FAULT_SEEN_S, assert_only_killed_requests_lost
from sglang_elastic_ep_testbed.cluster.waits import wait_until

SCALE_TIMEOUT_S = 420
HALVES = [*range(8), *range(8), *range(8, 16), *range(8, 16)]  # 2 ranks x 16 slots
CLI = [sys.executable, "-m", "sglang_elastic_ep.cli.main"]
EXIT_TIMEOUT_S = 60
GROW = ["scale_requested", "rank_joined", "scale_committed"]
SHRINK = ["scale_requested", "scale_committed", "safe_to_terminate"]
# A joiner starting beside three ranks: up to upstream's --elastic-ep-scale-timeout (600 s).
JOIN_BESIDE_THREE_TIMEOUT_S = 600
LOAD_PAUSE_S = 1.0
LONG_TOKENS = 24  # four ranks on two cores decode about a token a second under load
LONG_TOKENS_KILLED = 160  # long enough to be running when its rank is killed
LOST_WITH_SHARD = "failed before it finished"
DRAIN_TIMEOUT_S = 180
SERVES_S = 180  # for every shard to serve the load after a change (two busy cores)


def scale(url: str, size: int, operation_id: str, field: str = "new_ep_size") -> httpx.Response:
    return httpx.post(url + "/scale_elastic_ep",
                      json={field: size, "operation_id": operation_id}, timeout=60)


def succeeded(url: str, operation_id: str, size: int, timeout_s: float = SCALE_TIMEOUT_S) -> dict:
    """The status once ``operation_id`` succeeded at ``size`` ranks (its error otherwise)."""
    operation = wait_operation(url, operation_id, timeout_s)
    assert operation["result"] == "succeeded", operation
    status = read_status(url)
    assert status["effective_ep_size"] == size, status
    return status


def states(url: str) -> list[str]:
    return [r["state"] for r in read_status(url)["ranks"]]


def shrink_with_a_long_request_on(url: str, shard: int, size: int, operation_id: str) -> None:
    """POST the shrink while a long request runs on ``shard`` (a leaving one): the drain waits
    for it, and a second scale request meanwhile gets 409."""
    running = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(stream_on_shard, url, shard, LONG_TOKENS, running, 300)
        # Its first token streamed: it runs on the shard, so the drain must wait for it.
        wait_until(lambda: running.is_set() or long_request.done(), SERVES_S,
                   f"the long request running on shard {shard}", poll_s=0.1)
        assert running.is_set(), long_request.result()
        shrink = scale(url, size, operation_id)
        assert shrink.status_code == 200, shrink.text
        assert shrink.json()["phase"] == "draining", shrink.text
        conflict = scale(url, size + 1, "too-early")
        assert conflict.status_code == 409, conflict.text
        chunks = long_request.result()
    last = chunks[-1]
    assert "error" not in last, last
    assert last["meta_info"]["completion_tokens"] == LONG_TOKENS, last
    assert last["meta_info"]["finish_reason"]["type"] == "length", last


def assert_new_shards_serve(url: str, joiners: dict[int, ServerProcess]) -> None:
    """Round-robin over four shards: every joiner's shard runs batches."""
    with httpx.Client() as client:
        for i in range(8):
            assert generate(client, url, DEFAULT_PROMPTS[i % 8], 2).ok
    for shard, joiner in joiners.items():
        assert batches_run_by(joiner.log_path, shard) > 0, f"the DP router must use shard {shard}"


def left_and_exited(joiner: ServerProcess) -> None:
    assert joiner.wait_exit(EXIT_TIMEOUT_S) == 0, joiner.log_tail()


def grow_with_the_cli(cluster: LocalCluster, size: int, operation_id: str,
                      rank_offset: int) -> tuple[ServerProcess, str]:
    """Grow to ``size`` with the orchestrator CLI's ``scale --wait`` (the POST first, exit 0),
    the joiner launched once the POST is in, while ``sglang-eep events --follow`` prints the
    operation's events live. The follower resumes after the last event so far: it sees exactly
    this operation's events however late it connects. Returns the joiner and what the
    follower printed."""
    url = cluster.url
    last_event_id = max((e["event_id"] for e in sse_events(url)), default=0)
    follower = subprocess.Popen(
        [*CLI, "events", "--url", url, "--follow", "--json", "--max-events", "3",
         "--last-event-id", str(last_event_id)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        grow = subprocess.Popen(
            [*CLI, "scale", "--url", url, "--to", str(size), "--wait", "--operation-id",
             operation_id, "--timeout", str(SCALE_TIMEOUT_S), "--http-timeout", "60"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )

        def posted() -> bool:
            assert grow.poll() is None, grow.communicate()[0]
            return operation_id in operation_events(sse_events(url))

        wait_until(posted, 120, f"the CLI's POST of {operation_id}", poll_s=0.5)
        joiner = cluster.start_joiner("scale", rank_offset=rank_offset)
        grown, _ = grow.communicate(timeout=SCALE_TIMEOUT_S + 60)
        assert grow.returncode == 0, grown
        followed, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0, followed
    finally:
        if follower.poll() is None:
            follower.kill()
    live = [json.loads(line) for line in followed.splitlines() if line.startswith("{")]
    assert [(e["type"], e["operation_id"]) for e in live] == [
        (kind, operation_id) for kind in GROW
    ], followed
    return joiner, followed


def assert_quiet_before(server: ServerProcess, ranks: list[int], change: str,
                        members: list[int] | None = None) -> None:
    """Each of ``ranks`` (run by ``server``) logged that the members met in the rendezvous
    store before ``change`` (the barrier before a Mooncake view change, sglang/world_view.py)."""
    text = server.log_path.read_text(errors="replace")
    met = members if members is not None else ranks
    for rank in ranks:
        line = f"rank {rank}: members {met} quiet before {change}"
        assert line in text, f"{server.log_path} lacks {line!r}:\n{server.log_tail()}"


def cancel_a_scale_up_whose_joiner_never_starts(url: str, size: int, operation_id: str) -> None:
    before = read_status(url)["effective_ep_size"]
    assert scale(url, size, operation_id).status_code == 200
    cli = subprocess.run(
        [sys.executable, "-m", "sglang_elastic_ep.cli.main", "cancel", "--url", url,
         operation_id, "--http-timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == 0 and "cancelled" in cli.stdout, (cli.returncode, cli.stdout)
    status = read_status(url)
    assert status["effective_ep_size"] == before and status["current_operation"] is None
    assert status["recent_operations"][0]["result"] == "cancelled", status
    assert status["safe_to_terminate_ranks"] == list(range(before, size)), status
    again = httpx.delete(f"{url}/scale_elastic_ep/{operation_id}", timeout=60)
    assert again.status_code == 200 and again.json()["cancelled"] is True, again.text
    assert operation_events(sse_events(url))[operation_id] == [
        "scale_requested", "scale_cancelled", "safe_to_terminate"]


def assert_served_throughout(results: list, reference: dict[str, list[int]], url: str,
                             grown: list[str], shrunk: list[str],
                             kills: list[float] | None = None) -> None:
    """No request failed (with ``kills``: except what a killed rank was running), every
    output is the reference, each operation's events came in order, and the released ranks
    exiting (or dying while they leave) raised no fault event."""
    if kills:
        assert_only_killed_requests_lost(results, kills, reference, in_flight=1)
    else:
        failed = [r for r in results if not r.ok]
        assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
        changed = [r for r in results if r.output_ids != reference[r.prompt]]
        assert not changed, f"outputs changed: {changed[:3]}"
    assert greedy_reference(url) == reference
    events = sse_events(url)
    # Released ranks exiting (as an orchestrator deleting them would) is no fault.
    faults = [e for e in events if e["type"] in ("rank_failed", "recovery_required")]
    assert not faults, faults
    ops = operation_events(events)
    for grown_id in grown:
        assert ops[grown_id] == GROW, (grown_id, ops)
    for shrunk_id in shrunk:
        assert ops[shrunk_id] == SHRINK, (shrunk_id, ops)


@pytest.mark.timeout(1800)
def test_shrink_and_regrow_between_2_and_3_under_load(tiny_model: Path) -> None:
    """The suite's chain, 2 -> 3 -> 2 -> 3 -> 2 -> 3, each joiner launched beside two ranks."""
    placement = json.dumps({"physical_to_logical_map": [HALVES, HALVES]})  # both MoE layers
    spec = ClusterSpec(tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl",
                       extra_args=["--elastic-ep-drain-timeout", str(DRAIN_TIMEOUT_S),
                                   "--ep-num-redundant-experts", "16",
                                   "--init-expert-location", placement])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        launch_placement = [list(range(8)), list(range(8, 16))]
        assert wait_experts_reported(url, ranks=2) == launch_placement
        slots = [r["expert_slots"] for r in read_status(url)["ranks"][:2]]
        assert slots == [HALVES[:16], HALVES[16:]], slots

        load = LoadClient(url, concurrency=1, max_new_tokens=8, pause_s=LOAD_PAUSE_S).start()
        kills: list[float] = []
        try:
            # 0. A scale-up whose joiner never starts is cancelled (`sglang-eep cancel`): the
            # size stays, its slot is safe to terminate, and a repeat answers the same.
            cancel_a_scale_up_whose_joiner_never_starts(url, 3, "never-joins")

            # 1. 2 -> 3, the joiner first, with the RFC's field name; the same operation id
            # again is a replay, not a second operation.
            rank2 = cluster.start_joiner("scale", rank_offset=2)
            first = scale(url, 3, "grow-to-3", field="new_tp_size")
            assert first.status_code == 200, first.text
            again = scale(url, 3, "grow-to-3", field="new_tp_size")
            assert again.status_code == 200 and again.json()["replayed"] is True, again.text
            status = succeeded(url, "grow-to-3", 3)
            assert status["phase"] == "serving_expanded", status
            placed = wait_experts_reported(url, ranks=3)
            assert placed[2] and set().union(*placed) == set(range(16)), placed
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: rank2.log_path})
            # The members met in the store before the admission, and the joiner's machine
            # went through its phases to serving.
            assert_quiet_before(cluster.primary, [0, 1], "admit of [2]")
            assert ("scale joiner serves EP ranks [2] at EP size 3; its start-up: pending"
                    in rank2.log_path.read_text(errors="replace")), rank2.log_tail()

            # 2. 3 -> 2 with a long request on the leaving shard.
            shrink_with_a_long_request_on(url, 2, 2, "shrink-to-2")
            status = succeeded(url, "shrink-to-2", 2)
            assert status["phase"] == "serving_contracted", status
            assert states(url)[:3] == ["active", "active", "safe_to_terminate"]
            assert status["safe_to_terminate_ranks"] == [2], status
            left_and_exited(rank2)
            assert_quiet_before(cluster.primary, [0, 1], "release of [2]", members=[0, 1, 2])
            assert_quiet_before(rank2, [2], "release of [2]", members=[0, 1, 2])
            assert wait_experts_reported(url, ranks=2) == launch_placement

            # 3. 2 -> 3 into the freed slot: the CLI's POST first, then the joiner.
            again2, _ = grow_with_the_cli(cluster, 3, "grow-again", rank_offset=2)
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: again2.log_path})
            # It read the largest WORLD so far (3, raised by the first joiner) from the
            # rendezvous store before registering: after a larger shrink it would need it.
            assert ("the largest WORLD so far is 3: registers for 3"
                    in again2.log_path.read_text(errors="replace"))

            # 4. 3 -> 1 is refused (attention DP needs two DP ranks) and changes nothing;
            # 3 -> 2 then needs no move (ranks 0 and 1 hold every expert), and the leaving
            # joiner dies mid-drain: its long request ends with 503 at once, the scale-down
            # goes through without it.
            refused = scale(url, 1, "shrink-to-1")
            assert refused.status_code == 422, refused.text
            assert "attention DP needs at least 2" in refused.json()["message"], refused.text
            assert read_status(url)["effective_ep_size"] == 3
            kills.append(shrink_while_the_leaving_rank_dies(cluster, again2, "shrink-again-to-2"))
            status = succeeded(url, "shrink-again-to-2", 2, FAULT_SEEN_S)
            assert states(url)[:3] == ["active", "active", "safe_to_terminate"]
            assert status["safe_to_terminate_ranks"] == [2], status
            assert wait_experts_reported(url, ranks=2) == launch_placement
            wait_each_shard_serves(load, [0, 1], SERVES_S)  # serving on two ranks

            # 5. 2 -> 3 into that slot again: the fault left nothing behind.
            third = cluster.start_joiner("scale", rank_offset=2)
            assert scale(url, 3, "grow-after-the-fault").status_code == 200
            succeeded(url, "grow-after-the-fault", 3)
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: third.log_path})
        finally:
            results = load.stop()

        assert_served_throughout(results, reference, url,
                                 grown=["grow-to-3", "grow-again", "grow-after-the-fault"],
                                 shrunk=["shrink-to-2", "shrink-again-to-2"], kills=kills)
        assert "moved experts into" not in cluster.primary.log_path.read_text(errors="replace")


def shrink_while_the_leaving_rank_dies(cluster: LocalCluster, leaving: ServerProcess,
                                       operation_id: str) -> float:
    """POST 3 -> 2 while a long request runs on shard 2, then SIGKILL ``leaving`` (rank 2's
    server) once the scale-down drains. The long request ends at once with the lost-with-shard
    503, not at the drain timeout. When the kill ran."""
    url = cluster.url
    running = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        long_request = pool.submit(stream_on_shard, url, 2, LONG_TOKENS_KILLED, running,
                                   DRAIN_TIMEOUT_S + 200)
        wait_until(lambda: running.is_set() or long_request.done(), SERVES_S,
                   "the long request running on shard 2", poll_s=0.1)
        assert running.is_set(), long_request.result()
        assert scale(url, 2, operation_id).status_code == 200
        wait_status(url, lambda s: s if s["phase"] == "draining" else None, 60,
                    f"{operation_id} draining")
        assert not long_request.done(), long_request.result()
        killed_at = time.monotonic()
        cluster.kill_server(leaving)
        last = long_request.result(timeout=FAULT_SEEN_S)[-1]
    assert LOST_WITH_SHARD in json.dumps(last), last
    return killed_at


@pytest.mark.long
@pytest.mark.timeout(2700)
def test_shrink_and_regrow_between_2_and_4_under_load(tiny_model: Path) -> None:
    spec = ClusterSpec(tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl",
                       extra_args=["--elastic-ep-drain-timeout", str(DRAIN_TIMEOUT_S)])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        assert wait_experts_reported(url, ranks=2) == [list(range(8)), list(range(8, 16))]

        # One client: a joiner starting beside three busy ranks on two cores is slow enough.
        load = LoadClient(url, concurrency=1, max_new_tokens=8, pause_s=LOAD_PAUSE_S).start()
        try:
            # 1. 2 -> 3, the joiner first.
            rank2 = cluster.start_joiner("scale", rank_offset=2)
            assert scale(url, 3, "grow-to-3").status_code == 200
            succeeded(url, "grow-to-3", 3)
            placed = wait_experts_reported(url, ranks=3)
            assert placed[2] and set().union(*placed) == set(range(16)), placed

            # 2. 3 -> 2 with a long request on the leaving shard.
            shrink_with_a_long_request_on(url, 2, 2, "shrink-to-2")
            status = succeeded(url, "shrink-to-2", 2)
            assert status["phase"] == "serving_contracted", status
            assert states(url)[:3] == ["active", "active", "safe_to_terminate"]
            assert status["safe_to_terminate_ranks"] == [2], status
            left_and_exited(rank2)
            assert wait_experts_reported(url, ranks=2) == placed[:2]

            # 3. 2 -> 3 into the freed slot: the CLI's POST first, then the joiner.
            again2, _ = grow_with_the_cli(cluster, 3, "grow-again", rank_offset=2)

            # 4. 3 -> 4, the POST first.
            first = scale(url, 4, "grow-to-4", field="new_tp_size")  # the RFC's name
            assert first.status_code == 200, first.text
            again = scale(url, 4, "grow-to-4", field="new_tp_size")
            assert again.status_code == 200 and again.json()["replayed"] is True, again.text
            rank3 = cluster.start_joiner("scale", rank_offset=3)
            status = succeeded(url, "grow-to-4", 4, timeout_s=JOIN_BESIDE_THREE_TIMEOUT_S)
            assert status["phase"] == "serving_expanded", status
            assert_new_shards_serve(url, {2: again2, 3: rank3})
            placed = wait_experts_reported(url, ranks=4)
            assert placed[3] and set().union(*placed) == set(range(16)), placed

            # 5. 4 -> 2: both joiners leave after the long request on shard 2.
            shrink_with_a_long_request_on(url, 2, 2, "shrink-4-to-2")
            status = succeeded(url, "shrink-4-to-2", 2)
            assert states(url) == ["active", "active", "safe_to_terminate", "safe_to_terminate"]
            assert status["safe_to_terminate_ranks"] == [2, 3], status
            left_and_exited(again2)
            left_and_exited(rank3)
            assert wait_experts_reported(url, ranks=2) == placed[:2]

            # 6. 2 -> 3 -> 4 with new joiners (the slot-2 one asks Mooncake for four ranks).
            regrown2 = cluster.start_joiner("scale", rank_offset=2)
            assert scale(url, 3, "regrow-to-3").status_code == 200
            succeeded(url, "regrow-to-3", 3)
            registered = "needs 3 ranks, the largest WORLD so far is 4: registers for 4"
            assert registered in regrown2.log_path.read_text(errors="replace")
            assert scale(url, 4, "regrow-to-4").status_code == 200
            regrown3 = cluster.start_joiner("scale", rank_offset=3)
            succeeded(url, "regrow-to-4", 4, timeout_s=JOIN_BESIDE_THREE_TIMEOUT_S)
            assert_new_shards_serve(url, {2: regrown2, 3: regrown3})
            placed = wait_experts_reported(url, ranks=4)
            assert placed[2] and placed[3] and set().union(*placed) == set(range(16)), placed

            # 7. 4 -> 3 with a long request on the leaving shard.
            shrink_with_a_long_request_on(url, 3, 3, "shrink-to-3")
            status = succeeded(url, "shrink-to-3", 3)
            assert states(url) == ["active", "active", "active", "safe_to_terminate"]
            assert status["safe_to_terminate_ranks"] == [3], status
            left_and_exited(regrown3)
            assert wait_experts_reported(url, ranks=3) == placed[:3]

            # 8. 3 -> 1 is refused (attention DP needs two DP ranks) and changes nothing;
            # 3 -> 2 then needs no move: ranks 0 and 1 hold every expert.
            refused = scale(url, 1, "shrink-to-1")
            assert refused.status_code == 422, refused.text
            assert "attention DP needs at least 2" in refused.json()["message"], refused.text
            assert read_status(url)["effective_ep_size"] == 3
            assert scale(url, 2, "shrink-again-to-2").status_code == 200
            succeeded(url, "shrink-again-to-2", 2)
            assert wait_experts_reported(url, ranks=2) == [list(range(8)), list(range(8, 16))]
            left_and_exited(regrown2)
            wait_each_shard_serves(load, [0, 1], SERVES_S)  # serving on two ranks
        finally:
            results = load.stop()

        assert_served_throughout(
            results, reference, url,
            grown=["grow-to-3", "grow-again", "grow-to-4", "regrow-to-3", "regrow-to-4"],
            shrunk=["shrink-to-2", "shrink-4-to-2", "shrink-to-3", "shrink-again-to-2"],
        )
        primary_log = cluster.primary.log_path.read_text(errors="replace")
        # The staying ranks always held every expert here: nothing moved.
        assert "moved experts into" not in primary_log

"""A scale joiner killed with SIGKILL, or stopped with SIGSTOP, on the pass that admits it
(docs/operations.md, "Faults").

Two launch ranks on two nodes (NIXL EP, ``--max-ep-size 4``, every expert on every rank), a
steady greedy load; a scale joiner for rank 2 is launched and ``new_ep_size: 3`` posted; the
joiner is killed (or stopped) the moment rank 0 logs that it enters the scale-up (the pass every
rank agreed to admit it on). A stopped joiner is a hung one: alive, its connections open, but it
never acknowledges the admission, as a joiner stuck in Mooncake's ``join_group`` did
(docs/cpu-testbed.md). Once the serving ranks committed without it, it is resumed and must exit
by itself (the serving ranks counted it out in the rendezvous store); else the orchestrator
kills it before it relaunches the slot. A third run
stops the joiner only once a serving rank logs that Mooncake's view has admitted it: the joiner
acknowledged its admission, and the expert map's broadcast that follows waits for it. Where
the fault lands decides which of two states follows, and both have an action that works:
- before the commit: the scale-up fails, the size stays 2 and slot 2 is safe to terminate; a
  new joiner and a new POST grow the cluster to 3;
- after it: the scale-up committed and rank 2 failed right after; the survivors let its slot
  go and serve on; a joiner relaunched in recover mode brings the cluster back to 3.
Either way the cluster serves on ranks 0 and 1 meanwhile, no request fails except those the
joiner held (503 with a message), and every completed request decoded the reference tokens.
After a commit the two serving ranks have also been seen waiting on each other for good inside
Mooncake (the third run); the stall report then names rank 1, and the test does what it says:
node 1 ended, served on by rank 0 alone, node 1 and then the joiner relaunched in recover mode.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import greedy_reference
from sglang_elastic_ep_testbed.cluster.observe import (
    log_since,
    post_scale,
    wait_each_shard_serves,
    wait_operation,
    wait_rank_state,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.plans import (
    CHANGE_S,
    FAULT_SEEN_S,
    SERVES_S,
    assert_only_killed_requests_lost,
    wait_failed_or_follow_the_stall,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until

LOAD_CLIENTS = 2
ENTERS = "rank 0 enters the scale-up to 3"  # the agreed pass, before the admission
ADMITTED = "has admitted ranks [2]"  # a serving rank's line once Mooncake's WORLD view has it
# Mooncake's own wait in join_group gave up after 300 s (docs/cpu-testbed.md): a joiner still
# there by then did not exit on the serving ranks' notice.
JOIN_GROUP_GIVES_UP_S = 300
SCALE_TIMEOUT_S = 240  # --elastic-ep-scale-timeout (above the 120 s drain timeout): a scale-up
# left pending fails by then


@pytest.mark.long  # about 3 minutes each: outside the suite
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("fault", "moment"), [
    pytest.param("killed", ENTERS, id="killed"),
    pytest.param("stopped", ENTERS, id="stopped"),
    # Stopped once Mooncake's view has it: its admission is acknowledged, and the expert map's
    # broadcast right after waits for it (docs/design.md, "The expert map's broadcast").
    pytest.param("stopped", ADMITTED, id="stopped-after-admission")])
def test_a_joiner_killed_or_hung_on_the_pass_that_admits_it(tiny_model: Path, fault: str,
                                                            moment: str) -> None:
    # Rank 1 on a node of its own: a stall report that names it can be followed.
    spec = ClusterSpec(tiny_model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl", nodes=2,
                       extra_args=["--ep-num-redundant-experts", "16",
                                   "--elastic-ep-scale-timeout", str(SCALE_TIMEOUT_S)])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        load = LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8).start()
        kills: list[float] = []
        try:
            primary_log = cluster.primary.log_path
            offset = primary_log.stat().st_size
            joiner = cluster.start_joiner("scale", rank_offset=2)
            post_scale(url, 3, "grow")
            wait_until(lambda: moment in log_since(primary_log, offset),
                       CHANGE_S, f"rank 0 logging {moment!r}", poll_s=0.02)
            kills.append(time.monotonic())
            if fault == "killed":
                cluster.kill_server(joiner)
            else:
                cluster.stop_server(joiner)
            done = wait_operation(url, "grow", SCALE_TIMEOUT_S + FAULT_SEEN_S)
            print(f"[commit fault] joiner {fault}: the scale-up ended {done['result']}: {done}",
                  flush=True)
            if fault == "stopped" and moment == ENTERS and done["result"] == "succeeded":
                # Committed without it: once its hang ends, the joiner, still in join_group,
                # reads the serving ranks' notice and exits by itself, for its relaunch.
                cluster.resume_server(joiner)
                code = joiner.wait_exit(JOIN_GROUP_GIVES_UP_S)
                log = joiner.log_path.read_text(errors="replace")
                assert code not in (None, 0), f"the resumed joiner {joiner.state()}"
                assert "gives up its admission: the serving ranks counted ranks [2] out" in log
            elif fault == "stopped":  # what the orchestrator does before it relaunches the slot
                cluster.kill_server(joiner)
            if done["result"] == "succeeded":
                # The serving ranks may count the commit barrier's collective differently
                # inside Mooncake, one waiting in it for good (docs/cpu-testbed.md, "A joiner or
                # replacement killed on its admission pass"): then node 1 is ended as the stall
                # report says, and relaunched.
                ended_at = wait_failed_or_follow_the_stall(cluster, 2, joiner)
                if ended_at is not None:
                    kills.append(ended_at)
                wait_each_shard_serves(load, [0, 1], SERVES_S)
                joiner = cluster.start_joiner("recover", rank_offset=2)
                wait_rank_state(url, 2, "active", CHANGE_S)
            else:
                assert done["result"] == "failed", done
                stayed = wait_status(
                    url, lambda s: s if s["effective_ep_size"] == 2
                    and s["current_operation"] is None else None, FAULT_SEEN_S,
                    "the size back at 2")
                assert [r["state"] for r in stayed["ranks"][:2]] == ["active"] * 2, stayed
                wait_each_shard_serves(load, [0, 1], SERVES_S)
                joiner = cluster.start_joiner("scale", rank_offset=2)
                post_scale(url, 3, "grow-again")
                again = wait_operation(url, "grow-again", CHANGE_S)
                assert again["result"] == "succeeded", again
            wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: joiner.log_path})
        finally:
            results = load.stop()
        assert_only_killed_requests_lost(results, kills, reference, LOAD_CLIENTS)

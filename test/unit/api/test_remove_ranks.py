"""``POST /scale_elastic_ep {"remove_ranks": [...]}``: the RFC's rank-explicit removal. The
tail is removed like ``new_ep_size``; launch-time ranks below it are removed where they are
(holes, refilled by their relaunch): failed ones at once, live ones after a drain run by the
engine; any other set is refused with the reason and the set that works, and changes
nothing."""

from __future__ import annotations

import pytest
from eep_api_helpers import Clock, FakeEngine, make_app, make_plane
from fastapi.testclient import TestClient


@pytest.fixture
def four_ranks() -> tuple[TestClient, FakeEngine, object]:
    """Launched with 2 ranks, grown to 4: ranks 2 and 3 joined by scale-up."""
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=4, launch_size=2)
    return TestClient(make_app(plane)), engine, plane


def test_removing_the_tail_is_a_scale_down_and_a_retry_replays(four_ranks) -> None:
    client, engine, plane = four_ranks
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": [3, 2], "operation_id": "rm"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["old_ep_size"], body["new_ep_size"], body["accepted"]) == (4, 2, True)
    assert [(op.old_ep_size, op.new_ep_size) for op in engine.ops] == [(4, 2)]
    plane.finish_operation("rm")
    assert client.get("/elastic_ep/status").json()["effective_ep_size"] == 2
    again = client.post("/scale_elastic_ep", json={"remove_ranks": [2, 3], "operation_id": "rm"})
    assert again.status_code == 200 and again.json()["replayed"] is True, again.text
    assert len(engine.ops) == 1


@pytest.mark.parametrize(("ranks", "status", "reason", "hint"), [
    ([1, 3], 422, "not_the_tail", '{"remove_ranks": [2, 3]}'),
    ([0], 422, "rank_zero", '{"remove_ranks": [3]}'),
    ([0, 1, 2, 3], 422, "rank_zero", "shut the server down"),
    ([4], 400, "unknown_ranks", "ranks 0..3"),
])
def test_other_sets_are_refused_with_the_set_that_works(four_ranks, ranks: list[int],
                                                        status: int, reason: str,
                                                        hint: str) -> None:
    client, engine, _ = four_ranks
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": ranks})
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["reason"] == reason and hint in body["message"], body
    assert engine.ops == []
    assert client.get("/elastic_ep/status").json()["effective_ep_size"] == 4


@pytest.mark.parametrize(("body", "fragment"), [
    ({"remove_ranks": [3, 3]}, "names a rank twice"),
    ({"remove_ranks": []}, "non-empty list"),
    ({"remove_ranks": [-1]}, "negative rank"),
    ({"remove_ranks": ["3"]}, "JSON integers"),
    ({"remove_ranks": [3], "new_ep_size": 3}, "not both"),
])
def test_malformed_sets_get_400(four_ranks, body: dict, fragment: str) -> None:
    client, engine, _ = four_ranks
    answer = client.post("/scale_elastic_ep", json=body)
    assert answer.status_code == 400, answer.text
    assert fragment in answer.text, answer.text
    assert engine.ops == []


def _types_for(plane: object, ranks: list[int]) -> list[str]:
    return [e.type for e in plane.events.since(0).events if getattr(e, "ranks", None) == ranks]


def _states(client: TestClient) -> list[str]:
    return [r["state"] for r in client.get("/elastic_ep/status").json()["ranks"][:4]]


def test_a_failed_launch_rank_below_the_tail_is_removed_then_its_relaunch_refills_it() -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=3, launch_size=2, max_ep_size=4)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([1], reason="killed")

    answer = client.post("/scale_elastic_ep", json={"remove_ranks": [1], "operation_id": "rm"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["old_ep_size"], body["new_ep_size"], body["phase"]) == \
        (3, 2, "serving_contracted"), body
    assert "--elastic-ep-join-mode recover" in body["message"]
    assert engine.ops == []  # the schedulers already serve without it: nothing to run
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 2 and status["current_operation"] is None
    assert _states(client) == ["active", "safe_to_terminate", "active", "inactive"]
    assert _types_for(plane, [1]) == ["rank_failed", "recovery_required", "scale_requested",
                                      "scale_committed", "safe_to_terminate"]
    assert [r["rank"] for r in client.get("/elastic_ep/health").json()["ranks"]] == [0, 2]
    again = client.post("/scale_elastic_ep", json={"remove_ranks": [1], "operation_id": "rm"})
    assert again.status_code == 200 and again.json()["replayed"] is True, again.text

    # The hole stays out of every size change until it is refilled; the same size is a no-op.
    for request in ({"new_ep_size": 4}, {"new_ep_size": 1}, {"remove_ranks": [2]}):
        refused = client.post("/scale_elastic_ep", json=request)
        assert refused.status_code == 409, refused.text
        assert refused.json()["reason"] == "removed_ranks_present", refused.text
        assert "new_ep_size 3, then relaunch ranks [1] with --elastic-ep-join-mode recover" \
            in refused.json()["message"]
    assert client.post("/scale_elastic_ep", json={"new_ep_size": 2}).status_code == 200
    plane.observe_rank_liveness([1], reason="still down")  # not failed again: it was removed
    assert _types_for(plane, [1])[-1] == "safe_to_terminate"
    assert engine.ops == []

    plane.observe_rank_liveness([], reason="")  # its relaunch rejoined in place
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["phase"]) == (3, "serving_recovered"), status
    assert _states(client) == ["active", "active", "active", "inactive"]
    assert _types_for(plane, [1])[-1] == "rank_recovered"
    assert client.post("/scale_elastic_ep", json={"new_ep_size": 2}).status_code == 200
    assert [(op.old_ep_size, op.new_ep_size) for op in engine.ops] == [(3, 2)]


def _reasons_for(plane: object, ranks: list[int]) -> list[str]:
    return [e.reason for e in plane.events.since(0).events
            if e.type == "rank_failed" and e.ranks == ranks]


@pytest.mark.parametrize("then", ["shrink", "relaunch"])
def test_a_joiner_hole_the_failed_tail_above_takes_in_is_awaited_again(then: str) -> None:
    """Ranks [0, 1] grown to 4; failed joiner 2 removed where it is, then rank 3 fails too:
    the survivors let 2..3 go as one failed tail, so the hole is a failed rank again, and
    both ways out of a failed tail work."""
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=4, launch_size=2)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([2], reason="killed")
    assert client.post("/scale_elastic_ep", json={"remove_ranks": [2]}).status_code == 200
    assert _states(client) == ["active", "active", "safe_to_terminate", "active"]

    plane.observe_rank_liveness([2, 3], reason="killed")
    assert _states(client) == ["active", "active", "failed", "failed"]
    status = client.get("/elastic_ep/status").json()
    assert status["effective_ep_size"] == 4, status
    reason = _reasons_for(plane, [2])[-1]
    assert "relaunch them all with --elastic-ep-join-mode recover from " \
        "--elastic-ep-join-rank-offset 2, or scale down to 2" in reason, reason
    assert [r["rank"] for r in client.get("/elastic_ep/health").json()["ranks"]] == [0, 1, 2, 3]
    if then == "shrink":
        answer = client.post("/scale_elastic_ep", json={"new_ep_size": 2, "operation_id": "dn"})
        assert answer.status_code == 200, answer.text
        assert [(op.old_ep_size, op.new_ep_size) for op in engine.ops] == [(4, 2)]
        plane.finish_operation("dn")
        assert client.get("/elastic_ep/status").json()["effective_ep_size"] == 2
    else:
        plane.observe_rank_liveness([], reason="")  # the tail's replacements are back
        assert _states(client) == ["active"] * 4
        assert engine.ops == []


def test_a_launch_time_hole_is_never_part_of_a_failed_tail() -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=3, launch_size=2)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([1], reason="killed")
    assert client.post("/scale_elastic_ep", json={"remove_ranks": [1]}).status_code == 200
    plane.observe_rank_liveness([1, 2], reason="killed")
    assert _states(client) == ["active", "safe_to_terminate", "failed", "inactive"]
    assert _reasons_for(plane, [1]) == ["killed"]


@pytest.mark.parametrize(("launch", "failed", "ranks", "status", "reason", "fragment"), [
    (2, [2, 3], [2], 422, "not_the_tail", "ranks [2] joined by scale-up and have no live"),
    (4, [1], [1, 2], 409, "failed_ranks_present",
     'relaunch the failed ones with --elastic-ep-join-mode recover or remove them '
     '({"remove_ranks": [1]})'),
    (4, [3], [1], 409, "failed_ranks_present", "ranks [3] have failed, and live ranks [1]"),
])
def test_a_joiner_leaves_a_hole_only_below_a_live_one_and_live_ones_only_while_all_serve(
        launch: int, failed: list[int], ranks: list[int], status: int, reason: str,
        fragment: str) -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=4, launch_size=launch)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness(failed, reason="killed")
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": ranks})
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["reason"] == reason and fragment in body["message"], body
    assert _states(client).count("failed") == len(failed) and engine.ops == []


def test_a_live_launch_rank_below_the_tail_drains_then_leaves_a_hole_its_relaunch_refills(
) -> None:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=3, max_ep_size=4)
    client = TestClient(make_app(plane))
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": [1], "operation_id": "rm"})
    assert answer.status_code == 200, answer.text
    assert "their shards drain" in answer.json()["message"]
    # It runs on the schedulers (drain, then the agreed release): not finished at once.
    assert [(op.old_ep_size, op.new_ep_size, op.ranks) for op in engine.ops] == [(3, 2, (1,))]
    status = client.get("/elastic_ep/status").json()
    assert status["current_operation"]["operation_id"] == "rm", status
    plane.observe_rank_liveness([1], reason="released")  # leaving: not a failure
    assert "rank_failed" not in _types_for(plane, [1])
    refused = client.post("/scale_elastic_ep", json={"remove_ranks": [2]})
    assert refused.status_code == 409 and refused.json()["reason"] == "operation_in_progress"

    plane.finish_operation("rm")
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["current_operation"]) == (2, None), status
    assert _states(client) == ["active", "safe_to_terminate", "active", "inactive"]
    assert _types_for(plane, [1]) == ["scale_requested", "scale_committed", "safe_to_terminate"]
    # Another live removal waits for the hole to close, and names the refill.
    again = client.post("/scale_elastic_ep", json={"remove_ranks": [2]})
    assert again.status_code == 409, again.text
    assert again.json()["reason"] == "removed_ranks_present"
    assert "new_ep_size 3, then relaunch ranks [1]" in again.json()["message"]

    assert client.post("/scale_elastic_ep", json={"new_ep_size": 3,
                                                  "operation_id": "fill"}).status_code == 200
    plane.observe_rank_liveness([], reason="")  # the relaunch rejoined in place
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["phase"]) == (3, "serving_expanded"), status
    assert _states(client) == ["active", "active", "active", "inactive"]
    assert len(engine.ops) == 1  # the refill sends nothing: the relaunch rejoins by itself


def test_a_live_removal_the_schedulers_refuse_changes_nothing() -> None:
    from sglang_elastic_ep.api.control_plane import EngineRefusal

    engine = FakeEngine()
    engine.fail = EngineRefusal("logical experts [3] (layer 0) have no replica outside ranks [1]")
    plane = make_plane(engine=engine, initial=3, max_ep_size=4)
    client = TestClient(make_app(plane))
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": [1]})
    assert answer.status_code == 422, answer.text
    assert "have no replica outside ranks [1]" in answer.json()["message"]
    assert "nothing changed" in answer.json()["message"]
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["current_operation"]) == (3, None), status
    assert _states(client) == ["active", "active", "active", "inactive"]


def test_a_hole_takes_whole_attention_replicas() -> None:
    plane = make_plane(initial=6, attn_replica_size=2)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([2, 3], reason="killed")
    half = client.post("/scale_elastic_ep", json={"remove_ranks": [2]})
    assert half.status_code == 400, half.text
    assert half.json()["reason"] == "incomplete_attention_replica"
    assert '{"remove_ranks": [2, 3]}' in half.json()["message"]
    whole = client.post("/scale_elastic_ep", json={"remove_ranks": [2, 3]})
    assert whole.status_code == 200, whole.text
    assert client.get("/elastic_ep/status").json()["effective_ep_size"] == 4


def _removed_rank_1(**plane_args: object) -> tuple[TestClient, FakeEngine, object]:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=3, launch_size=2, max_ep_size=4, **plane_args)
    client = TestClient(make_app(plane))
    plane.observe_rank_liveness([1], reason="killed")
    assert client.post("/scale_elastic_ep", json={"remove_ranks": [1]}).status_code == 200
    return client, engine, plane


def test_a_scale_up_refills_the_hole_first_and_commits_when_its_relaunch_serves() -> None:
    client, engine, plane = _removed_rank_1()
    answer = client.post("/scale_elastic_ep", json={"new_ep_size": 3, "operation_id": "fill"})
    assert answer.status_code == 200, answer.text
    assert "refilling the holes of removed ranks [1]" in answer.json()["message"]
    assert engine.ops == []  # the relaunch rejoins by itself: nothing to send
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["pending_ep_size"]) == (2, 3), status
    assert _states(client) == ["active", "pending", "active", "inactive"]
    assert status["current_operation"]["operation_id"] == "fill"

    plane.observe_rank_liveness([], reason="")  # the relaunch rejoined in place
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["pending_ep_size"], status["phase"]) == \
        (3, None, "serving_expanded"), status
    assert status["recent_operations"][0]["result"] == "succeeded"
    assert _types_for(plane, [1])[-3:] == ["scale_requested", "rank_recovered",
                                           "scale_committed"]
    assert _states(client) == ["active", "active", "active", "inactive"]


def test_a_refill_is_cancelled_at_once_and_the_hole_stays() -> None:
    client, engine, plane = _removed_rank_1()
    assert client.post("/scale_elastic_ep",
                       json={"new_ep_size": 3, "operation_id": "fill"}).status_code == 200
    cancelled = client.delete("/scale_elastic_ep/fill")
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True, cancelled.text
    again = client.delete("/scale_elastic_ep/fill")
    assert again.status_code == 200 and again.json()["cancelled"] is True, again.text
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["pending_ep_size"]) == (2, None), status
    assert _states(client) == ["active", "safe_to_terminate", "active", "inactive"]
    assert _types_for(plane, [1])[-2:] == ["scale_cancelled", "safe_to_terminate"]
    plane.observe_rank_liveness([], reason="")  # a relaunch still rejoins in place
    assert client.get("/elastic_ep/status").json()["effective_ep_size"] == 3
    assert engine.ops == []


def test_a_refill_whose_relaunch_never_serves_fails_at_its_timeout_and_the_hole_stays() -> None:
    clock = Clock()
    client, engine, plane = _removed_rank_1(clock=clock, refill_timeout_s=600.0)
    assert client.post("/scale_elastic_ep",
                       json={"new_ep_size": 3, "operation_id": "fill"}).status_code == 200
    clock.t += 599
    assert plane.expire_overdue_refill() is None  # not yet
    assert client.get("/elastic_ep/status").json()["pending_ep_size"] == 3
    clock.t += 2
    failed = plane.expire_overdue_refill()
    assert failed is not None and failed.operation_id == "fill"
    assert failed.result.value == "failed"
    assert "no relaunch of removed ranks [1] served within 600 s" in failed.error
    assert "--ep-join-mode recover" in failed.error
    assert plane.expire_overdue_refill() is None  # once
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["pending_ep_size"]) == (2, None), status
    assert _types_for(plane, [1])[-2:] == ["scale_failed", "safe_to_terminate"]
    assert _states(client) == ["active", "safe_to_terminate", "active", "inactive"]
    # The operation it names works from here: a relaunch still rejoins in place, and a new
    # refill is admitted.
    assert client.post("/scale_elastic_ep",
                       json={"new_ep_size": 3, "operation_id": "fill-2"}).status_code == 200
    plane.observe_rank_liveness([], reason="")
    status = client.get("/elastic_ep/status").json()
    assert (status["effective_ep_size"], status["phase"]) == (3, "serving_expanded"), status
    clock.t += 10_000
    assert plane.expire_overdue_refill() is None  # the committed refill has no deadline left
    assert engine.ops == []


def _regrown_after_a_shrink() -> tuple[TestClient, FakeEngine, object]:
    """Launched with 4, shrunk to 2, grown back to 4 with joiners in slots 2 and 3."""
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=4, launch_size=4, max_ep_size=4)
    client = TestClient(make_app(plane))
    for size, op_id in ((2, "down"), (4, "up")):
        assert client.post("/scale_elastic_ep", json={"new_ep_size": size,
                                                      "operation_id": op_id}).status_code == 200
        plane.finish_operation(op_id)
    return client, engine, plane


def test_a_launch_slot_refilled_by_a_joiner_counts_as_scale_joined() -> None:
    """Launched with 4, shrunk to 2 and grown back to 4 with joiners: slots 2 and 3 left the
    launch-time groups at the shrink (as on the schedulers), so a failed rank 2 below live
    rank 3 follows the joiners' rules: a scale-down past it, or its removal where it is."""
    client, engine, plane = _regrown_after_a_shrink()
    assert plane.topology.launch_size == 2
    plane.observe_rank_liveness([1, 2], reason="killed")
    holes = client.post("/scale_elastic_ep", json={"remove_ranks": [1, 2]})
    assert holes.status_code == 200, holes.text
    assert "ranks [2] as joiners at their own --elastic-ep-join-rank-offset" \
        in holes.json()["message"]
    assert _states(client) == ["active", "safe_to_terminate", "safe_to_terminate", "active"]
    # The removal of failed ranks ran nothing on the schedulers.
    assert [(op.old_ep_size, op.new_ep_size) for op in engine.ops] == [(4, 2), (2, 4)]


def test_a_failed_refilled_launch_slot_below_a_live_one_may_be_shrunk_past() -> None:
    client, engine, plane = _regrown_after_a_shrink()
    plane.observe_rank_liveness([2], reason="killed")
    past = client.post("/scale_elastic_ep", json={"new_ep_size": 2})
    assert past.status_code == 200, past.text
    assert [(op.old_ep_size, op.new_ep_size) for op in engine.ops][-1] == (4, 2)


@pytest.mark.parametrize(("ranks", "status", "reason", "fragment"), [
    ([2], 400, "incomplete_node", '{"remove_ranks": [2, 3]}'),
    ([1], 422, "rank_zero", "run in node 0's server with rank 0"),
])
def test_a_live_rank_leaves_with_its_whole_node(ranks: list[int], status: int, reason: str,
                                                fragment: str) -> None:
    """Two ranks per node: a node's server exits when its ranks leave, and its relaunch
    brings both back, so a live removal names whole nodes (never node 0's)."""
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=6, ranks_per_node=2)
    client = TestClient(make_app(plane))
    answer = client.post("/scale_elastic_ep", json={"remove_ranks": ranks})
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["reason"] == reason and fragment in body["message"], body
    assert engine.ops == []
    whole = client.post("/scale_elastic_ep", json={"remove_ranks": [2, 3]})
    assert whole.status_code == 200, whole.text
    assert [op.ranks for op in engine.ops] == [(2, 3)]

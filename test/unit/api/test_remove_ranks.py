"""``POST /scale_elastic_ep {"remove_ranks": [...]}``: the RFC's rank-explicit removal. The
tail is removed like ``new_ep_size``; any other set is refused with the reason and the set
that works, and changes nothing."""

from __future__ import annotations

import pytest
from eep_api_helpers import FakeEngine, make_app, make_plane
from fastapi.testclient import TestClient


@pytest.fixture
def four_ranks() -> tuple[TestClient, FakeEngine, object]:
    engine = FakeEngine()
    plane = make_plane(engine=engine, initial=4)
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
    ([1], 422, "not_the_tail", '{"remove_ranks": [3]}'),
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

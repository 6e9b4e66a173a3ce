"""Routing in the tokenizer: round-robin over live shards, and the requests a dead shard held."""

from __future__ import annotations

from sglang_elastic_ep.core.routing import PRUNE_AT, LiveShardRouter


def test_round_robin_skips_down_shards_and_returns_when_none_is_live() -> None:
    router = LiveShardRouter()
    assert [router.pick(3) for _ in range(4)] == [0, 1, 2, 0]
    router.mark_down({1}, in_flight=set())
    assert {router.pick(3) for _ in range(6)} == {0, 2}
    router.mark_down({0, 1, 2}, in_flight=set())
    assert router.pick(3) is None
    router.mark_down(set(), in_flight=set())
    assert router.pick(1) == 0


def test_a_dead_shard_hands_back_only_its_unfinished_requests_once() -> None:
    router = LiveShardRouter()
    for rid, shard in (("a", 0), ("b", 1), ("c", 1), ("d", 1)):
        router.track(shard, rid, in_flight=set())
    running = {"a", "b", "d"}  # c finished
    assert router.mark_down({1}, running) == {1: ["b", "d"]}
    assert router.mark_down({1}, running) == {}  # already known: nothing again
    assert router.mark_down({0, 1}, running) == {0: ["a"]}


def test_finished_requests_are_pruned_from_the_tracking() -> None:
    router = LiveShardRouter()
    for i in range(PRUNE_AT + 1):
        router.track(0, f"r{i}", in_flight={f"r{PRUNE_AT}"})
    assert router.mark_down({0}, in_flight={f"r{PRUNE_AT}"}) == {0: [f"r{PRUNE_AT}"]}


def test_is_recovery_join_contract() -> None:
    from sglang_elastic_ep.core.membership import is_recovery_join

    assert is_recovery_join([1], ever_active=range(2))  # a replacement: recovery
    assert not is_recovery_join([2, 3], ever_active=range(2))  # new slots: scale-up
    assert not is_recovery_join([], ever_active=range(2))
    import pytest

    with pytest.raises(ValueError, match="separate operations"):
        is_recovery_join([1, 2], ever_active=range(2))


def test_leaving_shards_get_no_new_requests_and_their_running_ones_are_known() -> None:
    router = LiveShardRouter()
    for rid, shard in (("a", 0), ("b", 2), ("c", 2)):
        router.track(shard, rid, in_flight=set())
    router.start_drain({2})
    assert {router.pick(3) for _ in range(6)} == {0, 1}
    assert router.still_running([2], in_flight={"a", "c"}) == {2: ["c"]}
    assert router.still_running([2], in_flight={"a"}) == {2: []}
    assert router.mark_down({2}, in_flight=set()) == {} and router.down == frozenset()
    router.forget([2])
    assert router.leaving == frozenset() and router.still_running([2], {"c"}) == {2: []}
    assert [router.pick(2) for _ in range(2)] in ([0, 1], [1, 0])


def test_a_leaving_shard_that_dies_mid_drain_takes_its_running_requests_with_it() -> None:
    router = LiveShardRouter()
    for rid, shard in (("a", 0), ("b", 2), ("c", 2)):
        router.track(shard, rid, in_flight=set())
    router.start_drain({2})
    assert router.mark_down({2}, in_flight={"a", "c"}) == {2: ["c"]}  # "b" had finished
    assert router.down == frozenset()  # leaving, not down: no fault handling, no recovery
    assert router.leaving_down == frozenset({2})  # its scheduler will not answer
    assert router.mark_down({2}, in_flight={"a", "c"}) == {}  # each lost request once
    assert router.still_running([2], in_flight={"a", "c"}) == {2: []}  # the drain is over
    router.forget([2])
    assert router.leaving_down == frozenset()


def test_a_leaving_shard_seen_dead_stays_dead_when_a_late_report_shows_it_up() -> None:
    router = LiveShardRouter()
    router.track(2, "c", in_flight=set())
    router.start_drain({2})
    assert router.mark_down({2}, in_flight={"c"}) == {2: ["c"]}
    # A peer one pass behind still reports shard 2 up: the drain confirmation must still
    # leave its scheduler out.
    assert router.mark_down(set(), in_flight=set()) == {}
    assert router.leaving_down == frozenset({2})


def test_a_drain_that_ends_without_a_release_puts_a_dead_leaving_shard_down() -> None:
    router = LiveShardRouter()
    router.start_drain({1, 2})
    router.mark_down({2}, in_flight=set())
    router.stop_draining()
    assert (router.leaving, router.leaving_down, router.down) == (
        frozenset(), frozenset(), frozenset({2}))
    assert {router.pick(3) for _ in range(4)} == {0, 1}
    router.start_drain({1})
    assert router.leaving_down == frozenset()  # a new drain starts from what it sees


def test_a_shard_removed_where_it_is_stays_out_of_routing_until_reported_up() -> None:
    router = LiveShardRouter()
    router.start_drain({1})
    assert [router.pick(3) for _ in range(4)] == [0, 2, 0, 2]
    router.retire({1})
    assert router.leaving == frozenset() and router.down == frozenset({1})
    assert {router.pick(3) for _ in range(4)} == {0, 2}
    router.mark_down(set(), in_flight=set())  # its relaunch serves: every shard reports up
    assert {router.pick(3) for _ in range(6)} == {0, 1, 2}


def test_a_drain_past_a_failed_shard_counts_it_dead_from_the_start() -> None:
    """A scale-down past a failed shard: no liveness report will change for it, so it is
    leaving and dead from the start; called off, it is down again, not live."""
    router = LiveShardRouter()
    router.mark_down({2}, in_flight=set())
    router.start_drain({2, 3}, down={2})
    assert router.leaving == {2, 3} and router.leaving_down == {2}
    assert router.pick(4) in (0, 1)
    router.stop_draining()
    assert router.down == {2} and router.leaving == frozenset()
    assert {router.pick(4) for _ in range(6)} == {0, 1, 3}

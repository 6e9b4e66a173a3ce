import pytest

from sglang_elastic_ep.core.api_models import RejectionReason
from sglang_elastic_ep.core.validation import (
    ScaleDirection,
    ScaleTopology,
    resolve_removal,
    validate_scale,
)

TOPO = ScaleTopology(max_ep_size=8)


def test_scale_up_lists_joining_ranks_and_says_it_started() -> None:
    v = validate_scale(3, current_size=2, topology=TOPO)
    assert v.ok and v.status == 200 and v.direction is ScaleDirection.UP
    assert v.joining_ranks == (2,)
    assert v.message == "Scaling initiated from 2 to 3, polling for new ranks"


def test_scale_down_removes_tail_ranks() -> None:
    v = validate_scale(2, current_size=4, topology=TOPO)
    assert v.ok and v.direction is ScaleDirection.DOWN and v.leaving_ranks == (2, 3)
    assert "draining ranks [2, 3]" in v.message


def test_same_size_is_a_noop_answered_ok() -> None:
    v = validate_scale(4, current_size=4, topology=TOPO)
    assert v.ok and v.status == 200 and v.direction is ScaleDirection.NOOP
    assert "nothing to do" in v.message


@pytest.mark.parametrize(
    "target, reason, hint",
    [
        (0, RejectionReason.INVALID_TARGET, "at least 1"),
        (9, RejectionReason.EXCEEDS_MAX_EP_SIZE, "restart with a larger --max-ep-size"),
    ],
)
def test_out_of_range_targets(target: int, reason: RejectionReason, hint: str) -> None:
    v = validate_scale(target, current_size=4, topology=TOPO)
    assert not v.ok and v.status == 400 and v.reason is reason and hint in v.message


def test_incomplete_attention_replica_suggests_neighbours() -> None:
    topo = ScaleTopology(max_ep_size=8, attn_replica_size=2)
    v = validate_scale(5, current_size=4, topology=topo)
    assert v.status == 400 and v.reason is RejectionReason.INCOMPLETE_ATTENTION_REPLICA
    assert "multiple of 2 (e.g. 6)" in v.message  # 4 is the current size: nothing to do
    assert validate_scale(6, current_size=4, topology=topo).ok


def test_expert_capacity_sets_the_minimum_size() -> None:
    topo = ScaleTopology(max_ep_size=8, num_logical_experts=10, slots_per_rank=4)
    assert topo.min_ep_size == 3
    v = validate_scale(2, current_size=4, topology=topo)
    assert v.status == 400 and v.reason is RejectionReason.TOO_FEW_EXPERT_SLOTS
    assert "at least 3 ranks are needed); the smallest size accepted now is 3" in v.message
    assert validate_scale(3, current_size=4, topology=topo).ok


def test_min_size_rounds_up_to_whole_replicas() -> None:
    topo = ScaleTopology(
        max_ep_size=8, attn_replica_size=2, num_logical_experts=10, slots_per_rank=4
    )
    assert topo.min_ep_size == 4


def test_topology_rejects_max_not_multiple_of_replica() -> None:
    with pytest.raises(ValueError):
        ScaleTopology(max_ep_size=5, attn_replica_size=2)


def test_scale_up_with_failed_rank_is_a_conflict_naming_the_rank() -> None:
    v = validate_scale(5, current_size=4, topology=TOPO, failed_ranks=[1])
    assert v.status == 409 and v.reason is RejectionReason.FAILED_RANKS_PRESENT
    assert "recover or remove rank(s) [1] first" in v.message
    assert "--elastic-ep-join-mode recover" in v.message


def test_scale_up_with_failed_tail_rank_also_offers_removal() -> None:
    v = validate_scale(5, current_size=4, topology=TOPO, failed_ranks=[3])
    assert v.status == 409 and "scaling down to 3" in v.message


def test_only_scale_down_removing_exactly_the_failed_tail_is_allowed() -> None:
    ok = validate_scale(2, current_size=4, topology=TOPO, failed_ranks=[2, 3])
    assert ok.ok and ok.leaving_ranks == (2, 3)
    too_far = validate_scale(1, current_size=4, topology=TOPO, failed_ranks=[2, 3])
    assert too_far.status == 409 and too_far.reason is RejectionReason.MUST_REMOVE_FAILED_RANKS
    assert "scale down to exactly 2" in too_far.message
    too_short = validate_scale(3, current_size=4, topology=TOPO, failed_ranks=[2, 3])
    assert too_short.status == 409 and "exactly 2" in too_short.message


def test_failed_rank_not_at_tail_can_only_be_recovered() -> None:
    v = validate_scale(3, current_size=4, topology=TOPO, failed_ranks=[0])
    assert v.status == 409 and v.reason is RejectionReason.MUST_REMOVE_FAILED_RANKS
    assert "relaunch them with --elastic-ep-join-mode recover" in v.message


def test_failed_ranks_outside_current_size_are_ignored() -> None:
    assert validate_scale(5, current_size=4, topology=TOPO, failed_ranks=[6]).ok


def test_noop_is_allowed_even_with_failed_ranks() -> None:
    v = validate_scale(4, current_size=4, topology=TOPO, failed_ranks=[3])
    assert v.ok and v.direction is ScaleDirection.NOOP


def test_released_launch_slots_are_refilled_by_scale_joiners() -> None:
    topology = ScaleTopology(max_ep_size=3, launch_size=3)
    shrink = validate_scale(2, current_size=3, topology=topology)
    assert shrink.ok and shrink.leaving_ranks == (2,)
    assert "ranks [2] are launch-time slots" in shrink.message
    assert "scale joiners at their own offsets" in shrink.message
    grow = validate_scale(3, current_size=2, topology=topology)
    assert grow.ok and grow.direction is ScaleDirection.UP and grow.joining_ranks == (2,)


def test_slots_past_the_launch_size_come_and_go_freely() -> None:
    topology = ScaleTopology(max_ep_size=4, launch_size=2)
    shrink = validate_scale(2, current_size=4, topology=topology)
    assert shrink.ok and "launch-time" not in shrink.message
    grow = validate_scale(4, current_size=2, topology=topology)
    assert grow.ok and grow.joining_ranks == (2, 3)


GROWN_TO_4 = ScaleTopology(max_ep_size=4, launch_size=2)  # ranks 2 and 3 joined by scale-up


def test_a_scale_down_past_a_failed_joiner_below_a_live_one_is_accepted() -> None:
    """Rank 2 joined by scale-up and failed while rank 3 serves: a relaunch brings it back in
    place, and the scale-down that removes it with rank 3 (which drains) is accepted too."""
    v = validate_scale(2, current_size=4, topology=GROWN_TO_4, failed_ranks=[2])
    assert v.ok and v.direction is ScaleDirection.DOWN and v.leaving_ranks == (2, 3)
    assert "removes failed ranks [2]" in v.message and "live ranks [3], which drain" in v.message


def test_a_smaller_scale_down_with_a_failed_joiner_below_a_live_one_names_both_ways() -> None:
    v = validate_scale(3, current_size=4, topology=GROWN_TO_4, failed_ranks=[2])
    assert not v.ok and v.status == 409 and v.reason is RejectionReason.MUST_REMOVE_FAILED_RANKS
    assert "scale down to 2 instead" in v.message
    assert "--elastic-ep-join-mode recover (they rejoin in place)" in v.message


def test_a_scale_up_with_a_failed_joiner_below_a_live_one_names_recovery_first() -> None:
    big = ScaleTopology(max_ep_size=6, launch_size=2)
    v = validate_scale(6, current_size=4, topology=big, failed_ranks=[2])
    assert not v.ok and v.status == 409 and v.reason is RejectionReason.FAILED_RANKS_PRESENT
    assert "recover them first" in v.message and "scale down to 2 first" in v.message


def test_a_failed_launch_time_rank_below_a_live_joiner_is_no_joiner_for_the_rules() -> None:
    """Launched at 3 and grown to 4: rank 2 is in the launch-time groups, so no scale-down
    past it is offered; it rejoins in place by a relaunch of its node."""
    topo = ScaleTopology(max_ep_size=4, launch_size=3)
    v = validate_scale(2, current_size=4, topology=topo, failed_ranks=[2])
    assert not v.ok and "recover" in v.message
    shrunk = ScaleTopology(max_ep_size=4, launch_size=2)  # after a shrink to 2, regrown
    assert validate_scale(2, current_size=4, topology=shrunk, failed_ranks=[2]).ok


def test_a_failed_joiner_below_a_live_one_with_a_failed_launch_rank_names_the_relaunch() -> None:
    """No scale-down past rank 2 works while launch-time rank 1 is down too (it would be
    called off for a failed staying rank); both rejoin in place by a relaunch."""
    for target in (2, 3):
        v = validate_scale(target, current_size=4, topology=GROWN_TO_4, failed_ranks=[1, 2])
        assert not v.ok and v.status == 409, v.message
        assert "relaunch them with --elastic-ep-join-mode recover" in v.message, v.message
        assert "Stop the servers" not in v.message


def test_a_tail_of_failed_joiners_is_removed_exactly() -> None:
    exact = validate_scale(3, current_size=4, topology=GROWN_TO_4, failed_ranks=[3])
    assert exact.ok and exact.leaving_ranks == (3,)
    past = validate_scale(2, current_size=4, topology=GROWN_TO_4, failed_ranks=[3])
    assert not past.ok and "scale down to exactly 3" in past.message


def test_a_failed_joiner_below_a_live_one_is_removed_where_it_is() -> None:
    """It rejoins in place like a launch-time rank, so it may leave a hole as one does."""
    named = resolve_removal([2], 4, failed=[2], launch_size=2)
    assert not isinstance(named, int) and named.ok and named.leaves_holes, named
    assert named.leaving_ranks == (2,)
    assert "ranks [2] as joiners at their own --elastic-ep-join-rank-offset" in named.message
    assert resolve_removal([2, 3], 4, failed=[2], launch_size=2) == 2  # the tail: size 2


def test_a_live_joiner_below_a_live_one_is_removed_where_it_is() -> None:
    named = resolve_removal([2], 4, launch_size=2)
    assert not isinstance(named, int) and named.ok and named.leaves_holes, named
    assert "their shards drain" in named.message


@pytest.mark.parametrize(("ranks", "failed", "fragment"), [
    ([1, 3], [], 'remove the 2 highest ranks instead ({"remove_ranks": [2, 3]}'),
    ([2], [2, 3], "ranks [2] joined by scale-up and have no live rank above them"),
])
def test_a_joiner_with_no_live_rank_above_it_leaves_from_the_tail_only(
        ranks: list[int], failed: list[int], fragment: str) -> None:
    """With no live rank above that stays, the joiner is part of a tail the survivors let go
    (a failed one) or the top of the size (a live one): no hole."""
    named = resolve_removal(ranks, 4, failed=failed, launch_size=2)
    assert not isinstance(named, int) and named.status == 422, named
    assert named.reason is RejectionReason.NOT_THE_TAIL and fragment in named.message

import pytest

from sglang_elastic_ep.core.api_models import RankState
from sglang_elastic_ep.core.membership import (
    Membership,
    failed_in_place,
    failed_tail,
    not_removable_in_place,
)


def test_rank_states_cover_every_slot_up_to_max() -> None:
    m = Membership(
        max_size=8,
        effective_size=5,
        pending_size=None,
        failed=frozenset({1}),
        leaving=frozenset({3, 4}),
        safe_to_terminate=frozenset({5}),
    )
    assert [s.state for s in m.rank_statuses()] == [
        RankState.ACTIVE,
        RankState.FAILED,
        RankState.ACTIVE,
        RankState.LEAVING,
        RankState.LEAVING,
        RankState.SAFE_TO_TERMINATE,
        RankState.INACTIVE,
        RankState.INACTIVE,
    ]


def test_pending_slots_between_effective_and_pending_size() -> None:
    m = Membership(max_size=4, effective_size=2, pending_size=3)
    assert [m.rank_state(r) for r in range(4)] == [
        RankState.ACTIVE,
        RankState.ACTIVE,
        RankState.PENDING,
        RankState.INACTIVE,
    ]


def test_failed_in_range_ignores_ranks_beyond_effective_size() -> None:
    m = Membership(max_size=4, effective_size=2, failed=frozenset({1, 3}))
    assert m.failed_in_range() == frozenset({1})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_size": 4, "effective_size": 0},
        {"max_size": 4, "effective_size": 5},
        {"max_size": 4, "effective_size": 2, "failed": frozenset({4})},
    ],
)
def test_inconsistent_membership_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Membership(**kwargs)


def test_no_failed_tail_when_every_rank_inside_the_size_is_active() -> None:
    # rank 3 is beyond the effective size (not joined): not a failure
    assert failed_tail([1, 1, 1, 0], effective_size=3, launch_size=2) is None
    assert failed_in_place([1, 1, 1, 0], effective_size=3, launch_size=2) == ()


def test_a_failed_scale_joined_tail_is_let_go_and_nothing_rejoins_in_place_before() -> None:
    tail = failed_tail([1, 1, 0, 0], effective_size=4, launch_size=2)
    assert tail is not None and list(tail.ranks) == [2, 3]
    assert failed_in_place([1, 1, 0, 0], effective_size=4, launch_size=2) == ()


def test_a_failed_joiner_below_a_live_one_rejoins_in_place() -> None:
    assert failed_tail([1, 1, 0, 1], effective_size=4, launch_size=2) is None
    assert failed_in_place([1, 1, 0, 1], effective_size=4, launch_size=2) == (2,)
    # with a launch-time rank failed too, both rejoin in place together
    assert failed_in_place([1, 0, 0, 1], effective_size=4, launch_size=2) == (1, 2)


def test_only_the_failed_joiners_at_the_top_are_a_tail() -> None:
    # ranks 2 and 4 failed, 3 serves: the tail is [4]; rank 2 rejoins in place once it is let go
    mask = [1, 1, 0, 1, 0]
    tail = failed_tail(mask, effective_size=5, launch_size=2)
    assert tail is not None and list(tail.ranks) == [4]
    assert failed_in_place(mask, effective_size=5, launch_size=2) == ()
    assert failed_in_place(mask, effective_size=4, launch_size=2) == (2,)


def test_failed_launch_time_ranks_after_a_scale_rejoin_in_place() -> None:
    # rank 1 (launched with the server) failed after a scale-up to 3: it rejoins in place
    assert failed_in_place([1, 0, 1, 0], effective_size=3, launch_size=2) == (1,)
    assert failed_tail([1, 0, 1, 0], effective_size=3, launch_size=2) is None
    # after a shrink below the launch size, a failed rank inside the size is a launch rank
    assert failed_tail([1, 1, 0, 0], effective_size=2, launch_size=3) is None
    assert failed_in_place([1, 0, 0, 0], effective_size=2, launch_size=3) == (1,)
    assert failed_in_place([1, 0, 0, 0], effective_size=4, launch_size=4) == (1, 2, 3)


def test_a_launch_rank_and_a_joiner_failing_together_let_the_joiner_go_first() -> None:
    # rank 1 (launched) and rank 2 (joined, the top) failed: the joined tail is let go, then
    # rank 1 rejoins in place at the smaller size
    mask = [1, 0, 0, 0]
    tail = failed_tail(mask, effective_size=3, launch_size=2)
    assert tail is not None and list(tail.ranks) == [2]
    assert failed_in_place(mask, effective_size=3, launch_size=2) == ()
    assert failed_in_place(mask, effective_size=2, launch_size=2) == (1,)


@pytest.mark.parametrize("effective, launch", [(5, 2), (0, 2), (2, 0)])
def test_failed_tail_rejects_inconsistent_sizes(effective: int, launch: int) -> None:
    with pytest.raises(ValueError):
        failed_tail([1, 1, 1, 1], effective_size=effective, launch_size=launch)


def test_removed_ranks_are_holes_counted_in_no_size() -> None:
    m = Membership(max_size=4, effective_size=3, removed=frozenset({1}))
    assert m.managed_ranks() == [0, 2] and m.serving_size == 2
    assert [s.state.value for s in m.rank_statuses()] == ["active", "inactive", "active",
                                                          "inactive"]
    with pytest.raises(ValueError, match="both failed and removed"):
        Membership(max_size=4, effective_size=3, failed=frozenset({1}),
                   removed=frozenset({1}))


@pytest.mark.parametrize(("ranks", "live", "launch", "expected"), [
    ([2], [0, 1, 2, 3], 2, []),  # a joiner below a live one that stays: a hole
    ([1], [0, 1, 2, 3], 2, []),  # a launch-time rank: anywhere
    ([3], [0, 1, 2], 4, []),  # at the top too, failed
    ([2], [0, 1], 2, [2]),  # failed rank 3 above: one failed tail with it
    ([2, 3], [0, 1, 2, 3], 2, [2, 3]),  # nothing above stays
    ([1, 3], [0, 1, 2, 3], 2, [3]),
    ([0], [0, 1, 2, 3], 2, [0]),
    ([4], [0, 1, 2, 3], 2, [4]),
])
def test_only_a_joiner_below_a_live_rank_that_stays_is_removable_in_place(
        ranks: list[int], live: list[int], launch: int, expected: list[int]) -> None:
    assert not_removable_in_place(ranks, 4, launch, live) == expected

import pytest

from sglang_elastic_ep.core.api_models import RankState
from sglang_elastic_ep.core.membership import Membership


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

"""EPLB layouts adjusted so each expert lives on at least ``min_ranks`` ranks."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.placement import PlacementError, spread_replicas

HALVES = [*range(8), *range(8), *range(8, 16), *range(8, 16)]  # 2 ranks x 16 slots


def ranks_holding(row: list[int], slots: int) -> dict[int, set[int]]:
    held: dict[int, set[int]] = {}
    for s, e in enumerate(row):
        held.setdefault(e, set()).add(s // slots)
    return held


def test_each_half_placed_twice_on_one_rank_ends_on_both_ranks() -> None:
    row = spread_replicas(HALVES, 16, min_ranks=2, num_logical_experts=16)
    assert all(len(r) == 2 for r in ranks_holding(row, 16).values())
    assert sorted(row) == sorted(HALVES)  # here every expert keeps its two replicas
    # Only the second copies moved; each rank's first copies stayed where they were.
    assert row[:8] == HALVES[:8] and row[16:24] == HALVES[16:24]


def test_hot_experts_keep_most_replicas_and_cold_ones_gain_a_second_rank() -> None:
    # EPLB-like: expert 0 is hot (6 replicas), 1 and 2 live on rank 0 only, 3 on rank 1 only.
    row = [0, 0, 0, 0, 1, 2, 0, 0, 3, 3, 3, 3]
    spread = spread_replicas(row, 6, min_ranks=2, num_logical_experts=4)
    held = ranks_holding(spread, 6)
    assert all(held[e] == {0, 1} for e in range(4)), spread
    assert spread.count(0) >= 3, spread  # the hot expert keeps most of its replicas
    assert spread[4:6] == [1, 2], spread  # the cold experts' own slots stay


def test_min_ranks_above_the_rank_count_asks_for_every_rank() -> None:
    row = spread_replicas(HALVES, 16, min_ranks=5, num_logical_experts=16)
    assert all(len(r) == 2 for r in ranks_holding(row, 16).values())


def test_min_ranks_1_changes_nothing() -> None:
    assert spread_replicas(HALVES, 16, min_ranks=1, num_logical_experts=16) == HALVES


def test_too_few_slots_is_an_error_naming_the_need() -> None:
    with pytest.raises(PlacementError, match="need 32 slots, there are 16"):
        spread_replicas([*range(8), *range(8, 16)], 8, min_ranks=2, num_logical_experts=16)


def test_uneven_ranks_are_refused() -> None:
    with pytest.raises(PlacementError, match="do not split"):
        spread_replicas(HALVES[:30], 16, min_ranks=2, num_logical_experts=16)

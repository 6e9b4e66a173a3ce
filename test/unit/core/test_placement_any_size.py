"""Placement at every size from 1 to max, for expert counts that do not divide the rank count.

Each rank keeps the slots it got at launch ((experts + redundant) / launch size). A scale-up
appends the new ranks' slots as upstream does (``append_trivial_expert_slots``: copies, in
order, starting after the launch slots); a scale-down keeps the staying ranks' slots and moves
what only the leaving ranks hold (``scale_down_map``). What fits is placed with every expert
covered; what cannot fit is refused with a reason before anything moves.
"""

from __future__ import annotations

import itertools

import pytest

from sglang_elastic_ep.core.placement import (
    PlacementError,
    launch_slots_per_rank,
    scale_down_map,
    size_refusal,
)

MAX_SIZE = 6


def launch_row(num_logical: int, slots: int, launch_size: int) -> list[int]:
    return [p % num_logical for p in range(slots * launch_size)]


def grown(row: list[int], slots: int, launch_size: int, size: int, num_logical: int) -> list[int]:
    """Upstream's expansion to ``size`` ranks (model_runner._expand_eplb_metadata_for_scale)."""
    start = len(row) - slots * launch_size
    added = slots * size - len(row)
    return row + [(start + i) % num_logical for i in range(added)]


CASES = [  # (experts, redundant, launch size): none divides evenly without the redundant ones
    (num_logical, redundant, launch)
    for num_logical, launch in itertools.product((5, 7, 16), (2, 3, 4))
    for redundant in range(0, 2 * launch)
    if (num_logical + redundant) % launch == 0
]


@pytest.mark.parametrize(("num_logical", "redundant", "launch_size"), CASES)
def test_every_size_from_1_to_max_is_placed_or_refused_with_a_reason(
    num_logical: int, redundant: int, launch_size: int
) -> None:
    slots = launch_slots_per_rank(num_logical, redundant, launch_size)
    row = launch_row(num_logical, slots, launch_size)
    for size in range(1, MAX_SIZE + 1):
        refusal = size_refusal(num_logical, slots, size)
        if size > launch_size:
            assert refusal is None  # a scale-up always fits
            layout = grown(row, slots, launch_size, size, num_logical)
        elif size == launch_size:
            layout = row
        elif refusal is not None:
            assert f"keep at least {-(-num_logical // slots)} ranks" in refusal
            with pytest.raises(PlacementError):
                scale_down_map([row], launch_size, size, num_logical)
            continue
        else:
            layout = scale_down_map([row], launch_size, size, num_logical)[0][:slots * size]
        assert len(layout) == slots * size
        assert set(layout) == set(range(num_logical)), (size, layout)


def test_a_launch_that_does_not_split_names_the_redundant_counts_that_do() -> None:
    with pytest.raises(PlacementError, match=r"16 experts \+ 0 redundant = 16 .* 3 launch "
                                             r"ranks: use --ep-num-redundant-experts 2 or 5"):
        launch_slots_per_rank(16, 0, 3)
    with pytest.raises(PlacementError, match="use --ep-num-redundant-experts 3 or 7 or 11"):
        launch_slots_per_rank(5, 4, 4)
    assert launch_slots_per_rank(16, 2, 3) == 6


def test_a_shrink_below_the_experts_is_refused_and_names_the_smallest_size() -> None:
    assert size_refusal(16, 6, 2) == (
        "2 ranks x 6 expert slots hold fewer than the 16 experts: keep at least 3 ranks, or "
        "launch with more --ep-num-redundant-experts")
    assert size_refusal(16, 6, 3) is None
    assert size_refusal(16, 16, 1) is None

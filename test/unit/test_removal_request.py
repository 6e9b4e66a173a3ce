"""A removal of named ranks travels to the schedulers as a negative ``new_ep_size``."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.sglang.removal_request import removal_size, removed_ranks
from sglang_elastic_ep.sglang.scale_up import CANCEL_EP_SIZE


@pytest.mark.parametrize("ranks", [[1], [2], [1, 3], [5, 2, 7], [63]])
def test_a_removal_round_trips_through_the_size(ranks: list[int]) -> None:
    size = removal_size(ranks)
    assert size < CANCEL_EP_SIZE and size < -2
    assert removed_ranks(size) == tuple(sorted(ranks))


@pytest.mark.parametrize("size", [CANCEL_EP_SIZE, 1, 2, 8, -1, -2])
def test_sizes_and_the_cancel_name_no_removal(size: int) -> None:
    assert removed_ranks(size) == ()


def test_rank_zero_is_never_sent_for_removal() -> None:
    with pytest.raises(ValueError, match="rank 0"):
        removal_size([0, 1])

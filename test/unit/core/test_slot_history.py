"""Which joins are recoveries: the per-slot history behind ``is_recovery_join``."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.membership import JoinKind, SlotHistory


def test_a_launch_rank_that_rejoins_is_a_recovery_and_a_new_slot_a_scale_up() -> None:
    history = SlotHistory([0, 1])
    assert history.join_kind([1]) is JoinKind.RECOVERY
    assert history.join_kind([2]) is JoinKind.SCALE_UP


def test_a_slot_seen_active_once_stays_a_recovery_after_it_fails() -> None:
    history = SlotHistory([0, 1])
    history.observe([1, 1, 1])  # scale-up committed
    history.observe([1, 1, 0])  # rank 2 failed
    assert history.join_kind([2]) is JoinKind.RECOVERY
    assert history.ever_active == {0, 1, 2}


def test_a_released_slot_rejoins_as_a_scale_up() -> None:
    history = SlotHistory([0, 1, 2])
    history.release([2])  # scale-down: its experts left the map
    assert history.join_kind([2]) is JoinKind.SCALE_UP
    assert history.join_kind([1]) is JoinKind.RECOVERY


def test_a_mix_of_old_and_new_slots_is_refused_with_both_named() -> None:
    history = SlotHistory([0, 1])
    with pytest.raises(ValueError, match=r"\[1\].*\[2\]"):
        history.join_kind([1, 2])

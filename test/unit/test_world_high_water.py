"""A scale joiner registers for the largest WORLD so far (cpu/mooncake_cpu.py): Mooncake keeps
WORLD's longest rank order after a scale-down and refuses a shorter registration."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from sglang_elastic_ep_testbed.cluster.procs import free_port
from sglang_elastic_ep_testbed.cpu.mooncake_cpu import (
    joiner_world_size,
    raise_world_high_water,
    read_world_high_water,
)


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))


def test_a_first_joiner_asks_for_its_own_size() -> None:
    assert joiner_world_size(3, None) == 3


def test_after_four_to_two_a_slot_two_joiner_asks_for_four() -> None:
    assert joiner_world_size(3, 4) == 4


def test_a_joiner_beyond_the_high_water_asks_for_its_own_size() -> None:
    assert joiner_world_size(4, 3) == 4


def test_the_high_water_only_rises(store: TCPStore) -> None:
    assert read_world_high_water(store) is None
    raise_world_high_water(store, 3)
    assert read_world_high_water(store) == 3
    raise_world_high_water(store, 4)
    raise_world_high_water(store, 3)  # a slot-2 joiner after 4 -> 3 -> 2 must not lower it
    assert read_world_high_water(store) == 4


def test_a_client_sees_what_another_raised(store: TCPStore) -> None:
    client = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    raise_world_high_water(client, 4)
    assert read_world_high_water(store) == 4

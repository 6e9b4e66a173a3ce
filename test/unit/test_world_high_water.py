"""A scale joiner registers for the largest WORLD so far (sglang/world_registration.py, any
device): Mooncake keeps WORLD's longest rank order after a scale-down and refuses a shorter
registration. The same store carries how many ranks are still in the launch-time groups once
a scale-down released launch-time ranks."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from torch.distributed import TCPStore

from sglang_elastic_ep.sglang.world_registration import (
    adopt_launch_group_size,
    joiner_world_size,
    launch_group_size,
    lower_launch_group_size,
    raise_world_high_water,
    read_launch_group_size,
    read_world_high_water,
    release_launch_ranks,
    rendezvous_store,
)
from sglang_elastic_ep_testbed.cluster.procs import free_port


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


def test_a_joiner_reaches_the_rendezvous_store_by_its_init_method(store: TCPStore) -> None:
    raise_world_high_water(store, 4)
    client = rendezvous_store(f"tcp://127.0.0.1:{store.port}")
    assert client is not None
    assert read_world_high_water(client) == 4


def test_an_unreachable_store_leaves_the_joiner_at_its_own_size() -> None:
    assert rendezvous_store(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.5) is None
    assert rendezvous_store("env://") is None


def _register(monkeypatch: pytest.MonkeyPatch, store: TCPStore, *, joiner: bool, asked: int
              ) -> int:
    """Run the hook around a stand-in for upstream: the WORLD size it registered for."""
    from sglang_elastic_ep.sglang import world_registration

    monkeypatch.setattr(world_registration, "_mooncake_world", lambda backend: (True, joiner))
    seen: dict[str, int] = {}
    monkeypatch.setattr(world_registration, "apply_timeouts",
                        lambda: seen.setdefault("timeouts_before_world", "world_size" not in seen))

    def upstream(**kwargs: object) -> None:
        seen["world_size"] = int(kwargs["world_size"])  # type: ignore[call-overload]

    world_registration.init_distributed_environment(
        upstream, backend="mooncake", world_size=asked, rank=asked - 1,
        distributed_init_method=f"tcp://127.0.0.1:{store.port}")
    assert seen["timeouts_before_world"] is True  # every Mooncake rank, before it registers
    return seen["world_size"]


def test_the_hook_raises_a_joiner_to_the_high_water_and_keeps_it(
        monkeypatch: pytest.MonkeyPatch, store: TCPStore) -> None:
    assert _register(monkeypatch, store, joiner=True, asked=4) == 4  # 2 -> 4: two joiners
    assert _register(monkeypatch, store, joiner=True, asked=3) == 4  # after 4 -> 2, slot 2
    assert read_world_high_water(store) == 4


def test_a_joiner_at_the_high_water_moves_no_key_after_it_registered(
        monkeypatch: pytest.MonkeyPatch, store: TCPStore) -> None:
    """The raise is skipped, not merely harmless: a store that stops answering after the
    registration cannot fail a replacement that registered at the high water."""
    from sglang_elastic_ep.sglang import world_registration

    raise_world_high_water(store, 4)
    moved: list[int] = []
    monkeypatch.setattr(world_registration, "raise_world_high_water",
                        lambda store, size: moved.append(size))
    assert _register(monkeypatch, store, joiner=True, asked=2) == 4
    assert moved == []
    assert _register(monkeypatch, store, joiner=True, asked=5) == 5  # beyond it: moved
    assert moved == [5]


def test_the_hook_leaves_launch_ranks_alone(monkeypatch: pytest.MonkeyPatch, store: TCPStore
                                            ) -> None:
    raise_world_high_water(store, 4)
    assert _register(monkeypatch, store, joiner=False, asked=2) == 2



def test_the_launch_group_is_the_launch_size_until_a_release_is_recorded() -> None:
    assert launch_group_size(3, None) == 3
    assert launch_group_size(3, 2) == 2
    assert launch_group_size(2, 3) == 2  # a record never widens it


def test_the_launch_group_size_only_falls(store: TCPStore) -> None:
    assert read_launch_group_size(store) is None
    lower_launch_group_size(store, 3)
    lower_launch_group_size(store, 2)
    lower_launch_group_size(store, 3)  # a later scale-down to 3 cannot bring rank 2 back
    assert read_launch_group_size(store) == 2
    assert read_world_high_water(store) is None  # the two records are apart


@pytest.fixture
def deployment_store(store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> TCPStore:
    """``store`` as the deployment's rendezvous store (upstream's global TCP store)."""
    import sglang.srt.distributed.utils as distributed_utils

    monkeypatch.setattr(distributed_utils, "get_global_tcp_store", lambda: store)
    return store


def test_a_shrink_below_the_launch_size_lowers_the_boundary_and_rank_0_records_it(
        deployment_store: TCPStore) -> None:
    rank1 = SimpleNamespace(original_ep_size=3)
    release_launch_ranks(rank1, 2, rank=1)
    assert rank1.original_ep_size == 2
    assert read_launch_group_size(deployment_store) is None  # only rank 0 writes
    rank0 = SimpleNamespace(original_ep_size=3)
    release_launch_ranks(rank0, 2, rank=0)
    assert rank0.original_ep_size == 2 and read_launch_group_size(deployment_store) == 2


def test_a_shrink_that_keeps_every_launch_rank_changes_nothing(
        deployment_store: TCPStore) -> None:
    state = SimpleNamespace(original_ep_size=2)
    release_launch_ranks(state, 2, rank=0)  # 4 -> 2 with launch size 2: joiners leave
    assert state.original_ep_size == 2 and read_launch_group_size(deployment_store) is None


def test_a_later_joiner_takes_the_recorded_boundary(deployment_store: TCPStore) -> None:
    joiner = SimpleNamespace(original_ep_size=3)  # upstream: its --elastic-ep-initial-size
    adopt_launch_group_size(joiner)
    assert joiner.original_ep_size == 3  # nothing released yet
    lower_launch_group_size(deployment_store, 2)
    adopt_launch_group_size(joiner)
    assert joiner.original_ep_size == 2

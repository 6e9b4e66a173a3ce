"""Replica tables behind the dispatch repair, and the local replicas a rank must load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.sglang import expert_dispatch
from sglang_elastic_ep.sglang.replica_loading import local_replica_slots

HALVES = [*range(4), *range(4), *range(4, 8), *range(4, 8)]  # 2 ranks x 8 slots, 8 experts


def test_every_local_replica_of_an_expert_is_listed_not_only_the_first() -> None:
    assert local_replica_slots(HALVES, 3, first_slot=0, num_local=8) == [3, 7]
    assert local_replica_slots(HALVES, 3, first_slot=8, num_local=8) == []
    assert local_replica_slots(HALVES, 5, first_slot=8, num_local=8) == [9, 13]
    # A slot range past the map's end (a joiner before its slots were appended) holds nothing.
    assert local_replica_slots(HALVES, 5, first_slot=16, num_local=8) == []


def test_the_full_table_has_a_fixed_width_so_a_rebalance_fits_in_place() -> None:
    table, counts = expert_dispatch.full_replica_table(torch.tensor([HALVES]), num_logical=8)
    assert table.shape == (1, 8, 16 - 8 + 1)
    assert table[0, 3, :2].tolist() == [3, 7] and counts[0, 3] == 2
    assert (table[0, 3, 2:] == -1).all()


class FakeMetadata:
    def __init__(self, p2l: list[int]) -> None:
        self.physical_to_logical_map = torch.tensor([p2l])
        self.num_logical_experts = 8


@pytest.fixture
def caches(monkeypatch: pytest.MonkeyPatch) -> expert_dispatch.DispatchCaches:
    """The dispatch caches of a process whose elastic state is a bare object."""
    state = SimpleNamespace()
    monkeypatch.setattr(expert_dispatch, "elastic_state", lambda: state)
    return expert_dispatch.dispatch_caches(state)


def test_an_in_place_metadata_update_refreshes_the_cached_tables_in_the_same_tensors(
        caches: expert_dispatch.DispatchCaches) -> None:
    metadata = FakeMetadata(HALVES)
    table, _ = caches.full_replicas(metadata, 0, torch.device("cpu"), False)
    before = table.data_ptr()
    assert table[5, :2].tolist() == [9, 13]
    # EPLB rewrites the same metadata object: expert 5 now lives once on each rank.
    spread = [*range(8), *range(8)]
    metadata.physical_to_logical_map[0] = torch.tensor(spread)
    expert_dispatch.refresh_replica_tables(metadata)
    table, counts = caches.full_replicas(metadata, 0, torch.device("cpu"), False)
    assert table.data_ptr() == before
    assert table[5, :2].tolist() == [5, 13] and counts[5] == 2


def test_an_update_of_another_metadata_leaves_the_cache_alone(
        caches: expert_dispatch.DispatchCaches) -> None:
    metadata = FakeMetadata(HALVES)
    caches.full_replicas(metadata, 0, torch.device("cpu"), False)
    expert_dispatch.refresh_replica_tables(FakeMetadata([*range(8), *range(8)]))
    again, _ = caches.full_replicas(metadata, 0, torch.device("cpu"), False)
    assert again[5, :2].tolist() == [9, 13]


def test_a_reset_gives_the_process_fresh_caches(caches: expert_dispatch.DispatchCaches) -> None:
    caches.dropped_counter(torch.device("cpu"), False).add_(3)
    assert expert_dispatch.dropped_expert_assignments() == 3
    expert_dispatch.reset_caches()
    assert expert_dispatch.dropped_expert_assignments() == 0

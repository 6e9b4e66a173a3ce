"""The expert map's broadcast at a membership change is checked before the metadata is built."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.sglang import expert_map_broadcast
from sglang_elastic_ep.sglang.expert_map_broadcast import (
    ExpertMapNotReceived,
    checked_expert_map_broadcast,
    settle_map_broadcast,
)

LOGICAL = 8
MAP = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1], [7, 6, 5, 4, 3, 2, 1, 0, 7, 6]])
# What a receive buffer held after an earlier collective of another shape: no expert ids.
LEFT_OVER = torch.full_like(MAP, 1 << 40)


def test_the_source_takes_back_the_map_it_sent() -> None:
    received = LEFT_OVER.clone()
    assert settle_map_broadcast(received, MAP.clone(), src_rank=0, failed=[2]) is True
    assert torch.equal(received, MAP)


def test_a_source_whose_map_came_through_changes_nothing() -> None:
    received = MAP.clone()
    assert settle_map_broadcast(received, MAP.clone(), src_rank=0, failed=None) is False
    assert torch.equal(received, MAP)


def test_a_rank_that_received_from_the_source_keeps_what_it_received() -> None:
    received = MAP.clone()
    # Another peer (the hung joiner) failed; the source's write reached this rank.
    assert settle_map_broadcast(received, None, src_rank=0, failed=[2]) is False
    assert torch.equal(received, MAP)
    assert settle_map_broadcast(received, None, src_rank=0, failed=None) is False


def test_a_rank_that_failed_on_the_source_stops_with_an_action() -> None:
    with pytest.raises(ExpertMapNotReceived, match="from rank 0 .*--ep-join-mode recover"):
        settle_map_broadcast(LEFT_OVER.clone(), None, src_rank=0, failed=[0, 2])


class GarblingBroadcast:
    """``torch.distributed`` as the source sees it when the broadcast ends without a peer: the
    tensor is overwritten with what the receive buffer held."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[tuple[int, bool]] = []

    def get_rank(self) -> int:
        return self.rank

    def get_backend(self, group: Any = None) -> str:
        return "mooncake-cpu"

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None,
                  async_op: bool = False) -> Any:
        self.calls.append((src, async_op))
        tensor.copy_(LEFT_OVER)
        return SimpleNamespace(wait=lambda: True)


class ExpertLocation:
    """The parts of upstream's ``expert_location`` module the broadcast uses; ``init_by_mapping``
    indexes by expert id as upstream's does."""

    def __init__(self) -> None:
        self.metadata = SimpleNamespace(physical_to_logical_map=MAP.clone())
        self.built: list[torch.Tensor] = []
        self.ExpertLocationMetadata = SimpleNamespace(init_by_mapping=self.init_by_mapping)

    def get_global_expert_location_metadata(self) -> Any:
        return self.metadata

    def set_global_expert_location_metadata(self, value: Any, allow_overwrite: bool) -> None:
        assert allow_overwrite
        self.metadata = value

    def init_by_mapping(self, model_config: Any, mapping: torch.Tensor,
                        moe_ep_rank: int) -> Any:
        replicas: list[list[int]] = [[] for _ in range(LOGICAL)]
        for physical, logical in enumerate(mapping[0].tolist()):
            replicas[logical].append(physical)
        self.built.append(mapping.clone())
        return SimpleNamespace(physical_to_logical_map=mapping, replicas=replicas)


def elastic(monkeypatch: pytest.MonkeyPatch, rank: int, failed: list[int] | None
            ) -> tuple[GarblingBroadcast, ExpertLocation]:
    dist, location = GarblingBroadcast(rank), ExpertLocation()
    monkeypatch.setattr(expert_map_broadcast, "dist", dist)
    monkeypatch.setattr(expert_map_broadcast, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(expert_map_broadcast, "expert_location_module", lambda: location)
    monkeypatch.setattr(expert_map_broadcast, "failed_peers", lambda work: failed)
    return dist, location


def never_called(**kwargs: Any) -> Any:
    raise AssertionError("upstream's version builds the metadata from the overwritten tensor")


def test_the_source_builds_the_metadata_from_the_map_it_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dist, location = elastic(monkeypatch, rank=0, failed=[2])
    built = checked_expert_map_broadcast(never_called, model_config=None, moe_ep_rank=0,
                                         src_rank=0)
    assert dist.calls == [(0, True)]
    assert [torch.equal(m, MAP) for m in location.built] == [True]
    assert location.metadata is built and built.replicas[0] == [0, 8]


def test_a_receiver_that_failed_on_the_source_builds_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _, location = elastic(monkeypatch, rank=1, failed=[0])
    before = location.metadata
    with pytest.raises(ExpertMapNotReceived):
        checked_expert_map_broadcast(never_called, model_config=None, moe_ep_rank=1,
                                     src_rank=0)
    assert location.built == [] and location.metadata is before


def test_without_elastic_ep_upstream_runs_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(expert_map_broadcast, "elastic_ep_enabled", lambda: False)
    seen: list[dict[str, Any]] = []
    result = checked_expert_map_broadcast(lambda **kwargs: seen.append(kwargs) or "upstream",
                                          model_config="cfg", moe_ep_rank=3, src_rank=1)
    assert result == "upstream"
    assert seen == [{"model_config": "cfg", "moe_ep_rank": 3, "src_rank": 1, "group": None}]

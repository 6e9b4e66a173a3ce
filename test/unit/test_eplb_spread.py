"""The EPLB hook: upstream's layout, then every expert on ``--elastic-ep-expert-min-ranks``."""

from __future__ import annotations

import pytest
import torch

from sglang_elastic_ep.sglang import eplb_spread

HALVES = [*range(4), *range(4), *range(4, 8), *range(4, 8)]  # 2 ranks x 8 slots, 8 experts


def upstream_layout(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
    phy2log = torch.tensor([HALVES, HALVES])
    log2phy, counts = eplb_spread.replica_lists(phy2log, 8, 9)
    return phy2log, log2phy, counts


@pytest.mark.parametrize("min_ranks", [1, 2])
def test_the_layout_is_spread_only_above_one_rank(monkeypatch: pytest.MonkeyPatch,
                                                  min_ranks: int) -> None:
    monkeypatch.setattr(eplb_spread, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(eplb_spread, "min_expert_ranks", lambda: min_ranks)
    phy2log, log2phy, counts = eplb_spread.rebalance_experts_spread(
        upstream_layout, tokens_per_expert=None, num_physical_experts=16,
        num_local_physical_experts=8, num_groups=None, num_nodes=1, algorithm=None)
    rows = phy2log.tolist()
    if min_ranks == 1:
        assert rows == [HALVES, HALVES]
        return
    for row in rows:
        assert all({s // 8 for s, e in enumerate(row) if e == x} == {0, 1} for x in range(8))
    # The replica lists and counts describe the new map exactly.
    for layer, row in enumerate(rows):
        for logical in range(8):
            slots = [s for s, e in enumerate(row) if e == logical]
            assert log2phy[layer, logical, :len(slots)].tolist() == slots
            assert (log2phy[layer, logical, len(slots):] == -1).all()
            assert counts[layer, logical] == len(slots)


def test_without_elastic_ep_the_layout_is_upstreams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eplb_spread, "elastic_ep_enabled", lambda: False)
    phy2log, _, _ = eplb_spread.rebalance_experts_spread(upstream_layout)
    assert phy2log.tolist() == [HALVES, HALVES]


def test_a_down_ranks_slots_stay_and_the_spread_uses_the_live_ranks() -> None:
    # 3 ranks x 4 slots, 4 experts; rank 1 is down and upstream filled its slots with expert 0.
    row = [0, 1, 2, 3, 0, 0, 0, 0, 0, 1, 2, 3]
    spread = eplb_spread.spread_over_ranks(row, [0, 2], 4, 2, 4)
    assert spread[4:8] == [0, 0, 0, 0]
    for expert in range(4):
        assert {s // 4 for s, e in enumerate(spread) if e == expert and s // 4 != 1} == {0, 2}


def test_live_layout_ranks_reads_the_active_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    state = type("State", (), {"active_ranks": torch.tensor([1, 0, 1, 0])})()
    monkeypatch.setattr(eplb_spread, "elastic_state", lambda: state)
    assert eplb_spread.live_layout_ranks(3) == [0, 2]
    monkeypatch.setattr(eplb_spread, "elastic_state", lambda: None)
    assert eplb_spread.live_layout_ranks(3) == [0, 1, 2]

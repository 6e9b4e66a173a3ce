"""Upstream's elasticity-aware EPLB layout after a rank fault, below ``--max-ep-size``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang_elastic_ep.sglang import eplb_spread  # noqa: E402

# 3 ranks of 16 slots over 16 experts; active_ranks spans --max-ep-size 4.
LAYOUT = dict(num_replicas=48, num_groups=1, num_nodes=1, num_gpus=3,
              enable_hierarchical=False)


def layout(active: list[int], *, hooked: bool) -> torch.Tensor:
    from sglang.srt.eplb.eplb_algorithms import elasticity_aware

    weight = torch.arange(1, 33, dtype=torch.float32).reshape(2, 16)
    kwargs = dict(weight=weight, **LAYOUT, active_ranks=torch.tensor(active))
    if hooked:
        phy2log, _, _ = eplb_spread.elasticity_aware_over_layout_ranks(
            elasticity_aware.rebalance_experts, **kwargs)
    else:
        phy2log, _, _ = elasticity_aware.rebalance_experts(**kwargs)
    return phy2log


@pytest.mark.parametrize("active", [[1, 1, 0, 0], [1, 0, 1, 0]])
def test_a_rank_down_below_max_ep_size_keeps_the_layout_at_its_ranks(active: list[int]) -> None:
    # Upstream counts the unused capacity entry as a rank: 4 ranks of slots for a 3-rank layout.
    assert layout(active, hooked=False).shape == (2, 64)
    phy2log = layout(active, hooked=True)
    assert phy2log.shape == (2, 48)
    dead = active.index(0)
    for row in phy2log.tolist():
        live_slots = [e for s, e in enumerate(row) if s // 16 != dead]
        assert sorted(set(live_slots)) == list(range(16)), row  # every expert on a live rank


def test_with_every_rank_up_the_layout_is_upstreams() -> None:
    assert torch.equal(layout([1, 1, 1, 0], hooked=True), layout([1, 1, 1, 0], hooked=False))

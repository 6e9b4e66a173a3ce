"""Weight moves keep point-to-point transfers between launch-time ranks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.core.membership import p2p_peers_mask
from sglang_elastic_ep.sglang import weight_transfers


def test_both_ends_of_every_transfer_agree_on_whether_it_happens() -> None:
    active = [1, 1, 1, 1, 0]
    launch = 2
    masks = {r: p2p_peers_mask(active, r, launch) for r in range(4)}
    assert masks[0] == [1, 1, 0, 0, 0] and masks[1] == [1, 1, 0, 0, 0]
    assert masks[2] == [0, 0, 1, 0, 0] and masks[3] == [0, 0, 0, 1, 0]
    for a in range(4):
        for b in range(4):
            if a != b:  # a sends to b iff b receives from a
                assert masks[a][b] == masks[b][a], (a, b)


def test_a_failed_launch_rank_stays_masked() -> None:
    assert p2p_peers_mask([1, 0, 1], 0, 2) == [1, 0, 0]


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Three active ranks after a scale-up from two, and the pinned Mooncake."""
    found = SimpleNamespace(active_ranks_cpu=torch.tensor([1, 1, 1], dtype=torch.int32),
                            has_scaled=True, original_ep_size=2)
    monkeypatch.setattr(weight_transfers, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(weight_transfers, "elastic_state", lambda: found)
    monkeypatch.setattr(weight_transfers, "mooncake_p2p_reaches_joiners", lambda: False)
    return found


def test_the_update_sees_the_mask_and_the_state_is_restored(state: SimpleNamespace) -> None:
    seen: list[list[int]] = []

    def upstream(updater: object, *args: object, **kwargs: object) -> str:
        seen.append(state.active_ranks_cpu.tolist())
        raise RuntimeError("the update failed")

    with pytest.raises(RuntimeError):
        weight_transfers.update_without_joiner_p2p(upstream, object(), {}, None, [0], 1, rank=2)
    assert seen == [[0, 0, 1]]
    assert state.active_ranks_cpu.tolist() == [1, 1, 1]


def test_before_any_scale_or_with_a_fixed_mooncake_the_update_is_upstreams(
    state: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
) -> None:
    state.has_scaled = False
    seen: list[list[int]] = []

    def upstream(updater: object, *args: object, **kwargs: object) -> None:
        seen.append(state.active_ranks_cpu.tolist())

    weight_transfers.update_without_joiner_p2p(upstream, object(), rank=2)
    state.has_scaled = True
    monkeypatch.setattr(weight_transfers, "mooncake_p2p_reaches_joiners", lambda: True)
    weight_transfers.update_without_joiner_p2p(upstream, object(), rank=2)
    assert seen == [[1, 1, 1], [1, 1, 1]]

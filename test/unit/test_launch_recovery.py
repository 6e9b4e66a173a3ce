"""A launch-time rank that failed after a scale rejoins in place (``sglang/launch_recovery``):
which ranks the survivors wait for, and the exchange that picks the expert map's source and
tells the replacement the size the survivors serve on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.sglang import launch_recovery


def survivor(mask: list[int], *, effective: int = 3, launch: int = 2, scaled: bool = True,
             pending: int | None = None) -> SimpleNamespace:
    tensor = torch.tensor(mask, dtype=torch.int32)
    return SimpleNamespace(active_ranks=tensor.clone(), active_ranks_cpu=tensor,
                           effective_ep_size=effective, original_ep_size=launch,
                           has_scaled=scaled, pending_ep_size=pending)


def test_survivors_wait_for_failed_launch_ranks_only_after_a_scale() -> None:
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 1, 0])) == (1,)
    # before any scale upstream's own recovery runs; during a scale nothing is taken back
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 0, 0], effective=2,
                                                    scaled=False)) == ()
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 1, 0], pending=4)) == ()
    # a failed scale-joined tail is let go of instead (tail_recovery)
    assert launch_recovery.ranks_to_rejoin(survivor([1, 1, 0, 0])) == ()


class WorldOfRanks:
    """``dist`` for one all-reduce of the rows every member writes (SUM over the members)."""

    def __init__(self, rank: int, others: dict[int, tuple[int, int]]) -> None:
        self.rank, self.others = rank, others
        self.group = SimpleNamespace(WORLD="world")

    def get_rank(self) -> int:
        return self.rank

    def all_reduce(self, rows: torch.Tensor, group: Any = None) -> None:
        assert group == "world"
        for rank, row in self.others.items():
            rows[rank] += torch.tensor(row, dtype=rows.dtype)


def test_the_first_healthy_rank_sends_the_map_and_a_replacement_learns_the_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(launch_recovery, "take_on_serving_size",
                        lambda state, size: taken.append(size))
    healthy, rejoining = launch_recovery.HEALTHY, launch_recovery.REJOINING
    # rank 1 rejoins; ranks 0 and 2 serve on 3
    replacement = survivor([0, 1, 0, 0], effective=4, launch=4)
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: replacement)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {0: (healthy, 3),
                                                                   2: (healthy, 3)}))
    upstream = pytest.fail  # never asked while elastic EP is set up
    assert launch_recovery.healthy_source_rank(
        upstream, invoked_in_elastic_ep_rejoin_path=True) == 0
    assert taken == [3]
    # a survivor: the same source, and nothing taken on
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: survivor([1, 0, 1, 0]))
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(2, {0: (healthy, 3),
                                                                   1: (rejoining, 0)}))
    assert launch_recovery.healthy_source_rank(
        upstream, invoked_in_elastic_ep_rejoin_path=False) == 0
    assert taken == [3]


def test_no_healthy_member_is_an_error_naming_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: survivor([0, 1, 0, 0]))
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {}))
    with pytest.raises(RuntimeError, match="every member of WORLD is rejoining"):
        launch_recovery.healthy_source_rank(pytest.fail, invoked_in_elastic_ep_rejoin_path=True)


def test_without_elastic_ep_state_upstreams_exchange_runs(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: None)
    assert launch_recovery.healthy_source_rank(
        lambda **kwargs: 7, invoked_in_elastic_ep_rejoin_path=False) == 7

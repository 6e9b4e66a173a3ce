"""Decisions of the recovery of scale-joined ranks (sglang/tail_recovery.py), on fake state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import tail_recovery
from sglang_elastic_ep.sglang.upstream import RECOVERY_UNSUPPORTED


class FakeManager:
    def __init__(self, state: SimpleNamespace) -> None:
        self.state = state
        self.failed: list[str] = []

    def instance(self) -> SimpleNamespace:
        return self.state

    def fail_recovery(self, error: str) -> None:
        self.failed.append(error)
        self.state.scale_phase = RECOVERY_UNSUPPORTED


def state(active: list[int], effective: int, launch: int = 2, **kw: object) -> SimpleNamespace:
    mask = torch.tensor(active, dtype=torch.int32)
    return SimpleNamespace(active_ranks=mask, active_ranks_cpu=mask.clone(),
                           effective_ep_size=effective, original_ep_size=launch,
                           pending_ep_size=kw.get("pending"), has_scaled=True,
                           scale_phase=Phase.SERVING_EXPANDED.value)


@pytest.fixture
def wired(monkeypatch: pytest.MonkeyPatch):
    """Installs a fake state manager and a 2-slots-per-rank expert map; returns a setter."""
    from sglang.srt.eplb import expert_location

    def wire(st: SimpleNamespace, p2l: list[int]) -> tuple[FakeManager, list[tuple]]:
        manager = FakeManager(st)
        reports: list[tuple] = []
        metadata = SimpleNamespace(physical_to_logical_map=torch.tensor([p2l]))
        monkeypatch.setattr(tail_recovery, "state_manager", lambda: manager)
        monkeypatch.setattr(expert_location, "get_global_expert_location_metadata",
                            lambda: metadata)
        runner = SimpleNamespace(_report_elastic_scale_failure=lambda *a: reports.append(a))
        wire.runner = runner
        return manager, reports

    return wire


def test_nothing_failed_or_a_scale_pending_means_no_contraction(wired) -> None:
    manager, _ = wired(state([1, 1, 1, 0], effective=3), [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    pending = state([1, 1, 0, 0], effective=3, pending=4)
    manager, _ = wired(pending, [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(pending, wired.runner) == 0


def test_a_failed_scale_joined_tail_with_replicas_elsewhere_is_let_go(wired) -> None:
    manager, reports = wired(state([1, 1, 0, 0], effective=3), [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 2
    assert manager.failed == [] and reports == []


def test_a_tail_holding_the_last_replica_fails_the_recovery_with_the_reason(wired) -> None:
    manager, reports = wired(state([1, 1, 0, 0], effective=3), [0, 1, 0, 1, 2, 3])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    (reason,) = manager.failed
    assert "logical experts [2, 3]" in reason and "--ep-num-redundant-experts" in reason
    assert reports == [(reason, 3)]
    # once failed, later passes do not try (nor report) again
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert len(manager.failed) == 1


def test_a_failed_launch_rank_after_a_scale_is_refused_with_the_reason(wired) -> None:
    manager, _ = wired(state([1, 0, 1, 0], effective=3), [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert "not the tail" in manager.failed[0]


def test_the_gather_keeps_its_width_only_when_world_lost_a_member(
    wired, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.layers import dp_attention

    wired(state([1, 1, 1, 0], effective=3), [0, 1, 0, 1, 0, 1])
    monkeypatch.setattr(dp_attention, "dp_gather_width", lambda: 3)

    def upstream(num_dp_ranks: int, **kwargs: object) -> int:
        raise RuntimeError("WORLD MLP sync EP size exceeds WORLD size")

    monkeypatch.setattr(tail_recovery.dist, "get_world_size", lambda group: 2)
    assert tail_recovery.world_gather_width(upstream, 3, group=object()) == 3
    monkeypatch.setattr(tail_recovery.dist, "get_world_size", lambda group: 3)
    with pytest.raises(RuntimeError, match="exceeds"):
        tail_recovery.world_gather_width(upstream, 3, group=object())


def test_the_size_to_return_to_is_kept_until_it_is_back() -> None:
    st = SimpleNamespace(pending_ep_size=None, effective_ep_size=2)
    recovery = tail_recovery.tail_recovery_state(st)
    assert tail_recovery.tail_recovery_state(st) is recovery
    recovery.return_to = 3
    tail_recovery.note_committed(st)
    assert recovery.return_to == 3  # still serving without the replacement
    st.effective_ep_size = 3
    tail_recovery.note_committed(st)
    assert recovery.return_to is None
    assert tail_recovery.tail_recovery_state(SimpleNamespace()).return_to is None

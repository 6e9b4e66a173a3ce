"""The EPLB rebalance wrapper: sizes recorded, and rebalancing after a settled scale-down."""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.sglang import eplb_log


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    found = SimpleNamespace(scale_phase="serving_contracted", pending_ep_size=None,
                            effective_ep_size=2)
    monkeypatch.setattr(eplb_log, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(eplb_log, "elastic_state", lambda: found)
    return found


def upstream(state: SimpleNamespace, installs: bool, seen: list[str]) -> Generator[None]:
    """Stands in for EPLBManager.rebalance: skips outside upstream's settled phases."""
    def rebalance(manager: object) -> Generator[None]:
        seen.append(state.scale_phase)
        if state.scale_phase not in ("serving_expanded", "failed"):
            return
        yield
        if installs:
            eplb_log.layout_log(state).updates += 1
    return rebalance


def test_a_settled_scale_down_rebalances_and_keeps_its_phase(state: SimpleNamespace) -> None:
    seen: list[str] = []
    list(eplb_log.rebalance_recorded(upstream(state, True, seen), object()))
    assert seen == ["serving_expanded"]
    assert state.scale_phase == "serving_contracted"
    assert eplb_log.layout_log(state).rebalances == [2]


def test_a_pending_scale_is_not_disguised(state: SimpleNamespace) -> None:
    state.pending_ep_size = 3
    seen: list[str] = []
    list(eplb_log.rebalance_recorded(upstream(state, True, seen), object()))
    assert seen == ["serving_contracted"]
    assert eplb_log.layout_log(state).rebalances == []


def test_a_rebalance_that_installs_nothing_is_not_recorded(state: SimpleNamespace) -> None:
    state.scale_phase = "serving_expanded"
    list(eplb_log.rebalance_recorded(upstream(state, False, []), object()))
    assert eplb_log.layout_log(state).rebalances == []

"""The EPLB rebalance wrapper: sizes recorded, and rebalancing after a settled scale-down."""

from __future__ import annotations

from collections.abc import Generator
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.core.agreement import GatheredRound, LockstepVerdict, Proposal, StepKind
from sglang_elastic_ep.sglang import eplb_log
from sglang_elastic_ep.sglang.pass_round import AgreedRound, gather_agreement


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


def agreed(state: SimpleNamespace, verdict: LockstepVerdict, *, taken: bool) -> None:
    """This pass's gathered round with ``verdict``; ``taken``: the membership step read it."""
    agreement = gather_agreement(state)
    kind, target = (StepKind.NONE, 0) if verdict is LockstepVerdict.NOTHING_PENDING \
        else (StepKind.GROW, 3)
    proposal = Proposal(rank=0, kind=kind, ready=0, target=target, serving=2)
    agreement.finish(AgreedRound(GatheredRound(verdict, (proposal,)), proposal))
    agreement.mark_iteration()
    if taken:
        agreement.take()


@pytest.mark.parametrize("taken", [False, True])
def test_a_pending_change_in_the_agreed_round_skips_the_rebalance_everywhere(
        state: SimpleNamespace, taken: bool) -> None:
    # Upstream on this rank has not disabled EPLB yet (it reads the request a pass later).
    state.scale_phase = "serving_expanded"
    agreed(state, LockstepVerdict.WAIT, taken=taken)
    seen: list[str] = []
    list(eplb_log.rebalance_recorded(upstream(state, True, seen), object()))
    assert seen == []
    assert eplb_log.layout_log(state).rebalances == []


def test_nothing_pending_in_the_agreed_round_lets_upstream_rebalance(
        state: SimpleNamespace) -> None:
    state.scale_phase = "serving_expanded"
    agreed(state, LockstepVerdict.NOTHING_PENDING, taken=False)
    seen: list[str] = []
    list(eplb_log.rebalance_recorded(upstream(state, True, seen), object()))
    assert seen == ["serving_expanded"]
    assert eplb_log.layout_log(state).rebalances == [2]


def test_an_iteration_without_a_gather_leaves_it_to_upstream(state: SimpleNamespace) -> None:
    state.scale_phase = "serving_expanded"
    agreed(state, LockstepVerdict.WAIT, taken=True)
    gather_agreement(state).mark_iteration()  # the next iteration gathered nothing
    assert gather_agreement(state).pass_verdict() is None
    seen: list[str] = []
    list(eplb_log.rebalance_recorded(upstream(state, True, seen), object()))
    assert seen == ["serving_expanded"]

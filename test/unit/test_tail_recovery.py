"""Decisions of the recovery of scale-joined ranks (sglang/tail_recovery.py), on fake state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.core.phases import IllegalTransition, Phase
from sglang_elastic_ep.core.tail_recovery_machine import (
    COHORT_CHECK_INTERVAL_S,
    ReplacementVerdict,
    TailRecoveryMachine,
)
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


def test_a_failed_launch_rank_after_a_scale_is_not_let_go_nor_failed(wired) -> None:
    # it rejoins in place (launch_recovery): no contraction, and the recovery is not failed
    manager, _ = wired(state([1, 0, 1, 0], effective=3), [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert manager.failed == []


def test_a_launch_rank_and_a_joiner_down_together_let_the_joiner_go_first(wired) -> None:
    # rank 0 alone holds every expert: the joined tail is let go (rank 1 rejoins in place after)
    manager, reports = wired(state([1, 0, 0, 0], effective=3), [0, 1, 0, 1, 0, 1])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 2
    assert manager.failed == [] and reports == []


def test_a_failed_joiner_below_a_live_one_is_neither_let_go_nor_failed(wired) -> None:
    """Launched at 2, grown to 4; node 1 and joiner 2 failed below the live joiner 3: no
    tail to let go, and no refusal either: both rejoin in place (launch_recovery)."""
    manager, reports = wired(state([1, 0, 0, 1], effective=4), [0, 1] * 4)
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert manager.failed == [] and reports == []


def test_a_refused_recovery_is_judged_again_once_the_failed_set_changes(wired) -> None:
    """Grown to 4, the joiners 2 and 3 alone hold experts 2 and 3: letting their failed tail go
    is refused, once for that set. When rank 1 fails too the set changes and is judged again."""
    manager, reports = wired(state([1, 1, 0, 0], effective=4), [0, 1, 0, 1, 2, 3, 2, 3])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    (reason,) = manager.failed
    assert "logical experts [2, 3]" in reason, reason
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert len(manager.failed) == 1 and len(reports) == 1  # the same set: not judged again
    for mask in (manager.state.active_ranks, manager.state.active_ranks_cpu):
        mask[1] = 0
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    assert len(manager.failed) == 2 and "ranks [1, 2, 3] failed" in manager.failed[1]


def test_experts_only_a_dead_launch_rank_held_fail_the_let_go_with_the_reason(wired) -> None:
    # rank 1 held experts 2 and 3 and rank 2 their only other replica: rank 0 cannot serve alone
    manager, _ = wired(state([1, 0, 0, 0], effective=3), [0, 1, 2, 3, 2, 3])
    assert tail_recovery.contraction_target(manager.state, wired.runner) == 0
    (reason,) = manager.failed
    assert "ranks [1, 2] failed and logical experts [2, 3]" in reason, reason
    assert "no replica on the live ranks [0]" in reason, reason


def test_the_replacement_of_a_let_go_tail_waits_while_a_launch_rank_is_failed(
        wired, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.elastic_ep import elastic_ep

    st = state([1, 0, 0, 0], effective=2)  # after the let-go of rank 2; rank 1 still down
    wired(st, [0, 1, 0, 1])
    machine = TailRecoveryMachine(first_failed=2, return_to=3, started_at=0.0)
    machine.let_go(0.0)
    tail_recovery.tail_recovery_state(st).machine = machine
    looked: list[int] = []
    monkeypatch.setattr(elastic_ep, "get_scale_cohort", lambda offset: looked.append(offset))
    tail_recovery.request_return_when_replacement_registered(st)
    assert looked == []  # no look for the replacement: rank 1 rejoins first
    st.active_ranks_cpu[1] = 1  # rank 1 is back
    st.active_ranks[1] = 1
    machine.next_check_at = 0.0
    tail_recovery.request_return_when_replacement_registered(st)
    assert looked == [2]  # now the replacement of slot 2 is looked for


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


def _awaiting(first: int = 2, size: int = 3) -> TailRecoveryMachine:
    machine = TailRecoveryMachine(first_failed=first, return_to=size, started_at=0.0)
    machine.let_go(0.0)
    return machine


def test_the_replacement_is_awaited_until_the_old_size_is_back() -> None:
    st = SimpleNamespace(pending_ep_size=None, effective_ep_size=2, last_error=None)
    recovery = tail_recovery.tail_recovery_state(st)
    assert tail_recovery.tail_recovery_state(st) is recovery
    assert not recovery.awaiting_replacement
    recovery.machine = _awaiting()
    tail_recovery.note_committed(st)
    assert recovery.awaiting_replacement  # still serving without the replacement
    recovery.machine.readmission_requested(1.0)
    st.pending_ep_size = 3
    tail_recovery.note_committed(st)  # upstream admits it over a few passes
    assert recovery.machine.phase is Phase.REJOINING
    st.pending_ep_size, st.effective_ep_size = None, 3
    tail_recovery.note_committed(st)
    assert recovery.machine.phase is Phase.SERVING_RECOVERED
    assert not recovery.awaiting_replacement
    assert not tail_recovery.tail_recovery_state(SimpleNamespace()).awaiting_replacement


def test_a_failed_readmission_waits_for_the_next_replacement() -> None:
    st = SimpleNamespace(pending_ep_size=None, effective_ep_size=2,
                         last_error="Timed out waiting for ranks to join target EP size 3")
    recovery = tail_recovery.tail_recovery_state(st)
    recovery.machine = _awaiting()
    recovery.machine.readmission_requested(1.0)
    tail_recovery.note_committed(st)  # upstream's scale timeout failed the scale-up
    assert recovery.machine.phase is Phase.AWAITING_REPLACEMENT
    assert recovery.machine.check_due(100.0)  # and it looks again


def test_the_machine_looks_for_the_replacement_at_most_every_interval() -> None:
    machine = _awaiting()
    assert machine.check_due(10.0)
    assert not machine.check_due(10.0 + COHORT_CHECK_INTERVAL_S / 2)
    assert machine.check_due(10.0 + COHORT_CHECK_INTERVAL_S)
    machine.readmission_requested(11.0)
    assert not machine.check_due(99.0)  # asked already: upstream's scale-up runs


def test_only_a_new_process_registered_within_the_failed_slots_is_readmitted() -> None:
    machine = _awaiting(first=2, size=4)
    assert machine.failed_slots == range(2, 4)
    assert machine.replacement_verdict(None, peers_joined=True) is ReplacementVerdict.NOT_YET
    # The dead joiner's registration is still in the store: no new process in its slots yet.
    assert machine.replacement_verdict(4, peers_joined=False) is ReplacementVerdict.NOT_YET
    assert machine.replacement_verdict(4, peers_joined=True) is ReplacementVerdict.READMIT
    # a replacement of rank 2 alone (one server per rank): its slots come back first
    assert machine.replacement_verdict(3, peers_joined=True) is ReplacementVerdict.READMIT
    for beyond in (2, 5):
        assert machine.replacement_verdict(beyond, True) is ReplacementVerdict.WRONG_SIZE
    assert "--elastic-ep-join-rank-offset 2 (one server for them all, or one per rank)" \
        in machine.wrong_size_message(5)


def test_a_tail_relaunched_one_rank_at_a_time_comes_back_from_the_lowest_slot_up() -> None:
    """Joiners 2 and 3 were let go together (back to 4); each is relaunched on its own."""
    st = SimpleNamespace(pending_ep_size=None, effective_ep_size=2, last_error=None)
    recovery = tail_recovery.tail_recovery_state(st)
    recovery.machine = machine = _awaiting(first=2, size=4)
    machine.readmission_requested(1.0, target=3)  # rank 2's replacement registered for 3
    st.effective_ep_size = 3
    tail_recovery.note_committed(st)
    assert machine.phase is Phase.AWAITING_REPLACEMENT and machine.partly_back == range(2, 3)
    assert machine.failed_slots == range(3, 4) and recovery.awaiting_replacement
    assert machine.replacement_verdict(3, peers_joined=True) is ReplacementVerdict.WRONG_SIZE
    machine.readmission_requested(2.0, target=4)  # then rank 3's, registered for 4
    st.effective_ep_size = 4
    tail_recovery.note_committed(st)
    assert machine.phase is Phase.SERVING_RECOVERED and machine.partly_back is None


def test_a_failed_partial_readmission_keeps_awaiting_the_same_slots() -> None:
    machine = _awaiting(first=2, size=4)
    machine.readmission_requested(1.0, target=3)
    assert machine.observe(2, scale_pending=False, now=2.0) is Phase.AWAITING_REPLACEMENT
    assert machine.partly_back is None and machine.failed_slots == range(2, 4)


def test_removing_the_failed_slots_ends_the_wait_and_nothing_else_does() -> None:
    machine = _awaiting()
    machine.removed(5.0)
    assert machine.phase is Phase.SERVING_CONTRACTED and not machine.awaiting_replacement
    with pytest.raises(IllegalTransition):
        machine.readmission_requested(6.0)
    with pytest.raises(ValueError, match="first failed slot"):
        TailRecoveryMachine(first_failed=3, return_to=3, started_at=0.0)
    fresh = TailRecoveryMachine(first_failed=2, return_to=3, started_at=0.0)
    assert fresh.phase is Phase.SERVING_DEGRADED
    with pytest.raises(IllegalTransition):
        fresh.removed(1.0)  # not let go of yet: the slots are still in the layout

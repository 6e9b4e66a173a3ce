"""Scheduler-side scale-down decisions that need no cluster: who is ready, and when a shrink
is refused. (The idle step's place in the loop: test_scale_progress.py.)"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.core.agreement import (
    AbortReason,
    GatheredRound,
    LockstepVerdict,
    Proposal,
    StepKind,
    verdict_from_proposals,
)
from sglang_elastic_ep.core.phases import IllegalTransition, Phase
from sglang_elastic_ep.core.scale_down_machine import ScaleDownMachine
from sglang_elastic_ep.sglang import scale_down
from sglang_elastic_ep.sglang.scale_down import (
    ScaleDownState,
    holds_no_request,
    is_shrink,
    scale_down_state,
)


class Batch:
    def __init__(self, size: int) -> None:
        self.size = size

    def is_empty(self) -> bool:
        return self.size == 0


def scheduler(running: int = 0, waiting: int = 0, chunked: object = None) -> SimpleNamespace:
    return SimpleNamespace(running_batch=Batch(running), waiting_queue=[object()] * waiting,
                           chunked_req=chunked)


def test_a_scheduler_holds_no_request_only_when_nothing_runs_waits_or_is_chunked() -> None:
    assert holds_no_request(scheduler())
    assert not holds_no_request(scheduler(running=1))
    assert not holds_no_request(scheduler(waiting=2))
    assert not holds_no_request(scheduler(chunked=object()))


def draining(rank: int, old: int = 3, new: int = 2) -> ScaleDownState:
    return ScaleDownState(machine=ScaleDownMachine(rank=rank, old_size=old, new_size=new,
                                                   started_at=0.0))


def test_staying_ranks_are_ready_at_once_leaving_ones_after_a_confirmed_drain() -> None:
    state = SimpleNamespace(pending_ep_size=2, effective_ep_size=3)
    assert is_shrink(state)
    assert draining(0).ready_to_shrink(state, rank=0) == 2
    assert draining(1).ready_to_shrink(state, rank=1) == 2
    # Leaving rank 2: empty scheduler, but the HTTP process has not confirmed the drain (a
    # request it routed there may still be on its way).
    down = draining(2)
    down.scheduler = scheduler()
    assert down.ready_to_shrink(state, rank=2) == 0
    down.machine.confirm_drain()
    assert down.ready_to_shrink(state, rank=2) == 2
    down.scheduler = scheduler(running=1)
    assert down.ready_to_shrink(state, rank=2) == 0  # confirmed, but still finishing one
    # Asked before the pass's batch became the scheduler's running batch: that batch counts.
    down.scheduler = scheduler()
    assert down.ready_to_shrink(state, rank=2, batch_idle=False) == 0
    assert draining(0).ready_to_shrink(state, rank=0, batch_idle=False) == 2  # staying: at once
    # A machine for another target (an earlier request) makes no rank ready for this one.
    assert draining(0, new=1).ready_to_shrink(state, rank=0) == 0


def test_no_shrink_pending_means_nothing_to_be_ready_for() -> None:
    assert not is_shrink(SimpleNamespace(pending_ep_size=None, effective_ep_size=3))
    assert not is_shrink(SimpleNamespace(pending_ep_size=4, effective_ep_size=3))  # a scale-up
    idle = SimpleNamespace(pending_ep_size=None, effective_ep_size=3)
    assert ScaleDownState().ready_to_shrink(idle, 2) == 0


def test_one_scale_down_state_per_elastic_ep_state() -> None:
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=3)
    down = scale_down_state(state)
    assert scale_down_state(state) is down
    assert scale_down_state(SimpleNamespace()) is not down


def test_a_server_ends_only_when_every_one_of_its_ranks_leaves() -> None:
    from sglang_elastic_ep.sglang.tail_release import first_rank_of_server

    # A joiner at offset 2 (ranks 2..): its own server.
    assert first_rank_of_server(is_joiner=True, join_offset=2, node_rank=0, ranks_per_node=1) == 2
    # Node 1 of a 2-node launch with 2 ranks per node serves ranks 2 and 3.
    assert first_rank_of_server(is_joiner=False, join_offset=0, node_rank=1, ranks_per_node=2) == 2
    # Node 0 always holds rank 0, which never leaves.
    assert first_rank_of_server(is_joiner=False, join_offset=0, node_rank=0, ranks_per_node=2) == 0


def test_a_drain_confirmation_read_after_the_commit_is_recognised() -> None:
    committed = SimpleNamespace(pending_ep_size=None, effective_ep_size=2)
    down = draining(0)
    assert not down.is_late_drain_confirmation(committed, 2)  # still draining
    for phase in (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING,
                  Phase.SERVING_CONTRACTED):
        down.enter_phase(committed, phase)
    assert committed.scale_phase == "serving_contracted"
    assert down.is_late_drain_confirmation(committed, 2)
    assert not down.is_late_drain_confirmation(committed, 1)  # a new request: not late
    pending = SimpleNamespace(pending_ep_size=2, effective_ep_size=3)
    assert not down.is_late_drain_confirmation(pending, 2)  # the state shows no commit
    assert not ScaleDownState().is_late_drain_confirmation(committed, 2)  # no scale-down ran


def test_the_release_writes_the_phase_its_machine_is_in_and_refuses_a_skipped_step() -> None:
    state = SimpleNamespace(pending_ep_size=2, effective_ep_size=3, scale_phase="draining")
    down = draining(2)
    down.enter_phase(state, Phase.MOVING_EXPERTS)
    assert state.scale_phase == "moving_experts"
    with pytest.raises(IllegalTransition):
        down.enter_phase(state, Phase.RELEASED)  # switching placement and releasing skipped
    assert state.scale_phase == "moving_experts"
    down.enter_phase(state, Phase.SWITCHING_PLACEMENT)
    down.enter_phase(state, Phase.RELEASING)
    down.enter_phase(state, Phase.RELEASED)
    assert state.scale_phase == "released" and down.machine.done
    with pytest.raises(RuntimeError, match="without its machine"):
        ScaleDownState().enter_phase(state, Phase.RELEASING)


def test_a_shrink_below_two_attention_dp_ranks_is_refused() -> None:
    message = scale_down.too_few_dp_ranks(True, 1, 1)
    assert message is not None and "keep at least 2 ranks" in message
    assert scale_down.too_few_dp_ranks(True, 2, 1) is None
    assert scale_down.too_few_dp_ranks(True, 2, 2) is not None  # one replica of two ranks
    assert scale_down.too_few_dp_ranks(False, 1, 1) is None  # no attention DP: no such limit


def test_a_shrink_is_refused_where_no_per_pass_agreement_can_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sglang.srt.runtime_context as runtime_context

    def refusal(state: SimpleNamespace, **parallel: object) -> str | None:
        monkeypatch.setattr(runtime_context, "get_parallel",
                            lambda: SimpleNamespace(tp_size=2, **parallel))
        return scale_down.refusal(state, 2)

    on_device = SimpleNamespace(active_ranks=torch.ones(4, device="meta"), effective_ep_size=3)
    assert "room to grow" in refusal(on_device, max_ep_size=None, attn_dp_enabled=True)
    monkeypatch.setattr(scale_down, "too_few_dp_ranks", lambda *a: "past the agreement checks")
    monkeypatch.setattr(scale_down, "state_manager", lambda: None)
    import sglang.srt.elastic_ep.topology as topology

    monkeypatch.setattr(topology, "attn_replica_size", lambda: 1)
    # With room to grow the agreement runs on every device, with or without the DP gather
    # (passes without one agree over WORLD's host group): nothing refused for the device.
    for attn_dp in (True, False):
        assert refusal(on_device, max_ep_size=4, attn_dp_enabled=attn_dp) == \
            "past the agreement checks"


class Runner:
    """The model runner's calls a call-off makes, recorded."""

    def __init__(self) -> None:
        self.eplb_manager = object()
        self.calls: list[tuple] = []

    def _reset_eplb_after_elastic_scale_failure(self) -> None:
        self.calls.append(("eplb re-armed",))

    def _report_elastic_scale_failure(self, error: str, effective_size: int) -> None:
        self.calls.append(("reported", error, effective_size))


def called_off_round(target: int, reason: AbortReason) -> GatheredRound:
    rows = [Proposal(rank=r, kind=StepKind.SHRINK, ready=0, target=target, serving=3,
                     abort=reason if r == 1 else AbortReason.NONE) for r in range(3)]
    return verdict_from_proposals(rows)


def test_a_called_off_scale_down_serves_on_at_the_old_size_with_the_failed_rank_left_failed(
) -> None:
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.int32)  # staying rank 1 failed
    state = SimpleNamespace(pending_ep_size=2, effective_ep_size=3, scale_phase="draining",
                            last_error=None, pending_since=5.0, active_ranks_cpu=mask)
    down = scale_down_state(state)
    down.machine = ScaleDownMachine(rank=0, old_size=3, new_size=2, started_at=0.0)
    runner = Runner()
    verdict = called_off_round(2, AbortReason.RANK_FAILED)
    assert verdict.verdict is LockstepVerdict.ABORT
    scale_down.call_off_scale_down(runner, state, verdict)
    assert state.pending_ep_size is None and state.scale_phase == "failed"
    assert "a staying rank failed" in state.last_error
    assert mask.tolist() == [1, 0, 1, 0]  # not reset: rank 1 stays failed for its recovery
    assert runner.calls == [("eplb re-armed",), ("reported", state.last_error, 3)]


def test_a_rank_that_reads_the_request_after_the_call_off_refuses_it_once() -> None:
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=3, scale_phase="idle",
                            last_error=None)
    runner = Runner()
    scale_down.call_off_scale_down(runner, state, called_off_round(2, AbortReason.TIMED_OUT))
    assert runner.calls == [] and state.scale_phase == "idle"  # nothing of its own to drop
    down = scale_down_state(state)
    # another size: a request of its own
    assert down.take_called_off(state, StepKind.SHRINK, 1) is None
    scale_down.call_off_scale_down(runner, state, called_off_round(2, AbortReason.TIMED_OUT))
    message = down.take_called_off(state, StepKind.SHRINK, 2)
    assert message is not None and "called off" in message and "timed out" in message
    # a later request for 2 is a new one
    assert down.take_called_off(state, StepKind.SHRINK, 2) is None


def test_a_shrink_past_every_failed_rank_is_no_recovery_in_progress() -> None:
    """Upstream counts a failed rank inside the size as a recovery in progress; a shrink whose
    leaving ranks hold every failed rank removes them instead (joiner 2 failed below the live
    joiner 3, awaited in place: new_ep_size 2 removes both)."""
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=4, active_ranks=mask.clone(),
                            active_ranks_cpu=mask.clone())
    assert scale_down.removes_every_failed_rank(state, 2)
    assert not scale_down.removes_every_failed_rank(state, 3)  # rank 2 would stay, failed
    state.active_ranks_cpu[1] = 0  # a launch-time rank failed too: it would stay
    assert not scale_down.removes_every_failed_rank(state, 2)
    healthy = SimpleNamespace(pending_ep_size=None, effective_ep_size=4,
                              active_ranks=torch.ones(4, dtype=torch.int32),
                              active_ranks_cpu=torch.ones(4, dtype=torch.int32))
    assert not scale_down.removes_every_failed_rank(healthy, 2)  # nothing failed to remove


class _FakeMooncakePg(ModuleType):
    """``mooncake.pg`` whose proposal fails as the coordinator's RPC timing out does."""

    def __init__(self, fail: bool) -> None:
        super().__init__("mooncake.pg")
        self.fail = fail
        self.proposed: list[tuple[object, list[int]]] = []

    def deactivate_ranks(self, group: object, ranks: list[int]) -> object:
        self.proposed.append((group, ranks))
        if self.fail:
            raise RuntimeError("mooncakePgCommDeactivateRanks failed: RPC error: "
                               "proposeViewUpdate RPC failed: time out")
        return SimpleNamespace(status="Applied", new_epoch=11)


@pytest.fixture
def mooncake_pg(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], _FakeMooncakePg]:
    def install(fail: bool) -> _FakeMooncakePg:
        module = _FakeMooncakePg(fail)
        monkeypatch.setitem(sys.modules, "mooncake", ModuleType("mooncake"))
        monkeypatch.setitem(sys.modules, "mooncake.pg", module)
        return module
    return install


def test_a_leaving_rank_whose_own_proposal_fails_still_leaves(
        mooncake_pg: Callable[[bool], _FakeMooncakePg], caplog: pytest.LogCaptureFixture) -> None:
    from sglang_elastic_ep.sglang.tail_release import propose_deactivation

    pg = mooncake_pg(True)
    assert propose_deactivation("WORLD", [2], leaving=True) is None
    assert pg.proposed == [("WORLD", [2])]
    assert "leaves although its own Mooncake proposal to deactivate [2] failed" in caplog.text


def test_a_staying_rank_whose_proposal_fails_raises(
        mooncake_pg: Callable[[bool], _FakeMooncakePg]) -> None:
    from sglang_elastic_ep.sglang.tail_release import propose_deactivation

    mooncake_pg(True)
    with pytest.raises(RuntimeError, match="proposeViewUpdate"):
        propose_deactivation("WORLD", [2], leaving=False)


def test_an_applied_proposal_is_answered_on_every_rank(
        mooncake_pg: Callable[[bool], _FakeMooncakePg]) -> None:
    from sglang_elastic_ep.sglang.tail_release import propose_deactivation

    mooncake_pg(False)
    for leaving in (True, False):
        answer = propose_deactivation("WORLD", [2], leaving=leaving)
        assert (answer.status, answer.new_epoch) == ("Applied", 11)

"""The membership agreement carried in upstream's DP gather (sglang/gather_agreement.py), on
tensors shaped and placed as ``MLPSyncBatchInfo.all_gather`` makes them, without SGLang."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dp_gather_rows import UPSTREAM_WIDTH, Info, upstream_fallback, upstream_row

from sglang_elastic_ep.core.agreement import (
    PROPOSAL_COLUMNS,
    AbortReason,
    LockstepVerdict,
    Proposal,
    StepKind,
    gathered_round,
    pack_row,
)
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_down_machine import ScaleDownMachine
from sglang_elastic_ep.sglang import expert_health, gather_agreement, launch_recovery, tail_recovery
from sglang_elastic_ep.sglang.gather_agreement import GatherAgreement
from sglang_elastic_ep.sglang.gather_agreement import gather_agreement as ga_of
from sglang_elastic_ep.sglang.gather_repair import row_check

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="torch.cuda.is_available() is False: no GPU here, the cuda case is not run")),
]


def info(num_dp_ranks: int, tp_size: int = 1, num_tokens: int = 0) -> Info:
    return Info(num_dp_ranks=num_dp_ranks, tp_size=tp_size, cp_size=1, num_tokens=num_tokens,
                tp0_info_cpu=None)


def all_reduce_gather(rows: dict[int, torch.Tensor], fallback: torch.Tensor, sync: Info,
                      active: list[int]) -> None:
    """Upstream's ``use_all_reduce`` path on one machine: each rank writes only its own slot of a
    zeroed buffer and the SUM all-reduce adds them; slots no rank wrote and inactive ranks' slots
    get the fallback row; one host copy of the whole buffer, viewed at attention-TP rank 0."""
    width = fallback.numel()
    buffer = fallback.repeat(sync.num_dp_ranks, sync.tp_size * sync.cp_size, 1)
    buffer.zero_()
    flat = buffer.view(-1, width)
    for rank, row in rows.items():
        flat[rank] += row
    flat[flat.abs().sum(dim=1) == 0] = fallback
    mask = torch.tensor(active, device=fallback.device)
    flat[mask[: flat.shape[0]] == 0] = fallback
    sync.tp0_info_cpu = buffer.cpu()[:, 0, :]


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], list[SimpleNamespace]]:
    """Per-rank fake ``ElasticEPState``s in one process; ``elastic_state()`` answers for the
    rank set in ``current``."""
    current = {"rank": 0}
    states: list[SimpleNamespace] = []

    def make(n: int) -> list[SimpleNamespace]:
        states[:] = [SimpleNamespace(active_ranks=torch.ones(n, dtype=torch.int32))
                     for _ in range(n)]
        return states

    monkeypatch.setattr(gather_agreement, "elastic_state", lambda: states[current["rank"]])
    make.current = current
    return make


def build_row(ranks: Any, rank: int, proposal: Proposal, device: str, timings: list[int],
              num_dp_ranks: int) -> tuple[torch.Tensor, torch.Tensor, GatherAgreement]:
    """Rank ``rank`` builds its row and the fallback row through the hooks."""
    ranks.current["rank"] = rank
    agreement = ga_of(gather_agreement.elastic_state())
    agreement.outgoing = pack_row(proposal, timings)
    sync = info(num_dp_ranks)
    row = sync._get_local_tensor(device=device)
    fallback = sync._get_fallback_tensor(device=device)
    agreement.outgoing = None
    return row, fallback, agreement


@pytest.mark.parametrize("device", DEVICES)
def test_the_columns_ride_in_the_row_and_come_back_from_the_host_copy(ranks: Any,
                                                                      device: str) -> None:
    ranks(3)
    proposals = [Proposal(rank=r, kind=StepKind.GROW, ready=3, target=3, serving=2)
                 for r in range(2)]
    rows, fallback = {}, None
    for rank, proposal in enumerate(proposals):
        row, fallback, agreement = build_row(ranks, rank, proposal, device, [rank + 10, 7], 3)
        assert row.device.type == device and agreement.upstream_width == UPSTREAM_WIDTH
        rows[rank] = row
    assert fallback is not None and not fallback[UPSTREAM_WIDTH:].any()
    sync = info(3)
    all_reduce_gather(rows, fallback, sync, active=[1, 1, 1])
    assert sync.tp0_info_cpu[:, 0].tolist() == [0, 0, 0]  # upstream's own columns unchanged
    columns = gather_agreement.gathered_columns(sync, UPSTREAM_WIDTH, PROPOSAL_COLUMNS + 2)
    assert columns[2] == [0] * (PROPOSAL_COLUMNS + 2)  # slot 2: nobody wrote it
    assert columns[0] == pack_row(proposals[0], [10, 7])
    assert gathered_round(columns).verdict is LockstepVerdict.ENTER


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_every_attention_tp_rank_are_read_not_only_tp0(ranks: Any, device: str) -> None:
    ranks(4)
    sync = info(2, tp_size=2)  # 2 DP ranks x 2 attention-TP ranks: 4 rows, tp0 view shows 2
    rows, fallback = {}, None
    for rank in range(4):
        ready = 0 if rank == 3 else 4  # the attention-TP rank 1 of DP rank 1 is not ready
        proposal = Proposal(rank=rank, kind=StepKind.GROW, ready=ready, target=4, serving=4)
        rows[rank], fallback, _ = build_row(ranks, rank, proposal, device, [], 2)
    all_reduce_gather(rows, fallback, sync, active=[1, 1, 1, 1])
    columns = gather_agreement.gathered_columns(sync, UPSTREAM_WIDTH, PROPOSAL_COLUMNS)
    assert [c[0] for c in columns] == [1, 2, 3, 4]
    assert gathered_round(columns).verdict is LockstepVerdict.WAIT


def verdicts_over_passes(ranks: Any, device: str) -> list[LockstepVerdict]:
    """Three ranks; rank 1 sees a scale-up two passes late, rank 2 dies at pass 6 (its slot is
    masked inactive) and the survivors let it go. One verdict per pass, checked equal on all."""
    ranks(3)
    out = []
    for p in range(9):
        rows, fallback = {}, None
        active = [1, 1, 0] if p >= 6 else [1, 1, 1]
        for rank in range(3):
            if p >= 6:
                if rank == 2:
                    continue  # dead: writes nothing
                proposal = Proposal(rank=rank, kind=StepKind.LET_GO, ready=2, target=2,
                                    serving=3)
            elif p >= (4 if rank == 1 else 2):
                proposal = Proposal(rank=rank, kind=StepKind.GROW, ready=4, target=4, serving=3)
            else:
                proposal = Proposal(rank=rank, kind=StepKind.NONE, ready=0, target=0, serving=3)
            rows[rank], fallback, _ = build_row(ranks, rank, proposal, device, [p, rank], 3)
        seen = []
        for _reader in range(3):  # every rank reads the same gathered rows
            sync = info(3)
            all_reduce_gather(rows, fallback, sync, active)
            columns = gather_agreement.gathered_columns(sync, UPSTREAM_WIDTH,
                                                        PROPOSAL_COLUMNS + 2)
            seen.append(gathered_round(columns).verdict)
        assert len(set(seen)) == 1
        out.append(seen[0])
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_the_same_verdicts_come_out_on_every_device(ranks: Any, device: str) -> None:
    N, W, E = LockstepVerdict.NOTHING_PENDING, LockstepVerdict.WAIT, LockstepVerdict.ENTER
    expected = [N, N, W, W, E, E, E, E, E]
    assert verdicts_over_passes(ranks, device) == expected
    if device != "cpu":
        assert verdicts_over_passes(ranks, "cpu") == expected


def test_rows_pass_through_unchanged_outside_the_agreements_gather(ranks: Any) -> None:
    ranks(2)
    sync = info(2, num_tokens=5)
    assert sync._get_local_tensor(device="cpu").tolist() == upstream_row(sync, "cpu").tolist()
    ga_of(gather_agreement.elastic_state())  # exists, but no gather in progress
    assert sync._get_fallback_tensor(device="cpu").numel() == UPSTREAM_WIDTH


def test_a_layout_the_reader_does_not_know_fails_loudly(ranks: Any) -> None:
    sync = info(2)
    sync.tp0_info_cpu = torch.zeros(2, UPSTREAM_WIDTH + 3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="unexpected gathered rows"):
        gather_agreement.gathered_columns(sync, UPSTREAM_WIDTH, PROPOSAL_COLUMNS)


# ------------------------------------------------------- the gather hook and the state machine


def test_the_gather_hook_leaves_a_round_for_this_pass_and_the_timings(
    ranks: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = ranks(2)
    mine = Proposal(rank=0, kind=StepKind.GROW, ready=3, target=3, serving=2)
    peer = Proposal(rank=1, kind=StepKind.GROW, ready=3, target=3, serving=2)
    monkeypatch.setattr(gather_agreement, "propose", lambda state, runner, batch_idle: mine)
    monkeypatch.setattr(gather_agreement, "_slots_per_rank", lambda: 1)
    monkeypatch.setattr(expert_health, "own_timings", lambda slots: [100, 4])
    monkeypatch.setattr(expert_health, "expert_location_metadata",
                        lambda: SimpleNamespace(num_local_physical_experts=1))
    monkeypatch.setattr(tail_recovery, "state_manager",
                        lambda: SimpleNamespace(instance=lambda: None))

    def upstream_all_gather(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        row = sync._get_local_tensor(device=device)
        fallback = sync._get_fallback_tensor(device=device)
        values = upstream_fallback(sync, device).tolist() + pack_row(peer, [200, 6])
        peer_row = torch.tensor([*values, row_check(values)])
        all_reduce_gather({0: row, 1: peer_row}, fallback, sync, active=[1, 1])

    agreement = ga_of(states[0])
    agreement.runner = object()
    sync = info(2)
    gather_agreement.gather_with_agreement(upstream_all_gather, sync, "cpu", None, True)
    assert agreement.outgoing is None
    assert agreement.fresh is not None and agreement.fresh.verdict is LockstepVerdict.ENTER
    assert agreement.fresh.proposal == mine
    health = expert_health.expert_health_state(states[0])
    assert health.gathered == (1, [100, 200, 4, 6])
    # Without a bracketed pass (no runner) the hook is upstream's gather, rows unchanged.
    agreement.runner, agreement.fresh = None, None
    widths: list[int] = []

    def plain_all_gather(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        widths.append(sync._get_local_tensor(device=device).numel())

    gather_agreement.gather_with_agreement(plain_all_gather, info(2), "cpu", None, False)
    assert widths == [UPSTREAM_WIDTH] and agreement.fresh is None


def test_a_rank_mooncake_deactivated_says_so_and_the_error_goes_on(
    ranks: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ranks(2)
    monkeypatch.setattr(tail_recovery, "state_manager",
                        lambda: SimpleNamespace(instance=lambda: None))
    monkeypatch.setattr(gather_agreement.dist, "get_rank", lambda: 2)

    def evicted(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        raise RuntimeError("mooncakePgBroadcast failed: invalid state: rank is not active in "
                           "this group")

    with pytest.raises(RuntimeError, match="rank is not active in this group"):
        gather_agreement.gather_with_agreement(evicted, info(2), "cpu", None, False)
    said = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(said) == 1 and "rank 2: Mooncake deactivated this rank" in said[0], said
    assert "--ep-join-mode recover" in said[0]

    def other_error(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        raise RuntimeError("mooncakePgBroadcast failed: timeout")

    caplog.clear()
    with pytest.raises(RuntimeError, match="timeout"):
        gather_agreement.gather_with_agreement(other_error, info(2), "cpu", None, False)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_one_round_per_pass_a_second_step_repeats_it_and_old_rounds_expire() -> None:
    agreement = GatherAgreement()
    enter = gather_agreement.AgreedRound(
        gathered_round([pack_row(Proposal(0, StepKind.GROW, 3, 3, 2))]),
        Proposal(0, StepKind.GROW, 3, 3, 2))
    agreement.finish(enter)
    assert agreement.mark_iteration() is True
    assert agreement.take() is enter
    assert agreement.take() is None and agreement.repeat_verdict() is LockstepVerdict.ENTER
    assert agreement.mark_iteration() is False  # an iteration without a gather
    assert agreement.repeat_verdict() is None
    agreement.finish(enter)
    agreement.gathered_since_mark = False  # as if produced in an earlier iteration
    agreement.mark_iteration()
    assert agreement.take() is None  # not acted on in an iteration that did not gather it


def test_a_problem_in_the_rows_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    agreement = GatherAgreement()
    split = gathered_round([pack_row(Proposal(0, StepKind.GROW, 3, 3, 2)),
                            pack_row(Proposal(1, StepKind.GROW, 3, 3, 4))])
    for _ in range(3):
        agreement.finish(gather_agreement.AgreedRound(split, split.proposals[0]))
    assert [r.getMessage() for r in caplog.records].count(
        f"[elastic-ep] membership agreement: {split.problem}; waiting") == 1


def test_the_pass_bracket_hands_runner_and_batch_to_the_gather(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sglang.srt.runtime_context as runtime_context

    state = SimpleNamespace(active_ranks=torch.ones(2, dtype=torch.int32))
    monkeypatch.setattr(gather_agreement, "elastic_state", lambda: state)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: object())
    seen: list[tuple[Any, bool]] = []

    def upstream(local_batch: Any, **kwargs: Any) -> str:
        agreement = ga_of(state)
        seen.append((agreement.runner, agreement.batch_idle))
        return "batch"

    runner = object()
    monkeypatch.setattr(gather_agreement, "lockstep_agreement_on", lambda s, p: True)
    busy = SimpleNamespace(reqs=[object()])
    assert gather_agreement.bracket_mlp_sync(upstream, busy, model_runner=runner) == "batch"
    gather_agreement.bracket_mlp_sync(upstream, None, model_runner=runner)
    assert seen == [(runner, False), (runner, True)]
    assert ga_of(state).runner is None
    monkeypatch.setattr(gather_agreement, "lockstep_agreement_on", lambda s, p: False)
    gather_agreement.bracket_mlp_sync(upstream, None, model_runner=runner)
    assert seen[-1] == (None, True)


# ------------------------------------------------------------------------ this rank's inputs


@pytest.fixture
def proposing(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    runner = SimpleNamespace(_elastic_global_rank=lambda: 2)
    runner._elastic_ep_readiness_skew = gather_agreement.ReadinessSkew(None, rank=2)
    monkeypatch.setattr(tail_recovery, "request_return_when_replacement_registered",
                        lambda state: None)
    monkeypatch.setattr(tail_recovery, "contraction_target", lambda state, runner: 0)
    monkeypatch.setattr(gather_agreement, "_ready_target", lambda state, target: target)
    return runner


def test_each_change_is_proposed_as_its_step(proposing: SimpleNamespace,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep.sglang.scale_down import scale_down_state

    def state(pending: int | None) -> SimpleNamespace:
        mask = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
        return SimpleNamespace(pending_ep_size=pending, effective_ep_size=3, has_scaled=True,
                               original_ep_size=2, active_ranks=mask.clone(),
                               active_ranks_cpu=mask,
                               scale_phase="idle" if pending is None else "waiting_for_cohort")

    propose = gather_agreement.propose
    assert propose(state(None), proposing, batch_idle=True) == Proposal(2, StepKind.NONE, 0, 0, 3)
    assert propose(state(4), proposing, batch_idle=False) == Proposal(2, StepKind.GROW, 4, 4, 3)
    shrink = state(2)
    down = scale_down_state(shrink)
    down.machine = ScaleDownMachine(rank=2, old_size=3, new_size=2, started_at=time.monotonic(),
                                    timeout_s=60)
    down.machine.confirm_drain()
    down.scheduler = SimpleNamespace(running_batch=None, waiting_queue=[], chunked_req=None)
    # Rank 2 leaves: ready only when the batch it runs this pass holds no request either.
    assert propose(shrink, proposing, batch_idle=False).ready == 0
    assert propose(shrink, proposing, batch_idle=True) == Proposal(2, StepKind.SHRINK, 2, 2, 3)
    # Staying rank 1 failed (the mask's host copy): this rank calls the scale-down off.
    shrink.active_ranks_cpu[1] = 0
    assert propose(shrink, proposing, batch_idle=True) == Proposal(
        2, StepKind.SHRINK, 0, 2, 3, abort=AbortReason.RANK_FAILED)
    shrink.active_ranks_cpu[1] = 1
    down.machine.started_at -= 61  # the drain outlasted the scale timeout
    assert propose(shrink, proposing, batch_idle=True).abort is AbortReason.TIMED_OUT
    monkeypatch.setattr(tail_recovery, "contraction_target", lambda state, runner: 2)
    assert propose(state(None), proposing, batch_idle=False) == Proposal(
        2, StepKind.LET_GO, 2, 2, 3)
    # Launch-time rank 1 failed after the scale: wait for its replacement in WORLD, then take
    # it back at the size served now (no let-go, whatever contraction_target would say).
    registered: list[tuple[int, ...]] = []
    monkeypatch.setattr(launch_recovery, "replacements_registered",
                        lambda state, ranks: registered.append(ranks) or len(registered) > 1)
    lost = state(None)
    lost.active_ranks_cpu[1] = 0
    assert propose(lost, proposing, batch_idle=True) == Proposal(2, StepKind.RECOVER, 0, 3, 3)
    assert propose(lost, proposing, batch_idle=True) == Proposal(2, StepKind.RECOVER, 3, 3, 3)
    assert registered == [(1,), (1,)]


def test_readiness_skew_holds_back_only_the_named_rank_for_its_passes() -> None:
    from sglang_elastic_ep.sglang.gather_agreement import ReadinessSkew

    late = ReadinessSkew("1:3", rank=1)
    assert [late.apply(3) for _ in range(5)] == [0, 0, 0, 3, 3]
    assert late.apply(0) == 0  # nothing to be ready for
    assert [late.apply(4) for _ in range(4)] == [0, 0, 0, 4]  # a new target is late again
    on_time = ReadinessSkew("1:3", rank=0)
    assert on_time.apply(3) == 3
    assert ReadinessSkew(None, rank=1).apply(3) == 3


def test_readiness_skew_reads_the_environment_once_and_lives_on_the_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gather_agreement.dist, "get_rank", lambda: 1)
    monkeypatch.setenv(gather_agreement.ENV_TEST_SKEW, "1:2")
    runner = SimpleNamespace()
    skew = gather_agreement.readiness_skew(runner)
    assert skew.passes == 2
    monkeypatch.delenv(gather_agreement.ENV_TEST_SKEW)  # later passes never read it again
    assert gather_agreement.readiness_skew(runner) is skew
    assert gather_agreement.readiness_skew(SimpleNamespace()).passes == 0  # another process


def test_a_removal_below_the_tail_is_proposed_by_its_ranks_before_any_other_step(
        proposing: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep.sglang.scale_down import scale_down_state

    mask = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=3, has_scaled=True,
                            original_ep_size=3, active_ranks=mask.clone(),
                            active_ranks_cpu=mask.clone(), scale_phase="draining")
    down = scale_down_state(state)
    propose = gather_agreement.propose
    # Rank 2 (this one) stays while rank 1 is removed: ready at once, whatever it runs.
    down.machine = ScaleDownMachine(rank=2, old_size=3, new_size=3, removed=(1,),
                                    started_at=time.monotonic(), timeout_s=60)
    assert propose(state, proposing, batch_idle=False) == Proposal(2, StepKind.REMOVE, 2, 2, 3)
    # A let-go would otherwise be proposed: the pending removal goes first.
    monkeypatch.setattr(tail_recovery, "contraction_target", lambda state, runner: 2)
    assert propose(state, proposing, batch_idle=True).kind is StepKind.REMOVE
    # Staying rank 0 failed: this rank calls the removal off (rank 1's failure would not).
    state.active_ranks_cpu[0] = 0
    assert propose(state, proposing, batch_idle=True) == Proposal(
        2, StepKind.REMOVE, 0, 2, 3, abort=AbortReason.RANK_FAILED)
    state.active_ranks_cpu[0] = 1
    state.active_ranks_cpu[1] = 0
    assert propose(state, proposing, batch_idle=True).abort is AbortReason.NONE
    # Once committed, nothing of it is proposed again: rank 1's hole awaits its relaunch.
    monkeypatch.setattr(launch_recovery, "replacements_registered", lambda state, ranks: False)
    for step in (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING):
        down.machine.advance(step, time.monotonic())
    down.machine.committed(time.monotonic())
    assert propose(state, proposing, batch_idle=True) == Proposal(2, StepKind.RECOVER, 0, 3, 3)



def test_a_failed_joiner_below_a_live_one_is_proposed_for_the_rejoin_in_place(
        proposing: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched at 2, grown to 4, joiner 2 failed while joiner 3 serves: no let-go (it is no
    tail); the survivors wait for its replacement in WORLD and take it back in place, as for
    a launch-time rank. Once rank 3 fails too, the failed joiners are a tail to let go."""
    from sglang_elastic_ep.sglang import replacement_notices

    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: None)
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=4, has_scaled=True,
                            original_ep_size=2, active_ranks=mask.clone(),
                            active_ranks_cpu=mask.clone(), scale_phase="idle")
    registered: list[tuple[int, ...]] = []
    monkeypatch.setattr(launch_recovery, "replacements_registered",
                        lambda state, ranks: registered.append(ranks) or len(registered) > 1)
    propose = gather_agreement.propose
    assert propose(state, proposing, batch_idle=True) == Proposal(2, StepKind.RECOVER, 0, 4, 4)
    assert propose(state, proposing, batch_idle=True) == Proposal(2, StepKind.RECOVER, 4, 4, 4)
    assert registered == [(2,), (2,)]
    state.active_ranks_cpu[3] = 0
    assert launch_recovery.ranks_to_rejoin(state) == ()  # the tail [2, 4) is let go first

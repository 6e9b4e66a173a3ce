"""The membership agreement rides in upstream's DP gather without a host sync of its own.

One scheduler pass's gather, as ``MLPSyncBatchInfo.all_gather`` runs it on a GPU: each rank's row
is built on the host and copied to the device, the rows are gathered on the device, and one host
copy of the result is read. The same pass runs twice through the plugin's gather hook: once as
upstream's gather alone (no pass bracket, so no agreement) and once carrying every rank's
proposal. Under ``torch.cuda.set_sync_debug_mode("warn")`` each synchronizing CUDA call warns;
the pass with the agreement must warn exactly as often as upstream's alone, and every rank must
read the same verdict from the host copy, with the membership step that follows it (the
scale-down machine acting on the verdict) touching no device at all (``"error"`` mode).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cuda_syncs import count_syncs
from dp_gather_rows import Info

from sglang_elastic_ep.core.agreement import LockstepVerdict, Proposal, StepKind
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_down_machine import ScaleDownMachine
from sglang_elastic_ep.sglang import expert_health, gather_agreement, tail_recovery
from sglang_elastic_ep.sglang.gather_agreement import gather_agreement as agreement_of

RANKS = 3


@pytest.fixture
def states(monkeypatch: pytest.MonkeyPatch) -> list[SimpleNamespace]:
    """One fake ``ElasticEPState`` per rank, its mask on the device as on a GPU server;
    ``gather_agreement.elastic_state()`` answers for the rank in ``states[0].current``."""
    current = SimpleNamespace(rank=0)
    mask_device = "cuda" if torch.cuda.is_available() else "cpu"
    made = [SimpleNamespace(active_ranks=torch.ones(RANKS, dtype=torch.int32,
                                                    device=mask_device),
                            current=current) for _ in range(RANKS)]
    monkeypatch.setattr(gather_agreement, "elastic_state", lambda: made[current.rank])
    monkeypatch.setattr(gather_agreement, "_slots_per_rank", lambda: 1)
    monkeypatch.setattr(expert_health, "own_timings", lambda slots: [0])
    monkeypatch.setattr(expert_health, "expert_location_metadata",
                        lambda: SimpleNamespace(num_local_physical_experts=1))
    monkeypatch.setattr(tail_recovery, "state_manager",
                        lambda: SimpleNamespace(instance=lambda: None))
    return made


def one_pass(states: list[SimpleNamespace], device: str,
             proposals: list[Proposal] | None, monkeypatch: pytest.MonkeyPatch
             ) -> list[LockstepVerdict | None]:
    """Every rank's gather of one pass through the plugin's hook; each rank's verdict.
    ``proposals=None``: no pass bracket, so the hook runs upstream's gather alone."""
    rows: dict[int, torch.Tensor] = {}

    def build_row(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        # First half, every rank: its row on the device. The host rows it leaves are blank
        # (no device read); the second half overwrites the round they give.
        row = sync._get_local_tensor(device=device)
        rows[states[0].current.rank] = row
        sync.tp0_info_cpu = torch.zeros((RANKS, row.numel()), dtype=row.dtype)

    def gather(sync: Info, device: Any, group: Any, use_all_reduce: bool) -> None:
        # Second half: this rank's row again (as the real pass builds it once), the peers'
        # from the first half; the collective on the device; upstream's one host copy.
        rank = states[0].current.rank
        rows[rank] = sync._get_local_tensor(device=device)
        sync.tp0_info_cpu = torch.stack([rows[r] for r in range(RANKS)]).cpu()

    verdicts: list[LockstepVerdict | None] = []
    for upstream_half in (build_row, gather):
        for rank in range(RANKS):
            states[0].current.rank = rank
            agreement = agreement_of(states[rank])
            agreement.fresh = None
            if proposals is not None:
                agreement.runner = object()
                monkeypatch.setattr(gather_agreement, "propose",
                                    lambda state, runner, batch_idle, p=proposals[rank]: p)
            sync = Info(num_dp_ranks=RANKS, tp_size=1, cp_size=1, num_tokens=rank,
                        tp0_info_cpu=None)
            gather_agreement.gather_with_agreement(upstream_half, sync, device, None, True)
            agreement.runner = None
            if upstream_half is gather:
                fresh = agreement.fresh
                verdicts.append(None if fresh is None else fresh.verdict)
    return verdicts


def test_the_agreement_adds_no_sync_to_the_pass(cuda: None, states: list[SimpleNamespace],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    caught, _ = count_syncs(lambda: torch.ones(1, device="cuda").item())
    assert caught >= 1, "the sync detector missed a device-to-host read"
    upstream_syncs, plain = count_syncs(lambda: one_pass(states, "cuda", None, monkeypatch))
    grow = [Proposal(rank=r, kind=StepKind.GROW, ready=4, target=4, serving=RANKS)
            for r in range(RANKS)]
    with_agreement, verdicts = count_syncs(lambda: one_pass(states, "cuda", grow, monkeypatch))
    print(f"synchronizing CUDA calls in one pass's gather over {RANKS} ranks: upstream alone "
          f"{upstream_syncs}, with the agreement {with_agreement}")
    assert plain == [None] * RANKS  # no bracketed pass: upstream's gather, no round
    assert verdicts == [LockstepVerdict.ENTER] * RANKS
    assert with_agreement == upstream_syncs


def scale_down_verdicts(states: list[SimpleNamespace], device: str,
                        monkeypatch: pytest.MonkeyPatch) -> list[LockstepVerdict]:
    """A scale-down 3 -> 2 over passes, each rank's machine feeding its proposal into the
    gather on ``device``; the machines act on the verdict in ``"error"`` sync mode (no device
    call) and end contracted / released."""
    machines = [ScaleDownMachine(rank=r, old_size=RANKS, new_size=RANKS - 1, started_at=0.0)
                for r in range(RANKS)]
    seen: list[LockstepVerdict] = []
    for p in range(4):
        if p == 2:
            machines[RANKS - 1].confirm_drain()  # the HTTP process routed nothing to it since
        proposals = [Proposal(rank=m.rank, kind=StepKind.SHRINK,
                              ready=m.readiness(holds_no_request=p >= 1), target=m.new_size,
                              serving=m.old_size) for m in machines]
        if any(m.done for m in machines):  # after the commit nothing is pending
            proposals = [Proposal(rank=m.rank, kind=StepKind.NONE, ready=0, target=0,
                                  serving=m.new_size) for m in machines]
        verdicts = one_pass(states, device, proposals, monkeypatch)
        assert len(set(verdicts)) == 1, f"pass {p}: ranks read different verdicts {verdicts}"
        verdict = verdicts[0]
        assert verdict is not None
        seen.append(verdict)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            if verdict is LockstepVerdict.ENTER and not any(m.done for m in machines):
                for m in machines:
                    for step in (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT,
                                 Phase.RELEASING):
                        m.advance(step, now=float(p))
                    m.committed(now=float(p))
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    assert [m.phase for m in machines] == [Phase.SERVING_CONTRACTED] * (RANKS - 1) + [
        Phase.RELEASED]
    return seen


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_scale_down_reads_the_same_verdicts_on_every_device(
    device: str, states: list[SimpleNamespace], monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """The CPU case is the twin CI runs; on a GPU both run and must agree."""
    if device == "cuda":
        request.getfixturevalue("cuda")  # skips, with the reason printed, without a GPU
    W, E, N = LockstepVerdict.WAIT, LockstepVerdict.ENTER, LockstepVerdict.NOTHING_PENDING
    assert scale_down_verdicts(states, device, monkeypatch) == [W, W, E, N]

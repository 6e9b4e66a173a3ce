"""The per-pass rank agreement, carried in the DP-attention gather SGLang already runs.

With DP attention every scheduler pass all-gathers one row of batch metadata per rank
(``dp_attn.prepare_mlp_sync_batch_raw`` -> ``MLPSyncBatchInfo.all_gather``; over the expanded
WORLD after a scale-up). Each rank appends its membership proposal
(:class:`~sglang_elastic_ep.core.agreement.Proposal`: step, ready, target, serving size) and its
own expert timings to its row. After the gather every rank holds the same rows, so every rank
reaches the same verdict (:func:`~sglang_elastic_ep.core.agreement.gathered_round`) on the same
pass, and ``scale_progress.agreed_join_step`` acts on it later in that pass.

Nothing is added to the pass on any device: the columns come from host state, are appended to
upstream's row on the host and travel in the same host-to-device copy as the row itself; the
verdict is read from the host copy of the gathered rows that upstream makes anyway
(``global_info_tensor.cpu()`` in ``all_gather``).

Where a pass runs no gather (no DP attention, a single DP rank, or
``SGLANG_SCHEDULER_SKIP_ALL_GATHER``), :func:`agree_by_all_reduce` is the fallback, on every
device: one MAX all-reduce of host tensors over WORLD's host group (docs/design.md, "Agreement
on the DP gather").
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.core.agreement import (
    AbortReason,
    GatheredRound,
    LockstepVerdict,
    Proposal,
    StepKind,
    gathered_round,
    gathered_timings,
    lockstep_verdict,
    pack_row,
)
from sglang_elastic_ep.sglang import expert_health, launch_recovery, tail_recovery
from sglang_elastic_ep.sglang.gather_repair import full_rows, row_check
from sglang_elastic_ep.sglang.pass_progress import pass_progress
from sglang_elastic_ep.sglang.pass_round import (
    AGREEMENT_ATTR,
    AgreedRound,
    GatherAgreement,
    gather_agreement,
)
from sglang_elastic_ep.sglang.scale_down import is_shrink, scale_down_state
from sglang_elastic_ep.sglang.scale_up import abort_reason
from sglang_elastic_ep.sglang.upstream import (
    elastic_state,
    expert_location_metadata,
    lockstep_agreement_on,
    world_host_group,
)

logger = logging.getLogger(__name__)


def _agreement_in_gather() -> GatherAgreement | None:
    """The agreement while this rank's row is being built and gathered, else None (per-row hot
    path: attribute reads only)."""
    state = elastic_state()
    agreement = getattr(state, AGREEMENT_ATTR, None) if state is not None else None
    if agreement is None or agreement.outgoing is None:
        return None
    return agreement


# ------------------------------------------------------------------------ this rank's inputs


def _ready_target(state: Any, target: int) -> int:
    """``target`` when this rank could admit the joiners now, else 0: it sees the request, the
    joining cohort in the store, and every joiner's Mooncake peer state (the local checks
    upstream makes inside ``maybe_join_ep_ranks``)."""
    if not target:
        return 0
    from sglang.srt.elastic_ep.elastic_ep import get_scale_cohort

    effective = state.effective_ep_size
    cohort = get_scale_cohort(effective)
    if cohort is None or cohort.target_ep_size != target:
        # a mismatching cohort is upstream's to report: let every rank enter and fail it
        return target if cohort is not None else 0
    from mooncake.pg import get_peer_state

    joining = list(range(effective, target))
    return target if all(get_peer_state(dist.group.WORLD, joining)) else 0


ENV_TEST_SKEW = "SGLANG_EEP_TEST_SKEW_PASSES"


class ReadinessSkew:
    """Test-only fault injection (``SGLANG_EEP_TEST_SKEW_PASSES=<rank>:<passes>``): that rank
    reports a scale as ready only ``passes`` passes after it could, as if it saw the change
    late. The agreement must then hold the other ranks (serving) until it catches up."""

    @classmethod
    def from_environment(cls, rank: int) -> ReadinessSkew:
        """The knob as the server's environment set it before start (read once, not per pass)."""
        return cls(os.environ.get(ENV_TEST_SKEW), rank)

    def __init__(self, spec: str | None, rank: int) -> None:
        self.passes = 0
        if spec:
            target_rank, _, passes = spec.partition(":")
            if int(target_rank) == rank:
                self.passes = int(passes)
        self.rank = rank
        self._held: dict[int, int] = {}  # target -> passes held back so far

    def entered(self) -> None:
        """The ranks entered a change: the next change is late again (a recovery re-admits
        into the same size a scale-up reached before)."""
        self._held.clear()

    def apply(self, ready: int) -> int:
        if not self.passes or not ready:
            return ready
        held = self._held.get(ready, 0)
        if held < self.passes:
            self._held[ready] = held + 1
            logger.info("[elastic-ep] test skew: rank %d holds back readiness for size %d "
                        "(pass %d of %d)", self.rank, ready, held + 1, self.passes)
            return 0
        return ready


_SKEW_ATTR = "_elastic_ep_readiness_skew"


def readiness_skew(runner: Any) -> ReadinessSkew:
    """This rank's skew, built on first use and kept on its model runner (one per process), so
    the per-pass step reads an attribute, not the environment."""
    skew = getattr(runner, _SKEW_ATTR, None)
    if skew is None:
        skew = ReadinessSkew.from_environment(dist.get_rank())
        setattr(runner, _SKEW_ATTR, skew)
    return skew


def propose(state: Any, runner: Any, *, batch_idle: bool) -> Proposal:
    """This rank's proposal for the pass, from host state only: a scale up or down, a removal
    of live ranks below the tail (``rank_removal``), letting go of a failed tail of
    scale-joined ranks (``tail_recovery``), or taking back failed launch-time ranks in place
    (``launch_recovery``). ``batch_idle``: this rank's batch for the pass holds no request
    (a leaving rank is ready only then)."""
    tail_recovery.request_return_when_replacement_registered(state)
    rank = runner._elastic_global_rank()
    down = scale_down_state(state)
    removal = down.removing
    target = state.pending_ep_size or 0
    rejoin = () if target or removal else launch_recovery.ranks_to_rejoin(state)
    let_go = 0 if target or rejoin or removal else \
        tail_recovery.contraction_target(state, runner)
    if removal is not None:  # live ranks below the tail: leaving ones wait until they hold none
        kind, target = StepKind.REMOVE, removal.agreed_target
        ready = down.ready_to_shrink(state, rank, batch_idle=batch_idle)
    elif rejoin:  # ready once every replacement is in WORLD; the size stays
        kind = StepKind.RECOVER
        target = int(state.effective_ep_size)
        ready = target if launch_recovery.replacements_registered(state, rejoin) else 0
    elif let_go:  # every survivor is ready as soon as it sees the failure
        kind, target, ready = StepKind.LET_GO, let_go, let_go
    elif target and is_shrink(state):  # a scale-down: leaving ranks wait until they hold none
        kind = StepKind.SHRINK
        ready = down.ready_to_shrink(state, rank, batch_idle=batch_idle)
    elif target:
        kind, ready = StepKind.GROW, _ready_target(state, target)
    else:
        kind, ready = StepKind.NONE, 0
    ready = readiness_skew(runner).apply(ready)
    # Only a pending scale is called off: no config lookup or mask read on other passes.
    if kind is StepKind.GROW:
        abort = abort_reason(state)
    elif kind in (StepKind.SHRINK, StepKind.REMOVE):
        abort = down.abort_reason(state, time.monotonic())
    else:
        abort = AbortReason.NONE
    return Proposal(rank=rank, kind=kind, ready=0 if abort else ready, target=target,
                    serving=int(state.effective_ep_size), abort=abort)


def _slots_per_rank() -> int:
    metadata = expert_location_metadata()
    return int(metadata.num_local_physical_experts) if metadata is not None else 0


# ------------------------------------------------------------------- hooks on upstream's gather


def bracket_mlp_sync(original: Any, local_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``dp_attn.prepare_mlp_sync_batch_raw``: hands the pass's model runner and whether
    this rank's batch holds a request to the gather inside it (``all_gather`` receives
    neither)."""
    from sglang.srt.runtime_context import get_parallel

    state = elastic_state()
    if not lockstep_agreement_on(state, get_parallel()):
        return original(local_batch, *args, **kwargs)
    agreement = gather_agreement(state)
    progress = pass_progress(state)
    if progress is not None:
        progress.gathered()
    agreement.runner = kwargs["model_runner"] if "model_runner" in kwargs else args[0]
    agreement.batch_idle = local_batch is None or not getattr(local_batch, "reqs", None)
    try:
        return original(local_batch, *args, **kwargs)
    finally:
        agreement.runner = None


# What Mooncake raises in a collective of a rank it deactivated (its peers no longer count it).
NOT_ACTIVE_IN_GROUP = "rank is not active in this group"


def gather_with_agreement(
    original: Any, info: Any, device: Any, group: Any, use_all_reduce: bool = False
) -> Any:
    """AROUND ``dp_attn.MLPSyncBatchInfo.all_gather``: this rank's proposal rides in its row
    (``append_agreement_columns``); after the gather every rank reads the verdict from the same
    rows. The expanded-WORLD masking is ``tail_recovery.gather_seeing_failures``; a pass whose
    gather lost a failing peer's row enters no step (``gathered_round``'s ``unseen``).

    A rank Mooncake deactivated while it was alive (its peers took it for failed) gets an
    error from this gather; it is re-raised (the scheduler exits, as upstream's does) after a
    line that says what happened and what to do, instead of Mooncake's message alone."""
    try:
        return _gather_with_agreement(original, info, device, group, use_all_reduce)
    except RuntimeError as exc:
        if NOT_ACTIVE_IN_GROUP in str(exc):
            logger.error(
                "[elastic-ep] rank %d: Mooncake deactivated this rank while it was serving "
                "(its peers no longer count it; see docs/operations.md, 'Fault timing'). Its "
                "scheduler exits and the status shows it failed: relaunch it with "
                "--ep-join-mode recover to serve again", dist.get_rank())
        raise


def _gather_with_agreement(
    original: Any, info: Any, device: Any, group: Any, use_all_reduce: bool
) -> Any:
    state = elastic_state()
    agreement = getattr(state, AGREEMENT_ATTR, None) if state is not None else None
    if agreement is None or agreement.runner is None:
        return tail_recovery.gather_masks_expanded_world(original, info, device, group,
                                                         use_all_reduce)
    proposal = propose(state, agreement.runner, batch_idle=agreement.batch_idle)
    slots = _slots_per_rank()
    columns = pack_row(proposal, expert_health.own_timings(slots))
    agreement.outgoing = columns
    agreement.upstream_width = 0
    try:
        result, failed = tail_recovery.gather_seeing_failures(
            original, info, device, group, use_all_reduce, checked_rows=True)
    finally:
        agreement.outgoing = None
    progress = pass_progress(state)
    if progress is not None:
        progress.took_tokens(getattr(info, "global_num_tokens", None))
    if not agreement.upstream_width:
        # The row hook did not run (the columns never left this rank): no round. Every rank
        # runs the same hooks, so all of them take the no-gather path alike.
        agreement.report_once("the gather ran without the agreement's columns")
        return result
    rows = gathered_columns(info, agreement.upstream_width, len(columns))
    expert_health.expert_health_state(state).take_gathered(
        gathered_timings(rows, slots_per_rank=slots, capacity=int(state.active_ranks.numel())))
    agreement.finish(AgreedRound(gathered_round(rows, unseen=failed), proposal))
    return result


CHECK_COLUMNS = 1  # the row's check value (``gather_repair.row_check``), after our columns


def _extended(base: torch.Tensor, columns: list[int], device: Any) -> torch.Tensor:
    # Appended on the host: the row still reaches the device in one copy, as upstream's does.
    row = base.tolist() + columns
    return torch.tensor([*row, row_check(row)], dtype=base.dtype).to(device)


def append_agreement_columns(
    original: Any, info: Any, device: Any, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """AROUND ``MLPSyncBatchInfo._get_local_tensor``: during the agreement's gather this rank's
    row ends with its proposal and expert timings, then the row's check value (a survivor of a
    peer's death mid-gather tells stale rows by it: ``gather_repair``)."""
    agreement = _agreement_in_gather()
    if agreement is None:
        return original(info, device=device, dtype=dtype)
    base = original(info, device="cpu", dtype=dtype)
    agreement.upstream_width = int(base.numel())
    return _extended(base, agreement.outgoing, device)


def append_blank_columns(
    original: Any, info: Any, device: Any, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """AROUND ``MLPSyncBatchInfo._get_fallback_tensor``: the fallback row (every slot's start
    value, and the row of an inactive rank) gets zero columns: no proposal."""
    agreement = _agreement_in_gather()
    if agreement is None:
        return original(info, device=device, dtype=dtype)
    base = original(info, device="cpu", dtype=dtype)
    extra = torch.zeros(len(agreement.outgoing) + CHECK_COLUMNS, dtype=base.dtype)
    return torch.cat((base, extra)).to(device)


def gathered_columns(info: Any, upstream_width: int, width: int) -> list[list[int]]:
    """Every gathered row's agreement columns (``width`` after upstream's ``upstream_width``;
    the check column after them is left out).

    Upstream keeps the host copy of the whole gather only through ``tp0_info_cpu``, the
    attention-TP-rank-0 view of it (``global_info_tensor.cpu()[:, 0, :]``); the rows of other
    attention-TP ranks are in the same storage. Reading them there touches no device.
    """
    view = info.tp0_info_cpu
    total = upstream_width + width + CHECK_COLUMNS
    full = full_rows(info)
    if full is None or full.shape[1] != total:
        raise RuntimeError(f"unexpected gathered rows: {None if view is None else view.shape} "
                           f"on {None if view is None else view.device}, expected "
                           f"[{int(info.num_dp_ranks)}, {total}] in host memory, every row "
                           "of the gather in its storage")
    return full[:, upstream_width:upstream_width + width].tolist()


# ------------------------------------------------------------------ fallback: no gather to use


def agree_by_all_reduce(state: Any, runner: Any) -> AgreedRound:
    """The verdict from one MAX all-reduce of ``(ready, -ready, target, timings...)`` over
    WORLD's host group, for passes that run no gather. Its inputs are host state and it moves
    host tensors only, so it is the same step on every device and never syncs a GPU stream."""
    proposal = propose(state, runner, batch_idle=True)
    timings = expert_health.local_contribution(proposal.rank, int(state.active_ranks.numel()))
    reduced = torch.tensor([proposal.ready, -proposal.ready, proposal.target,
                            int(proposal.abort), int(proposal.kind), *timings],
                           dtype=torch.int64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=world_host_group())
    expert_health.expert_health_state(state).take_gathered(reduced[5:].tolist())
    if int(reduced[3]):  # some rank calls the pending step off: every rank drops it
        reason = AbortReason(int(reduced[3]))
        # The step and target called off, as the aborting rank proposed them (one step is
        # pending at a time): a rank that has not read the request learns what was dropped.
        called_off = Proposal(rank=proposal.rank, kind=StepKind(int(reduced[4])), ready=0,
                              target=int(reduced[2]), serving=proposal.serving, abort=reason)
        return AgreedRound(GatheredRound(LockstepVerdict.ABORT, (called_off,),
                                         f"called off ({reason.name.lower()})", abort=reason),
                           proposal)
    verdict = lockstep_verdict(int(reduced[0]), -int(reduced[1]), int(reduced[2]))
    return AgreedRound(GatheredRound(verdict, (proposal,)), proposal)

"""Keep elastic membership work moving, on passes every rank agreed on.

Upstream advances a pending scale-up (cohort check, admission, commit) and rank recovery only at
the end of a forward pass (``ModelRunner.maybe_join_ep_ranks``), and each rank decides from its
own view. :func:`agreed_join_step` enters that step only on the pass the ranks agreed on
(``gather_agreement``: the verdict rides in upstream's DP-attention gather).

An idle cluster runs no forward passes, so a POSTed scale-up waited until the next request
arrived (minutes, on a quiet night). Where the idle step runs matters. With DP attention every
rank learns in the same loop iteration that no rank has work (the token-count all-gather inside
``Scheduler.get_next_batch_to_run``), so "no batch this iteration" is the same on all ranks and
the step's collectives line up. ``Scheduler.on_idle`` is not such a point: the overlap event
loop skips it on the iteration right after a batch (it processes that batch's result instead).
A process that just joined has no previous batch, so on the first idle iteration after a commit
it ran the step while the others did not, and every rank's collective sequence was off by one
from then on (a stall, or ``ValueError: 0 is not a valid ForwardMode``: docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.core.agreement import LockstepVerdict, Proposal, StepKind, bitmask_ranks
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import launch_recovery, tail_recovery
from sglang_elastic_ep.sglang.gather_agreement import (
    agree_by_all_reduce,
    gather_agreement,
    readiness_skew,
)
from sglang_elastic_ep.sglang.join_kind import note_join, slot_history
from sglang_elastic_ep.sglang.nixl_buffer_hooks import mirror_of
from sglang_elastic_ep.sglang.operation_log import end_when_settled, get_logger
from sglang_elastic_ep.sglang.pass_faults import model_forward_done
from sglang_elastic_ep.sglang.pass_progress import (
    enter_step,
    pass_progress,
    start_pass_progress,
)
from sglang_elastic_ep.sglang.scale_down import (
    call_off_scale_down,
    finalize_removal,
    finalize_scale_down,
)
from sglang_elastic_ep.sglang.scale_up import abort_pending_scale, scale_up_machine, settle
from sglang_elastic_ep.sglang.upstream import (
    attached_state,
    elastic_state,
    lockstep_agreement_on,
)
from sglang_elastic_ep.sglang.world_view import world_quiesce

logger = get_logger(__name__)

# The step each rank reports while it runs an agreed membership step (pass_progress).
MEMBERSHIP_STEPS = {
    StepKind.GROW: "scale-up to {target}",
    StepKind.SHRINK: "scale-down to {target}",
    StepKind.LET_GO: "let go of failed ranks (serving on {target})",
    StepKind.RECOVER: "take back failed launch-time ranks (serving on {target})",
    StepKind.REMOVE: "remove ranks {target} where they are",
}


def progress_membership_when_idle(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_next_batch_to_run`` (once per loop iteration, after its gathers):
    mark the iteration for the agreement, and when no rank has a batch run the per-forward
    elastic step that a forward pass would have run (see the module docstring)."""
    from sglang.srt.runtime_context import get_parallel

    state = elastic_state()
    if not lockstep_agreement_on(state, get_parallel()):
        return
    gather_agreement(state).mark_iteration()
    has_batch = getattr(plan, "batch_to_run", None) is not None
    progress = pass_progress(state) or start_pass_progress(state, scheduler)
    if progress is not None:
        progress.now_in("forward" if has_batch else "idle")
    if has_batch:
        return  # the forward pass calls maybe_join_ep_ranks itself
    # Called on every idle iteration (not only when this rank sees a scale): the verdict of
    # this iteration's gather is taken here, and every rank must act on it on the same pass.
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return
    runner.maybe_join_ep_ranks()
    # The state's mask (what the report below reads) is written by the MoE dispatcher, in a
    # forward pass, and copied to the host after one: an idle rank reported a dead peer as
    # alive, and the HTTP process kept routing to its shard. Mooncake's process groups clear
    # their own masks when they evict a rank, forward or not.
    if state.active_ranks is not None and state.active_ranks_cpu is not None:
        evicted = fold_group_evictions(state, mooncake_groups())
        if evicted:
            logger.info("[elastic-ep] ranks %s evicted by Mooncake while this rank idled",
                        evicted)
        state.sync_active_to_cpu()
    # Upstream reports commits and active ranks to the tokenizer after a batch; do it here too.
    scheduler._maybe_report_active_ranks()


@dataclass
class GroupMasksSeen:
    """Each Mooncake group's mask as the last idle iteration read it (by group identity)."""

    masks: dict[int, tuple[int, ...]] = field(default_factory=dict)


_GROUP_MASKS_ATTR = "_elastic_ep_group_masks_seen"


def mooncake_groups() -> list[Any]:
    """Every live parallel group, WORLD's among them (upstream's list, the one a removal
    deactivates ranks in): Mooncake clears an evicted rank in each group's mask; a gloo
    group's mask never drops."""
    from sglang.srt.elastic_ep.elastic_ep import _iter_live_parallel_groups

    return list(_iter_live_parallel_groups())


def fold_group_evictions(state: Any, groups: list[Any]) -> list[int]:
    """Clear in the state's mask the ranks a group's mask dropped since the last call; the
    global ranks cleared. Only a drop counts: a mask that rises late (Mooncake's bitmap lags a
    scale-up or a take-back by seconds) or was already low when first read changes nothing."""
    seen = attached_state(state, _GROUP_MASKS_ATTR, GroupMasksSeen)
    mirror = mirror_of(state)
    evicted: set[int] = set()
    for group in groups:
        mask, ranks = getattr(group, "active_ranks_cpu", None), getattr(group, "ranks", None)
        if mask is None or not ranks:
            continue
        now = tuple(int(v) for v in mask.tolist()[:len(ranks)])
        before = seen.masks.get(id(group))
        seen.masks[id(group)] = now
        if before is None or len(before) != len(now):
            continue
        evicted.update(rank for rank, was, is_now in zip(ranks, before, now, strict=False)
                       if was and not is_now and rank < mirror.size and mirror.is_active(rank))
    for rank in sorted(evicted):
        state.active_ranks[rank] = 0
    return sorted(evicted)


def rebalance_after_rank_fault(original: Any, *, eplb_manager: Any) -> bool:
    """AROUND ``elastic_ep.maybe_rebalance_after_rank_fault``: upstream rebalances at once over
    a world that still counts the failed ranks. Two cases skip it, record the new active set and
    rely on the mask-aware dispatch (``expert_dispatch``) to route tokens to live replicas:
    without ``--enable-eplb`` (no manager: upstream dereferences None and kills the scheduler),
    and a failed tail of scale-joined ranks, which the survivors let go of on an agreed pass
    (``tail_recovery``); EPLB then rebalances the layout of the ranks that remain."""
    state = elastic_state()
    tail = state is not None and eplb_manager is not None \
        and tail_recovery.failed_tail_to_let_go(state)
    if eplb_manager is not None and not tail:
        return original(eplb_manager=eplb_manager)
    if state is None or state.is_active_equal_last():
        return False
    before = _host_mask(state)
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    progress = pass_progress(state)
    if progress is not None:  # where the ranks just taken for failed were, for the log
        progress.log_last_reports([r for r, (was, now) in enumerate(
            zip(before, _host_mask(state), strict=False)) if was and not now])
    if tail:
        logger.info("[elastic-ep] active ranks changed to %s: EPLB waits until the survivors let "
                    "go of the failed tail", state.active_ranks_cpu.tolist())
        return False
    logger.warning(
        "[elastic-ep] active ranks changed to %s without EPLB: experts of inactive ranks are "
        "served from live replicas where they exist (start with --enable-eplb to rebalance)",
        state.active_ranks_cpu.tolist(),
    )
    return False


def _host_mask(state: Any) -> list[int]:
    mask = getattr(state, "active_ranks_cpu", None)
    return [] if mask is None else [int(v) for v in mask.tolist()]


def agreed_join_step(original: Any, runner: Any) -> None:
    """AROUND ``ModelRunner.maybe_join_ep_ranks``: enter the membership step only on a pass where
    every active rank is ready for the same change (see
    :func:`sglang_elastic_ep.core.agreement.verdict_from_proposals`): a scale up or down, or
    letting go of a failed tail of scale-joined ranks (``tail_recovery``). Upstream let each
    rank decide from local checks (its copy of the request, the cohort key, Mooncake peer
    state), so under load one rank admitted the joiner while another ran the next MoE dispatch,
    and both hung."""
    from sglang.srt.runtime_context import get_parallel

    state = elastic_state()
    if state is not None:
        # Before any membership step of this pass: ranks it retires on purpose are no fault.
        model_forward_done(state)
        end_when_settled(state)
    if not lockstep_agreement_on(state, get_parallel()):
        return original(runner)
    agreement = gather_agreement(state)
    agreed = agreement.take()
    if agreed is None:
        repeat = agreement.repeat_verdict()
        if repeat is not None:
            # Another forward in the same iteration (a draft model's): this pass's verdict
            # was acted on; only upstream's per-pass step runs again, as it did before.
            return original(runner) if repeat is LockstepVerdict.NOTHING_PENDING else None
        agreed = agree_by_all_reduce(state, runner)
        source = "all-reduce"
    else:
        source = "gather"
    if agreed.verdict is LockstepVerdict.WAIT:
        return None
    if agreed.verdict is LockstepVerdict.NOTHING_PENDING and (
            launch_recovery.ranks_to_rejoin(state)
            or tail_recovery.contraction_target(state, runner)):
        # A rank failed during this pass's forward, after the gather: upstream's step would
        # declare the failure unrecoverable. The next pass's gather carries the let-go, or
        # the wait for a launch-time rank's replacement.
        return None
    if agreed.verdict is LockstepVerdict.ABORT:
        if any(p.kind in (StepKind.SHRINK, StepKind.REMOVE)
               for p in agreed.outcome.proposals if p.abort):
            return call_off_scale_down(runner, state, agreed.outcome)
        return abort_pending_scale(runner, state, agreed.outcome.abort,
                                   agreed.outcome.problem or "called off")
    if agreed.verdict is LockstepVerdict.ENTER:
        readiness_skew(runner).entered()
        proposal = agreed.proposal
        # The all-reduce's round holds this rank's row only: its members are the active ranks.
        members = ([p.rank for p in agreed.outcome.proposals] if source == "gather"
                   else mirror_of(state).active_ranks(proposal.serving))
        world_quiesce(state).arm(members)
        named = (list(bitmask_ranks(proposal.target)) if proposal.kind is StepKind.REMOVE
                 else proposal.target)
        enter_step(state, MEMBERSHIP_STEPS[proposal.kind].format(target=named))
        if proposal.kind is StepKind.LET_GO:
            return tail_recovery.let_go_of_failed_tail(runner, proposal.target)
        if proposal.kind is StepKind.RECOVER:
            return launch_recovery.rejoin_in_place(runner, state,
                                                   launch_recovery.ranks_to_rejoin(state))
        if proposal.kind is StepKind.SHRINK:
            return finalize_scale_down(runner, proposal.target)
        if proposal.kind is StepKind.REMOVE:
            return finalize_removal(runner, proposal.target)
        if proposal.kind is StepKind.GROW:
            return _grow(original, runner, state, proposal, source)
    original(runner)
    settle(state)  # a commit upstream finishes on a later pass ends the scale-up's machine here
    tail_recovery.note_committed(state)
    return None


def _grow(original: Any, runner: Any, state: Any, proposal: Proposal, source: str) -> None:
    """Upstream's admission and commit of the joiners, and which kind of join it was.

    Each rank logs its entry and, if upstream's step failed the scale on it, why: upstream
    reports a failure from attention-TP rank 0 only, so a rank that fails alone was silent."""
    rank, target = proposal.rank, proposal.target
    joining = mirror_of(state).inactive_ranks(target)
    logger.info("[elastic-ep] rank %d enters the scale-up to %d (joining %s; verdict from the %s)",
                rank, target, joining, source)
    try:
        kind = slot_history(state).join_kind(joining)
    except ValueError as exc:  # a mix of old and new slots: upstream admits them all
        logger.warning("[elastic-ep] %s", exc)
        kind = None
    scale_up_machine(state)  # this rank's side of the scale-up, if no proposal built it yet
    original(runner)
    _say_if_the_admission_was_not_proposed(state, rank, target)
    if settle(state) is Phase.FAILED:
        logger.warning("[elastic-ep] rank %d: the scale-up to %d failed on this rank: %s",
                       rank, target, state.last_error)
    tail_recovery.note_committed(state)
    joined = [r for r in joining if mirror_of(state).is_active(r)]
    if joined and kind is not None:
        note_join(state, joined, kind, runner.eplb_manager)


def _say_if_the_admission_was_not_proposed(state: Any, rank: int, target: int) -> None:
    """After upstream's step on an agreed scale-up pass: say so when upstream's step returned
    before the admission on this rank (the members armed on the pass were never met), which
    the other members then wait for at the quiesce barrier (``world_view``)."""
    if world_quiesce(state).take():
        logger.warning(
            "[elastic-ep] rank %d: upstream's step returned before the admission of the "
            "agreed scale-up to %d (phase %s, pending %s, serving %s): the other members wait "
            "for this rank at the quiesce barrier, then back out", rank, target,
            getattr(state, "scale_phase", None), state.pending_ep_size,
            state.effective_ep_size)

"""Scale-down on the scheduler side: tail ranks leave after their shards drained.

Order (RFC "Scale-Down Flow", vLLM's lesson that experts move before ranks leave):

1. The HTTP process stops routing new requests to the leaving shards and then sends the
   request here (``handle_scale_request``). Every scheduler checks that each logical expert
   keeps a replica on a staying rank; otherwise the request is refused and nothing changes.
2. While the leaving shards still hold requests, every rank keeps serving. When every request
   the HTTP process routed to them has ended (it ends stragglers after
   ``--elastic-ep-drain-timeout`` with a clear error), it sends the same request again: the
   drain is confirmed. A leaving rank reports itself ready once the drain is confirmed and its
   scheduler holds no request (so no request can still be on its way to it).
3. On the pass where every rank is ready (the per-pass agreement: ``gather_agreement``), all
   ranks run ``finalize_scale_down`` together (the release itself is ``tail_release``, shared
   with the recovery of a failed tail): the expert location metadata shrinks to the
   staying ranks' slots (each rank keeps its number of physical slots, so layouts stay valid),
   the leaving ranks become inactive, Mooncake deactivates them in WORLD, DP attention shrinks,
   and the NIXL data plane is told the new size (it disconnects at the next dispatch).
4. A leaving rank then takes no further part in any collective. When every rank of its
   ``launch_server`` tree leaves (a scale-up joiner, a node above 0), it stops that server,
   which exits 0; a rank whose server keeps other ranks (node 0's tree) exits alone (0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.core.agreement import (
    AbortReason,
    GatheredRound,
    StepKind,
    bitmask_ranks,
    ranks_bitmask,
)
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_down_machine import ScaleDownMachine
from sglang_elastic_ep.sglang import tail_recovery
from sglang_elastic_ep.sglang.expert_moves import shrink_refusal
from sglang_elastic_ep.sglang.operation_log import (
    get_logger,
    note_scale_request,
    request_operation_id,
)
from sglang_elastic_ep.sglang.rank_removal import release_removed_ranks, removal_refusal
from sglang_elastic_ep.sglang.removal_request import removed_ranks
from sglang_elastic_ep.sglang.scale_up import CANCEL_EP_SIZE, request_cancel, scale_up_state
from sglang_elastic_ep.sglang.tail_release import release_tail
from sglang_elastic_ep.sglang.upstream import (
    attached_state,
    lockstep_agreement_on,
    scale_timeout_s,
    state_manager,
)

logger = get_logger(__name__)


@dataclass
class ScaleDownState:
    """This scheduler process's scale-down driver (one per process: ``scale_down_state``): the
    machine of the current or last scale-down (``core.scale_down_machine``), fed from the
    scheduler's queues and the membership mask, and the phase it reports."""

    scheduler: Any = None  # this process's scheduler, for the drain check in the agreement step
    machine: ScaleDownMachine | None = None
    # A scale-down the agreement called off before this rank read its request: its
    # step and ``agreed_target``, and why, to answer that request with when it arrives.
    called_off: tuple[StepKind, int, str] | None = None

    def ready_to_shrink(self, state: Any, rank: int, *, batch_idle: bool = True) -> int:
        """The shrink target when this rank can enter the release now, else 0: staying ranks at
        once, a leaving rank once the HTTP process confirmed the drain (no request of its is on
        the way), its scheduler holds no request, and the batch it runs this pass holds none
        (``batch_idle``: asked before the pass's batch is the scheduler's running batch)."""
        machine = self.machine
        if machine is None:
            return 0
        if not machine.removed and (not is_shrink(state)
                                    or machine.new_size != state.pending_ep_size):
            return 0
        idle = batch_idle and self.scheduler is not None and holds_no_request(self.scheduler)
        return machine.readiness(holds_no_request=idle)

    def abort_reason(self, state: Any, now: float) -> AbortReason:
        """Whether this rank calls the pending scale-down off this pass (the timeout, or a
        staying rank the mask shows failed: read through its host mirror, no device sync)."""
        machine = self.machine
        if machine is None or not machine.draining:
            return AbortReason.NONE
        mask = tail_recovery.live_mask(state)
        failed = frozenset(r for r in range(min(machine.old_size, len(mask))) if not mask[r])
        return machine.abort_reason(now, failed_ranks=failed)

    def is_late_drain_confirmation(self, state: Any, new_ep_size: int) -> bool:
        """The HTTP process's drain confirmation reached this scheduler only after the commit
        (``ScaleDownMachine.answers_late_confirmation``): it is answered as done, not taken for
        a new request to the current size (refused, that would report the committed
        scale-down as failed)."""
        return (self.machine is not None and self.machine.answers_late_confirmation(new_ep_size)
                and state.pending_ep_size is None and state.effective_ep_size == new_ep_size)

    @property
    def removing(self) -> ScaleDownMachine | None:
        """The machine of a removal below the tail while it drains, else None."""
        machine = self.machine
        return machine if machine is not None and machine.removed and machine.draining \
            else None

    def take_called_off(self, state: Any, kind: StepKind, agreed_target: int,
                        operation_id: str | None = None) -> str | None:
        """Why the request that just arrived (to shrink to a size, or to remove ranks: its
        ``agreed_target``) was already called off: by the other ranks on a pass before this
        rank read it, or, for the drain confirmation of ``operation_id``, by this rank itself
        (``ScaleDownMachine.answers_called_off_confirmation``); None for any other request.
        Answered once: a later request for the same change is a new one."""
        called_off, self.called_off = self.called_off, None
        if called_off is not None and called_off[:2] == (kind, agreed_target) \
                and state.pending_ep_size is None:
            return called_off[2]
        if self.machine is not None:
            return self.machine.answers_called_off_confirmation(operation_id)
        return None

    def enter_phase(self, state: Any, phase: Phase) -> None:
        """The release on the agreed pass reached ``phase`` (a step, or its end)."""
        machine = self.machine
        if machine is None:
            raise RuntimeError("a scale-down release ran without its machine")
        now = time.monotonic()
        if phase in (Phase.SERVING_CONTRACTED, Phase.RELEASED):
            machine.committed(now)
        else:
            machine.advance(phase, now)
        state.scale_phase = machine.phase.value


_STATE_ATTR = "_elastic_ep_scale_down"


def scale_down_state(state: Any) -> ScaleDownState:
    """The scale-down state kept on upstream's ``ElasticEPState`` ``state`` (one per scheduler
    process, whichever model runner runs the per-pass step); built on first use."""
    return attached_state(state, _STATE_ATTR, ScaleDownState)


def refusal(state: Any, new_ep_size: int) -> str | None:
    """Why this scheduler cannot shrink to ``new_ep_size`` now; None when it can."""
    from sglang.srt.elastic_ep.topology import attn_replica_size
    from sglang.srt.runtime_context import get_parallel

    old = state.effective_ep_size
    parallel = get_parallel()
    # Without the per-pass agreement the ranks could commit on different passes.
    if not lockstep_agreement_on(state, parallel):
        return ("scale-down needs the per-pass rank agreement, which runs only in a deployment "
                "started with --max-ep-size (room to grow): restart with it to scale down")
    if new_ep_size < 1:
        return f"new_ep_size must be at least 1, got {new_ep_size}"
    replica = attn_replica_size()
    if new_ep_size % replica:
        return (f"new_ep_size ({new_ep_size}) would split an attention replica of {replica} "
                "ranks: choose a multiple of it")
    too_few = too_few_dp_ranks(bool(parallel.attn_dp_enabled), new_ep_size, replica)
    if too_few is not None:
        return too_few
    if state_manager().is_scaling() and not removes_every_failed_rank(state, new_ep_size):
        return ("another scale or a recovery is in progress: wait until it finishes "
                "(GET /elastic_ep/status), then retry")
    return shrink_refusal(old, new_ep_size)


def removes_every_failed_rank(state: Any, new_ep_size: int) -> bool:
    """Whether shrinking to ``new_ep_size`` leaves out every failed rank while no scale is
    pending. Upstream counts a failed rank inside the size as a recovery in progress; such a
    scale-down removes the failed ranks instead of waiting for their replacements (a dead
    leaving rank leaves anyway), e.g. past a failed joiner awaited in place below a live one."""
    if state.pending_ep_size is not None:
        return False
    mask = tail_recovery.live_mask(state)
    failed = [r for r in range(int(state.effective_ep_size)) if not mask[r]]
    return bool(failed) and min(failed) >= new_ep_size


def too_few_dp_ranks(attn_dp_enabled: bool, new_ep_size: int, replica: int) -> str | None:
    """Attention DP needs two DP ranks: upstream asserts it on every pass, so a shrink to one
    crashed every scheduler right after its commit (seen: 3 -> 1)."""
    if attn_dp_enabled and new_ep_size // replica < 2:
        return (f"new_ep_size ({new_ep_size}) would leave {new_ep_size // replica} attention DP "
                "rank, and attention DP needs at least 2: keep at least "
                f"{2 * replica} ranks")
    return None


def handle_scale_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.handle_scale_elastic_ep``: a target below the effective size is a
    scale-down (upstream refuses those), :data:`CANCEL_EP_SIZE` cancels the pending scale-up;
    anything else is upstream's scale-up."""
    state = state_manager().instance()
    if state is None:  # elastic EP not set up: nothing of ours applies
        return original(scheduler, recv_req)
    note_scale_request(state, recv_req)
    from sglang.srt.managers.io_struct import ScaleElasticEPReqOutput

    new = int(recv_req.new_ep_size)
    removed = removed_ranks(new)
    if removed:
        scale_up_state(state).last_cancelled = None
        return _handle_removal(scheduler, state, removed, request_operation_id(recv_req))
    if new == CANCEL_EP_SIZE:
        accepted, message = request_cancel(state)
        return ScaleElasticEPReqOutput(
            success=accepted, message=message, old_ep_size=state.effective_ep_size,
            new_ep_size=state.effective_ep_size, pending_ep_size=state.pending_ep_size,
            scale_phase=state.scale_phase,
        )
    scale_up_state(state).last_cancelled = None
    down = scale_down_state(state)
    down.scheduler = scheduler
    logger.info("[elastic-ep] scale request for EP size %d (effective %d, phase %s)",
                new, state.effective_ep_size, state.scale_phase)
    if new == state.effective_ep_size \
            and tail_recovery.tail_recovery_state(state).awaiting_replacement:
        return tail_recovery.remove_failed_slots(scheduler, state, new)
    if down.is_late_drain_confirmation(state, new):
        return ScaleElasticEPReqOutput(
            success=True, message=f"scale-down to {new} already committed", old_ep_size=new,
            new_ep_size=new, scale_phase=state.scale_phase,
        )
    if new >= state.effective_ep_size:
        return original(scheduler, recv_req)

    old = state.effective_ep_size
    called_off = down.take_called_off(state, StepKind.SHRINK, new,
                                      request_operation_id(recv_req))
    machine = down.machine
    if called_off is not None:
        return ScaleElasticEPReqOutput(success=False, message=called_off, old_ep_size=old,
                                       new_ep_size=new, scale_phase=state.scale_phase)
    if (state.pending_ep_size == new and machine is not None and machine.draining
            and machine.new_size == new):
        # The HTTP process's second message: every request it routed to the leaving shards
        # has finished (or was ended at the drain timeout), so none is still on its way here.
        machine.confirm_drain()
        return ScaleElasticEPReqOutput(
            success=True, message=f"drain of ranks {new}..{old - 1} confirmed",
            old_ep_size=old, new_ep_size=new, pending_ep_size=new, scale_phase=Phase.DRAINING.value,
        )
    error = refusal(state, new)
    if error is not None:
        return ScaleElasticEPReqOutput(success=False, message=error, old_ep_size=old,
                                       new_ep_size=new, scale_phase=state.scale_phase)
    now = time.monotonic()
    down.machine = ScaleDownMachine(
        rank=scheduler.tp_worker.model_runner._elastic_global_rank(), old_size=old,
        new_size=new, started_at=now, timeout_s=scale_timeout_s(),
        operation_id=request_operation_id(recv_req),
    )
    state.pending_ep_size = new
    state.scale_phase = down.machine.phase.value
    state.last_error = None
    state.pending_since = now
    eplb = scheduler.tp_worker.model_runner.eplb_manager
    if eplb is not None:
        eplb.disable_rebalance("elastic EP scale-down is pending")
    logger.info("[elastic-ep] scale-down %d -> %d requested; ranks %s drain first",
                old, new, list(range(new, old)))
    return ScaleElasticEPReqOutput(
        success=True, message=f"Scaling down from {old} to {new}: draining ranks {new}..{old - 1}",
        old_ep_size=old, new_ep_size=new, pending_ep_size=new, scale_phase=Phase.DRAINING.value,
    )


def _handle_removal(scheduler: Any, state: Any, ranks: tuple[int, ...],
                    operation_id: str | None) -> Any:
    """A request to remove live ``ranks`` below the tail (``rank_removal``): the first one
    starts the drain, the same again confirms it (as for a scale-down)."""
    from sglang.srt.managers.io_struct import ScaleElasticEPReqOutput

    down = scale_down_state(state)
    down.scheduler = scheduler
    size = int(state.effective_ep_size)
    machine = down.machine
    logger.info("[elastic-ep] request to remove ranks %s (EP size %d, phase %s)", list(ranks),
                size, state.scale_phase)

    def answer(success: bool, message: str, phase: Phase | None = None) -> Any:
        out = ScaleElasticEPReqOutput(
            success=success, message=message, old_ep_size=size, new_ep_size=size,
            pending_ep_size=size if phase is Phase.DRAINING else None,
            scale_phase=state.scale_phase)
        if phase is not None:
            out.scale_phase = phase.value
        return out

    if machine is not None and machine.is_for(size, ranks):
        if machine.draining:
            machine.confirm_drain()
            return answer(True, f"drain of ranks {list(ranks)} confirmed", Phase.DRAINING)
        if machine.answers_late_confirmation(size, ranks):
            return answer(True, f"ranks {list(ranks)} already removed")
    called_off = down.take_called_off(state, StepKind.REMOVE, ranks_bitmask(ranks),
                                      operation_id)
    if called_off is not None:
        return answer(False, called_off)
    error = removal_refusal(state, ranks)
    if error is not None:
        return answer(False, error)
    now = time.monotonic()
    down.machine = ScaleDownMachine(
        rank=scheduler.tp_worker.model_runner._elastic_global_rank(), old_size=size,
        new_size=size, removed=ranks, started_at=now, timeout_s=scale_timeout_s(),
        operation_id=operation_id,
    )
    state.scale_phase = down.machine.phase.value
    state.last_error = None
    eplb = scheduler.tp_worker.model_runner.eplb_manager
    if eplb is not None:
        eplb.disable_rebalance("a removal of elastic EP ranks is pending")
    logger.info("[elastic-ep] removal of ranks %s requested; they drain first", list(ranks))
    return answer(True, f"Removing ranks {list(ranks)}: draining them", Phase.DRAINING)


def holds_no_request(scheduler: Any) -> bool:
    running = getattr(scheduler, "running_batch", None)
    return (
        (running is None or running.is_empty())
        and not getattr(scheduler, "waiting_queue", None)
        and getattr(scheduler, "chunked_req", None) is None
    )


def finalize_scale_down(runner: Any, target: int) -> None:
    """Every active rank, on the same agreed pass: commit the scale-down
    (:func:`~sglang_elastic_ep.sglang.tail_release.release_tail`), each step of the release
    reported to this rank's machine, which writes the phase the status shows."""
    state = state_manager().instance()
    down = scale_down_state(state)
    release_tail(runner, target, enter_phase=lambda phase: down.enter_phase(state, phase))


def finalize_removal(runner: Any, target: int) -> None:
    """Every active rank, on the same agreed pass: remove the ranks of the bitmask ``target``
    where they are (:func:`~sglang_elastic_ep.sglang.rank_removal.release_removed_ranks`)."""
    state = state_manager().instance()
    down = scale_down_state(state)
    release_removed_ranks(runner, bitmask_ranks(target),
                          enter_phase=lambda phase: down.enter_phase(state, phase))


def call_off_scale_down(runner: Any, state: Any, verdict: GatheredRound) -> None:
    """The pass's verdict called the pending scale-down off (a rank's drain timed out, or a
    staying rank failed): every rank drops it on this pass and serves on at the old size; the
    HTTP process routes to the leaving shards again when it reads the failure. A rank that has
    not read the request yet remembers the verdict and refuses the request when it arrives."""
    down = scale_down_state(state)
    machine = down.machine
    if machine is None or not machine.draining or not (machine.removed or is_shrink(state)):
        aborting = max((p for p in verdict.proposals if p.abort), default=None,
                       key=lambda p: p.target)
        if aborting is not None:
            why = verdict.abort.name.lower().replace("_", " ")
            what = (f"removal of ranks {list(bitmask_ranks(aborting.target))}"
                    if aborting.kind is StepKind.REMOVE else f"scale-down to {aborting.target}")
            down.called_off = (aborting.kind, aborting.target,
                               f"{what} called off on the other ranks ({why}) before this rank "
                               "read it")
        return
    message = machine.call_off(verdict.abort, "", time.monotonic())
    # Not upstream's fail_scale: its reset() would mark a failed staying rank active again.
    state.pending_ep_size = None
    state.pending_since = None
    state.scale_phase = machine.phase.value
    state.last_error = message
    if runner.eplb_manager is not None:
        runner._reset_eplb_after_elastic_scale_failure()
    runner._report_elastic_scale_failure(message, int(state.effective_ep_size))
    logger.warning("[elastic-ep] %s; serving on at EP size %d", message, state.effective_ep_size)


def is_shrink(state: Any) -> bool:
    pending = state.pending_ep_size
    return pending is not None and pending < state.effective_ep_size

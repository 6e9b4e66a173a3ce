"""A scale-up on a rank that serves while the joiners come in: the driver of its machine.

The machine (``core.scale_up_machine.ScaleUpMachine``) decides; this module feeds it what the
rank sees and runs the side effects. It is built when the rank first sees a scale-up pending
(upstream records the request in ``ElasticEPState.pending_ep_size``). Each pass it answers
whether this rank calls the scale-up off (the ``abort`` column of the gather row,
``core.agreement``): a cancel (``DELETE /scale_elastic_ep/{id}`` sends one message to every
scheduler, each takes it on its own pass) or the timeout, on each rank's own clock. Every rank
reads the same rows, so all drop the scale-up together and none enters the admission that
another skips. The commit point is the pass whose verdict is ENTER, where upstream's admission
begins (``scale_progress._grow``; its phase leaves ``waiting_for_cohort``): a cancel that
arrives after it is refused. What upstream's admission and commit leave ends the machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.core.agreement import AbortReason
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_up_machine import ScaleUpMachine
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state, scale_timeout_s, state_manager

logger = get_logger(__name__)

_STATE_ATTR = "_sglang_eep_scale_up"
# The scale request's ``new_ep_size`` that asks the schedulers to cancel the pending scale-up
# (no EP size is 0, so upstream never sees it as a size).
CANCEL_EP_SIZE = 0


@dataclass
class ScaleUpState:
    machine: ScaleUpMachine | None = None  # this rank's side of the latest scale-up
    last_cancelled: int | None = None  # the target of the last scale-up called off by a cancel


def scale_up_state(state: Any) -> ScaleUpState:
    return attached_state(state, _STATE_ATTR, ScaleUpState)


def scale_up_machine(state: Any, timeout_s: float | None = None,
                     now: float | None = None) -> ScaleUpMachine | None:
    """The machine of the scale-up pending on this rank, built on first sight; None when no
    scale-up is pending. A machine built now waits ``timeout_s`` for the joiners
    (``--elastic-ep-scale-timeout`` when None)."""
    target = state.pending_ep_size
    if target is None or target <= state.effective_ep_size:
        return None
    now = time.monotonic() if now is None else now
    up = scale_up_state(state)
    machine = up.machine
    if machine is None or machine.new_size != target or machine.done:
        since = getattr(state, "pending_since", None)
        machine = ScaleUpMachine(old_size=int(state.effective_ep_size), new_size=int(target),
                                 started_at=since if since is not None else now,
                                 timeout_s=scale_timeout_s() if timeout_s is None else timeout_s)
        up.machine = machine
    _follow_upstream(machine, state, now)
    return machine


def _follow_upstream(machine: ScaleUpMachine, state: Any, now: float) -> None:
    # Upstream leaves waiting_for_cohort when its admission begins (``begin_scale``), on the
    # agreed pass: from then on the scale-up is past its commit point.
    if machine.waiting and state.scale_phase != Phase.WAITING_FOR_COHORT.value:
        machine.entered(now)


def request_cancel(state: Any) -> tuple[bool, str]:
    """A cancel reached this scheduler: ``(accepted, message)``. Accepted while a scale-up
    waits for its joiners; refused once it committed, or when there is none."""
    target = state.pending_ep_size
    if target is None:
        last = scale_up_state(state).last_cancelled
        if last is not None:
            return True, f"the scale-up to {last} is already cancelled"
        return False, (f"no scale-up is pending (EP size {state.effective_ep_size}, phase "
                       f"{state.scale_phase}): it has committed or ended")
    if target <= state.effective_ep_size:
        return False, (f"a scale-down to {target} is draining and cannot be cancelled; it "
                       "commits once the leaving ranks are drained (or at the drain timeout)")
    machine = scale_up_machine(state)
    assert machine is not None  # a scale-up is pending
    accepted, message = machine.request_cancel()
    if accepted:
        logger.info("[elastic-ep] cancel of the scale-up to %d requested", target)
    return accepted, message


def abort_reason(state: Any, timeout_s: float | None = None,
                 now: float | None = None) -> AbortReason:
    """Whether this rank calls its pending scale-up off on this pass, and why."""
    machine = scale_up_machine(state, timeout_s, now)
    if machine is None:
        return AbortReason.NONE
    return machine.abort_reason(time.monotonic() if now is None else now)


def settle(state: Any) -> Phase | None:
    """After upstream's step: the phase this rank's scale-up ended in on this pass, if any."""
    machine = scale_up_state(state).machine
    if machine is None or machine.done:
        return None
    now = time.monotonic()
    _follow_upstream(machine, state, now)
    pending = state.pending_ep_size is not None and state.pending_ep_size > \
        state.effective_ep_size
    return machine.observe(int(state.effective_ep_size), pending, now)


def abort_pending_scale(runner: Any, state: Any, reason: AbortReason, detail: str) -> None:
    """The verdict was ABORT: drop this rank's pending scale-up, as upstream does when one
    fails (its EPLB re-armed, the tokenizer told), and serve on at the old size. ``reason``
    is the verdict's, whichever rank's row carried it: a rank whose copy of the cancel is still
    on its way records the cancel too, and answers it as done when it arrives."""
    machine = scale_up_machine(state)
    if machine is None or not machine.waiting:
        return  # nothing of this rank's to drop (it has not seen the request yet)
    message = machine.call_off(reason, detail, time.monotonic())
    state_manager().fail_scale(message)
    if reason is AbortReason.CANCELLED:
        scale_up_state(state).last_cancelled = machine.new_size
    runner._reset_eplb_after_elastic_scale_failure()
    runner._report_elastic_scale_failure(message, int(state.effective_ep_size))
    logger.warning("[elastic-ep] %s; serving on at EP size %d", message, state.effective_ep_size)

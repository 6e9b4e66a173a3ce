"""Calling off a pending scale-up on every rank on the same pass: cancelled, or timed out.

A cancel reaches each scheduler on its own pass (``DELETE /scale_elastic_ep/{id}`` sends one
message to every scheduler), and a timeout expires on each rank's own clock. Either way a rank
only marks its proposal (the ``abort`` column of the gather row, ``core.agreement``); every rank
reads the same rows, so all drop the scale together, and none enters the admission that
another skips. The commit point is the pass whose verdict is ENTER: a cancel that arrives after
it finds no pending scale and is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.core.agreement import AbortReason, StepKind
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state, state_manager

logger = get_logger(__name__)

_STATE_ATTR = "_sglang_eep_scale_abort"
# The scale request's ``new_ep_size`` that asks the schedulers to cancel the pending scale-up
# (no EP size is 0, so upstream never sees it as a size).
CANCEL_EP_SIZE = 0


@dataclass
class ScaleAbortState:
    cancel_target: int | None = None  # the pending target a cancel request named
    last_cancelled: int | None = None  # the target of the last scale called off by a cancel


def scale_abort_state(state: Any) -> ScaleAbortState:
    return attached_state(state, _STATE_ATTR, ScaleAbortState)


def request_cancel(state: Any) -> tuple[bool, str]:
    """A cancel reached this scheduler: ``(accepted, message)``. Accepted while a scale-up
    waits for its joiners; refused once it committed, or when there is none."""
    abort = scale_abort_state(state)
    target = state.pending_ep_size
    if target is None:
        if abort.last_cancelled is not None:
            return True, f"the scale-up to {abort.last_cancelled} is already cancelled"
        return False, (f"no scale-up is pending (EP size {state.effective_ep_size}, phase "
                       f"{state.scale_phase}): it has committed or ended")
    if target <= state.effective_ep_size:
        return False, (f"a scale-down to {target} is draining and cannot be cancelled; it "
                       "commits once the leaving ranks are drained (or at the drain timeout)")
    if state.scale_phase != Phase.WAITING_FOR_COHORT.value:
        return False, f"the scale-up to {target} is past its commit point ({state.scale_phase})"
    abort.cancel_target = target
    logger.info("[elastic-ep] cancel of the scale-up to %d requested", target)
    return True, f"cancel of the scale-up to {target} requested"


def abort_reason(state: Any, kind: StepKind, target: int, timeout_s: float,
                 now: float | None = None) -> AbortReason:
    """Whether this rank calls its pending scale-up off on this pass, and why."""
    if kind is not StepKind.GROW or not target:
        return AbortReason.NONE
    if scale_abort_state(state).cancel_target == target:
        return AbortReason.CANCELLED
    since = getattr(state, "pending_since", None)
    now = time.monotonic() if now is None else now
    if since is not None and timeout_s > 0 and now - since > timeout_s:
        return AbortReason.TIMED_OUT
    return AbortReason.NONE


def abort_pending_scale(runner: Any, state: Any, reason: AbortReason, detail: str) -> None:
    """The verdict was ABORT: drop this rank's pending scale-up, as upstream does when one
    fails (its EPLB re-armed, the tokenizer told), and serve on at the old size. ``reason``
    is the verdict's, whichever rank's row carried it: a rank whose copy of the cancel is still
    on its way records the cancel too, and answers it as done when it arrives."""
    abort = scale_abort_state(state)
    target = state.pending_ep_size
    cancelled = reason is AbortReason.CANCELLED
    abort.cancel_target = None
    if target is None or target <= state.effective_ep_size:
        return  # nothing of this rank's to drop (it has not seen the request yet)
    message = (f"scale-up to {target} cancelled" if cancelled
               else f"scale-up to {target} called off: {detail}")
    state_manager().fail_scale(message)
    if cancelled:
        abort.last_cancelled = target
    runner._reset_eplb_after_elastic_scale_failure()
    runner._report_elastic_scale_failure(message, int(state.effective_ep_size))
    logger.warning("[elastic-ep] %s; serving on at EP size %d", message, state.effective_ep_size)

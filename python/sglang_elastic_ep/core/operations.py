"""Registry of scale operations: admission (idempotency, conflicts), phases, history.

Admission order (first match wins):

| situation                                              | status | accepted |
|--------------------------------------------------------|--------|----------|
| expected_instance_id given and not ours                | 412    | no       |
| operation_id known, same target                        | 200    | yes (replayed, no new op) |
| operation_id known, different target                   | 409    | no       |
| another operation is running                           | 409    | no       |
| validation refused the target                          | 400/409| no       |
| target equals current size                             | 200    | yes (no-op)   |
| otherwise                                              | 200    | yes, operation started |

Refusals are not recorded, so a client may fix its request and retry with the same id.
The registry never raises HTTP errors; it returns an ``Admission`` for the adapter to send.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from sglang_elastic_ep.core.api_models import (
    OperationKind,
    OperationResult,
    OperationStatus,
    PhaseTimestamp,
    RejectionReason,
    SafeToTerminateEvent,
    ScaleCancelledEvent,
    ScaleCommittedEvent,
    ScaleFailedEvent,
    ScaleRequest,
    ScaleRequestedEvent,
    ScaleResponse,
    StatusResponse,
)
from sglang_elastic_ep.core.events import EventLog
from sglang_elastic_ep.core.membership import Membership
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.validation import ScaleDirection, ScaleVerdict

_FIRST_PHASE = {
    OperationKind.SCALE_UP: Phase.WAITING_FOR_COHORT,
    OperationKind.SCALE_DOWN: Phase.DRAINING,
    OperationKind.NOOP: Phase.IDLE,
}
_SUCCESS_PHASE = {
    OperationKind.SCALE_UP: Phase.SERVING_EXPANDED,
    OperationKind.SCALE_DOWN: Phase.SERVING_CONTRACTED,
}
_KIND_BY_DIRECTION = {
    ScaleDirection.UP: OperationKind.SCALE_UP,
    ScaleDirection.DOWN: OperationKind.SCALE_DOWN,
    ScaleDirection.NOOP: OperationKind.NOOP,
}


@dataclass
class Operation:
    operation_id: str
    kind: OperationKind
    old_ep_size: int
    new_ep_size: int
    started_at: float
    message: str  # the answer given at admission, repeated verbatim on replay
    ranks: tuple[int, ...] = ()  # joining (up) or leaving (down)
    phase_stamps: list[PhaseTimestamp] = field(default_factory=list)
    result: OperationResult = OperationResult.RUNNING
    finished_at: float | None = None
    error: str | None = None

    @property
    def phase(self) -> Phase:
        return self.phase_stamps[-1].phase

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def to_status(self) -> OperationStatus:
        return OperationStatus(
            operation_id=self.operation_id,
            kind=self.kind,
            old_ep_size=self.old_ep_size,
            new_ep_size=self.new_ep_size,
            phase=self.phase,
            phase_timestamps=list(self.phase_stamps),
            started_at=self.started_at,
            finished_at=self.finished_at,
            duration_s=self.duration_s,
            result=self.result,
            error=self.error,
        )


@dataclass(frozen=True)
class Admission:
    status: int
    accepted: bool
    message: str
    old_ep_size: int
    new_ep_size: int
    phase: Phase
    operation_id: str | None
    operation: Operation | None = None  # a copy; None for refusals
    started: bool = False  # True only when this call created a new running operation
    replayed: bool = False
    reason: RejectionReason | None = None

    def to_response(self, instance_id: str) -> ScaleResponse:
        return ScaleResponse(
            message=self.message,
            accepted=self.accepted,
            old_ep_size=self.old_ep_size,
            new_ep_size=self.new_ep_size,
            phase=self.phase,
            operation_id=self.operation_id,
            instance_id=instance_id,
            replayed=self.replayed,
            reason=self.reason,
        )


class UnknownOperation(KeyError):
    pass


class OperationRegistry:
    """Thread-safe: HTTP handlers admit, the scheduler side reports phases and results."""

    def __init__(
        self,
        instance_id: str,
        *,
        history_size: int = 20,
        events: EventLog | None = None,
        clock: Callable[[], float] = time.time,
        new_operation_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.instance_id = instance_id
        self._events = events
        self._clock = clock
        self._new_operation_id = new_operation_id
        self._lock = threading.Lock()
        self._current: Operation | None = None
        # Finished operations, newest last; also the idempotency window for operation ids.
        self._history: deque[Operation] = deque(maxlen=history_size)
        self._last_error: str | None = None

    # --- admission ----------------------------------------------------------------------

    def admit(
        self,
        request: ScaleRequest,
        verdict: ScaleVerdict,
        *,
        current_size: int,
    ) -> Admission:
        """Decide what to answer ``request``; start an operation when it is accepted.

        ``verdict`` is ``validate_scale(request.target_ep_size, ...)`` computed by the caller
        against the same ``current_size``.
        """
        target = request.target_ep_size
        with self._lock:
            current_phase = self._current_phase_locked()
            refusal = self._precheck_locked(request, target, current_size, current_phase)
            if refusal is not None:
                return refusal
            if not verdict.ok:
                return Admission(
                    status=verdict.status,
                    accepted=False,
                    message=verdict.message,
                    old_ep_size=current_size,
                    new_ep_size=target,
                    phase=current_phase,
                    operation_id=request.operation_id,
                    reason=verdict.reason,
                )
            assert verdict.direction is not None
            kind = _KIND_BY_DIRECTION[verdict.direction]
            if kind is OperationKind.NOOP and request.operation_id is None:
                return Admission(
                    status=int(HTTPStatus.OK),
                    accepted=True,
                    message=verdict.message,
                    old_ep_size=current_size,
                    new_ep_size=target,
                    phase=current_phase,
                    operation_id=None,
                )
            now = self._clock()
            op = Operation(
                operation_id=request.operation_id or self._new_operation_id(),
                kind=kind,
                old_ep_size=current_size,
                new_ep_size=target,
                started_at=now,
                message=verdict.message,
                ranks=verdict.joining_ranks or verdict.leaving_ranks,
                phase_stamps=[PhaseTimestamp(phase=_FIRST_PHASE[kind], at=now)],
            )
            if kind is OperationKind.NOOP:
                # Recorded so that the id keeps its meaning for later retries.
                op.result = OperationResult.SUCCEEDED
                op.finished_at = now
                op.phase_stamps[0] = PhaseTimestamp(phase=current_phase, at=now)
                self._history.append(op)
            else:
                self._current = op
                if self._events is not None:
                    self._events.emit(
                        ScaleRequestedEvent,
                        operation_id=op.operation_id,
                        old_ep_size=op.old_ep_size,
                        new_ep_size=op.new_ep_size,
                        ranks=list(op.ranks),
                    )
            return Admission(
                status=int(HTTPStatus.OK),
                accepted=True,
                message=op.message,
                old_ep_size=current_size,
                new_ep_size=target,
                phase=op.phase,
                operation_id=op.operation_id,
                operation=copy.deepcopy(op),
                started=kind is not OperationKind.NOOP,
            )

    def _precheck_locked(
        self, request: ScaleRequest, target: int, current_size: int, current_phase: Phase
    ) -> Admission | None:
        def refuse(status: HTTPStatus, reason: RejectionReason, message: str) -> Admission:
            return Admission(
                status=int(status),
                accepted=False,
                message=message,
                old_ep_size=current_size,
                new_ep_size=target,
                phase=current_phase,
                operation_id=request.operation_id,
                reason=reason,
            )

        if (
            request.expected_instance_id is not None
            and request.expected_instance_id != self.instance_id
        ):
            return refuse(
                HTTPStatus.PRECONDITION_FAILED,
                RejectionReason.INSTANCE_MISMATCH,
                f"this server is instance {self.instance_id}, not "
                f"{request.expected_instance_id}: it restarted or you reached another server; "
                "re-read GET /elastic_ep/status and retry with its instance_id",
            )
        if request.operation_id is not None:
            known = self._find_locked(request.operation_id)
            if known is not None:
                if known.new_ep_size != target:
                    return refuse(
                        HTTPStatus.CONFLICT,
                        RejectionReason.OPERATION_ID_REUSED,
                        f"operation_id {known.operation_id} was already used for target "
                        f"{known.new_ep_size}; use a new operation_id for target {target}",
                    )
                return self._replay_locked(known)
        running = self._current
        if running is not None:
            return refuse(
                HTTPStatus.CONFLICT,
                RejectionReason.OPERATION_IN_PROGRESS,
                f"operation {running.operation_id} ({running.old_ep_size} -> "
                f"{running.new_ep_size}) is in phase {running.phase.value}; wait until "
                "GET /elastic_ep/status shows it finished, then retry",
            )
        return None

    def _replay_locked(self, op: Operation) -> Admission:
        message = op.message
        if op.result is OperationResult.FAILED:
            message += (
                f" (operation {op.operation_id} has since failed: {op.error}; "
                "retry with a new operation_id)"
            )
        elif op.result is OperationResult.CANCELLED:
            message += (
                f" (operation {op.operation_id} was cancelled; retry with a new operation_id)"
            )
        return Admission(
            status=int(HTTPStatus.OK),
            accepted=True,
            message=message,
            old_ep_size=op.old_ep_size,
            new_ep_size=op.new_ep_size,
            phase=op.phase,
            operation_id=op.operation_id,
            operation=copy.deepcopy(op),
            replayed=True,
        )

    def _find_locked(self, operation_id: str) -> Operation | None:
        if self._current is not None and self._current.operation_id == operation_id:
            return self._current
        for op in self._history:
            if op.operation_id == operation_id:
                return op
        return None

    # --- progress -----------------------------------------------------------------------

    def record_phase(self, operation_id: str, phase: Phase) -> None:
        """Note that the running operation entered ``phase`` (repeats are ignored)."""
        with self._lock:
            op = self._running_locked(operation_id)
            if op.phase is not phase:
                op.phase_stamps.append(PhaseTimestamp(phase=phase, at=self._clock()))

    def finish(
        self, operation_id: str, *, error: str | None = None, failed_in: Phase | None = None,
        cancelled: bool = False,
    ) -> Operation:
        """End the running operation: committed when ``error`` is None, failed otherwise;
        ``cancelled``: called off before its commit point (``error`` says how)."""
        with self._lock:
            op = self._running_locked(operation_id)
            now = self._clock()
            op.finished_at = now
            if cancelled:
                op.result = OperationResult.CANCELLED
                op.error = error or "cancelled"
            elif error is None:
                op.result = OperationResult.SUCCEEDED
                success_phase = _SUCCESS_PHASE[op.kind]
                if op.phase is not success_phase:
                    op.phase_stamps.append(PhaseTimestamp(phase=success_phase, at=now))
            else:
                failed_in = failed_in or op.phase
                op.result = OperationResult.FAILED
                op.error = error
                op.phase_stamps.append(PhaseTimestamp(phase=Phase.FAILED, at=now))
                self._last_error = error
            self._current = None
            self._history.append(op)
            self._emit_finish_locked(op, failed_in)
            return copy.deepcopy(op)

    def _emit_finish_locked(self, op: Operation, failed_in: Phase | None) -> None:
        if self._events is None:
            return
        if op.result is OperationResult.SUCCEEDED:
            self._events.emit(
                ScaleCommittedEvent,
                operation_id=op.operation_id,
                old_ep_size=op.old_ep_size,
                new_ep_size=op.new_ep_size,
                duration_s=op.duration_s or 0.0,
                ranks=list(op.ranks),
            )
            if op.kind is OperationKind.SCALE_DOWN:
                self._events.emit(
                    SafeToTerminateEvent, operation_id=op.operation_id, ranks=list(op.ranks)
                )
        elif op.result is OperationResult.CANCELLED:
            self._events.emit(
                ScaleCancelledEvent,
                operation_id=op.operation_id,
                old_ep_size=op.old_ep_size,
                new_ep_size=op.new_ep_size,
                ranks=list(op.ranks),
            )
        else:
            self._events.emit(
                ScaleFailedEvent,
                operation_id=op.operation_id,
                old_ep_size=op.old_ep_size,
                new_ep_size=op.new_ep_size,
                failed_in=failed_in or Phase.FAILED,
                error=op.error or "",
                ranks=list(op.ranks),
            )

    def cancel_refusal(self, operation_id: str) -> tuple[int, str] | None:
        """Why ``DELETE`` of ``operation_id`` cannot call it off (an HTTP status and a message
        naming what works instead), or None: it is the running scale-up. A cancelled
        operation is answered as done again (idempotent): the caller checks that first."""
        with self._lock:
            op = self._find_locked(operation_id)
            if op is None:
                return int(HTTPStatus.NOT_FOUND), (
                    f"no operation {operation_id} is known to this instance; "
                    "GET /elastic_ep/status lists the current and recent ones")
            if op.result is OperationResult.SUCCEEDED:
                return int(HTTPStatus.CONFLICT), (
                    f"operation {operation_id} has committed ({op.old_ep_size} -> "
                    f"{op.new_ep_size}); to undo it, POST /scale_elastic_ep with new_ep_size "
                    f"{op.old_ep_size}")
            if op.result is OperationResult.FAILED:
                return int(HTTPStatus.CONFLICT), (
                    f"operation {operation_id} has already failed ({op.error}); nothing "
                    "changed, so there is nothing to cancel")
            if op.result is OperationResult.RUNNING and op.kind is not OperationKind.SCALE_UP:
                return int(HTTPStatus.CONFLICT), (
                    f"operation {operation_id} is a scale-down, which cannot be cancelled: "
                    "it commits once its ranks are drained; then POST /scale_elastic_ep with "
                    f"new_ep_size {op.old_ep_size} to grow back")
            return None

    def _running_locked(self, operation_id: str) -> Operation:
        op = self._current
        if op is None or op.operation_id != operation_id:
            running = op.operation_id if op else "none"
            raise UnknownOperation(f"operation {operation_id} is not running (running: {running})")
        return op

    # --- reads --------------------------------------------------------------------------

    @property
    def current(self) -> Operation | None:
        with self._lock:
            return copy.deepcopy(self._current)

    @property
    def last_error(self) -> str | None:
        with self._lock:
            return self._last_error

    def history(self) -> list[Operation]:
        """Finished operations, newest first."""
        with self._lock:
            return [copy.deepcopy(op) for op in reversed(self._history)]

    def get(self, operation_id: str) -> Operation | None:
        with self._lock:
            found = self._find_locked(operation_id)
            return copy.deepcopy(found) if found is not None else None

    def current_phase(self) -> Phase:
        """Phase of the running operation, else the outcome of the last real one, else idle."""
        with self._lock:
            return self._current_phase_locked()

    def _current_phase_locked(self) -> Phase:
        if self._current is not None:
            return self._current.phase
        for op in reversed(self._history):
            if op.kind is not OperationKind.NOOP:
                return op.phase
        return Phase.IDLE

    def status(self, membership: Membership) -> StatusResponse:
        """Body of GET /elastic_ep/status from this registry plus the rank membership."""
        with self._lock:
            return StatusResponse(
                instance_id=self.instance_id,
                phase=self._current_phase_locked(),
                effective_ep_size=membership.serving_size,
                pending_ep_size=membership.pending_size,
                max_ep_size=membership.max_size,
                ranks=membership.rank_statuses(),
                safe_to_terminate_ranks=sorted(membership.safe_to_terminate),
                current_operation=self._current.to_status() if self._current else None,
                recent_operations=[op.to_status() for op in reversed(self._history)],
                last_error=self._last_error,
            )

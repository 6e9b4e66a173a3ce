"""The seam between the HTTP API and the engine.

``ControlPlane`` is what the routes, the webhook and the metrics see. ``InProcessControlPlane``
implements it on top of the pure core (``OperationRegistry``, ``EventLog``, ``Membership``,
``RankHealthMonitor``) and talks to the engine through two narrow paths:

- down: an injectable async ``engine`` callback, awaited once per started operation (the lead
  wires it to SGLang's schedulers over ZMQ); it should return once the schedulers have the
  order, not when the operation is done;
- up: ``record_phase()``, ``finish_operation()``, ``report_rank_joined()``,
  ``report_rank_failed()``, ``report_recovery_required()``, ``report_rank_recovered()``,
  ``report_recovery_phase()`` and ``observe_health()``, called as the engine makes progress.

Everything is thread-safe, so the up-calls may come from a ZMQ receive thread or from the
HTTP server's event loop. Nothing here imports SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sglang_elastic_ep.core.api_models import (
    CancelResponse,
    HealthResponse,
    OperationKind,
    OperationResult,
    RankFailedEvent,
    RankJoinedEvent,
    RankPosition,
    RankRecoveredEvent,
    RankState,
    RecoveryRequiredEvent,
    SafeToTerminateEvent,
    ScaleRequest,
    ScaleResponse,
    StallStatus,
    StatusResponse,
)
from sglang_elastic_ep.core.events import EventLog
from sglang_elastic_ep.core.health import HealthConfig, RankHealthMonitor, RecoveryRequired
from sglang_elastic_ep.core.membership import Membership
from sglang_elastic_ep.core.operations import Admission, Operation, OperationRegistry
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.stall import (
    describe_positions,
    outlasted_count_out,
    ranks_to_end,
    stall_action,
)
from sglang_elastic_ep.core.validation import (
    ScaleTopology,
    ScaleVerdict,
    judge_with_holes,
    resolve_removal,
    validate_scale,
)

if TYPE_CHECKING:
    from sglang_elastic_ep.api.metrics import ElasticEPMetrics

logger = logging.getLogger(__name__)

# Awaited with the operation that admission just started (a copy: id, kind, sizes, ranks).
EngineCallback = Callable[[Operation], Awaitable[None]]
# Asks the engine to call the running scale-up off: ``(accepted, message)``; accepted when
# every scheduler took the cancel before the operation's commit point.
CancelCallback = Callable[[Operation], Awaitable[tuple[bool, str]]]
CANCEL_WAIT_S = 30.0  # how long DELETE waits for the schedulers to drop the scale (then 202)

# Phases of the recovery machine that the status shows while no scale operation runs.
RECOVERY_PHASES = frozenset(
    {
        Phase.ISOLATING_FAULT,
        Phase.SERVING_DEGRADED,
        Phase.REJOINING,
        Phase.RESTORING_EXPERTS,
        Phase.SERVING_RECOVERED,
    }
)


@dataclass(frozen=True)
class CancelAnswer:
    """What ``DELETE /scale_elastic_ep/{operation_id}`` sends back."""

    status: int
    response: CancelResponse


@dataclass(frozen=True)
class ScaleAnswer:
    """What ``POST /scale_elastic_ep`` sends back: an HTTP status and the body."""

    status: int
    response: ScaleResponse
    started: bool = False  # this request created a new running operation


class EngineRefusal(ValueError):
    """The engine checked the request against its own state (e.g. where experts live) and it
    cannot be done: answered 422 with the message, and nothing changes."""


@runtime_checkable
class ControlPlane(Protocol):
    """What the HTTP adapters need from the engine side."""

    @property
    def instance_id(self) -> str: ...

    @property
    def events(self) -> EventLog: ...

    async def request_scale(self, request: ScaleRequest) -> ScaleAnswer: ...

    async def cancel_operation(self, operation_id: str) -> CancelAnswer: ...

    def status(self) -> StatusResponse: ...

    def health(self) -> HealthResponse: ...


class InProcessControlPlane:
    """Registry + event log + membership + health, driven by an injectable engine callback."""

    def __init__(
        self,
        *,
        topology: ScaleTopology,
        initial_ep_size: int,
        engine: EngineCallback | None = None,
        canceller: CancelCallback | None = None,
        instance_id: str | None = None,
        events: EventLog | None = None,
        history_size: int = 20,
        event_capacity: int = 1024,
        health_config: HealthConfig | None = None,
        metrics: ElasticEPMetrics | None = None,
        clock: Callable[[], float] = time.time,
        new_operation_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        refill_timeout_s: float | None = None,
    ) -> None:
        self._instance_id = instance_id or uuid.uuid4().hex
        self._topology = topology
        self._engine = engine
        self._canceller = canceller
        self._cancelling: set[str] = set()  # running operations a DELETE is calling off
        self._holes_removed: set[str] = set()  # started removals of failed ranks below the tail
        self._hole_refills: set[str] = set()  # running scale-ups into removed ranks' holes
        # A refill waits for relaunches no scheduler step bounds: it fails after this long.
        self._refill_timeout_s = refill_timeout_s
        self._clock = clock
        self._events = events or EventLog(self._instance_id, capacity=event_capacity, clock=clock)
        if self._events.instance_id != self._instance_id:
            raise ValueError(
                f"event log instance {self._events.instance_id} != control plane "
                f"instance {self._instance_id}"
            )
        self._registry = OperationRegistry(
            self._instance_id,
            history_size=history_size,
            events=self._events,
            clock=clock,
            new_operation_id=new_operation_id,
        )
        self._membership = Membership(max_size=topology.max_ep_size, effective_size=initial_ep_size)
        self._health = RankHealthMonitor(range(initial_ep_size), health_config)
        self._health_snapshot: HealthResponse | None = None
        self._placement: dict[int, list[int]] | None = None
        self._slots: dict[int, list[int]] = {}
        self._rebalances: list[int] = []
        self._recovery_phase: Phase | None = None
        self._stalled: StallStatus | None = None
        self._metrics = metrics
        # Guards membership, health and the recovery phase; never held across an await.
        self._lock = threading.RLock()
        self.refresh_metrics()

    # --- ControlPlane -------------------------------------------------------------------

    @property
    def instance_id(self) -> str:
        return self._instance_id

    @property
    def events(self) -> EventLog:
        return self._events

    @property
    def registry(self) -> OperationRegistry:
        return self._registry

    @property
    def topology(self) -> ScaleTopology:
        return self._topology

    @property
    def membership(self) -> Membership:
        with self._lock:
            return self._membership

    async def request_scale(self, request: ScaleRequest) -> ScaleAnswer:
        """Validate and admit ``request``; hand a started operation to the engine."""
        with self._lock:
            admission = self._admit_locked(request)
            if admission.started:
                assert admission.operation is not None
                self._apply_start_locked(admission.operation)
                self._recovery_phase = None  # the new operation's phases take over
            failed = self._membership.failed
        answer = ScaleAnswer(
            status=admission.status,
            response=admission.to_response(self._instance_id),
            started=admission.started,
        )
        if not admission.started:
            return answer
        self.refresh_metrics()
        op = admission.operation
        assert op is not None
        if op.operation_id in self._holes_removed and frozenset(op.ranks) <= failed:
            # Failed ranks removed below the tail: nothing runs on the schedulers, which
            # already serve without them (and take a relaunch of them back in place). Live
            # ones drain and leave through the engine, as a scale-down does.
            done = self.finish_operation(op.operation_id)
            return ScaleAnswer(status=answer.status, started=True, response=answer.response
                               .model_copy(update={"phase": done.phase}))
        if op.operation_id in self._hole_refills:
            # The schedulers take the relaunched ranks back in place by themselves; the
            # operation commits when the HTTP process sees them serve (report_rank_recovered).
            return answer
        if self._engine is None:
            return answer
        try:
            await self._engine(op)
        except Exception as exc:  # noqa: BLE001 - any engine failure fails the operation
            refused = isinstance(exc, EngineRefusal)
            if refused:  # the request itself cannot be done here: the client's to change
                logger.warning("elastic EP: engine refused operation %s: %s",
                               op.operation_id, exc)
                error = f"the engine refused the operation: {exc}"
            else:
                logger.exception("elastic EP: engine failed to start operation %s",
                                 op.operation_id)
                error = f"the engine could not start the operation: {type(exc).__name__}: {exc}"
            self.finish_operation(op.operation_id, error=error)
            body = answer.response.model_copy(
                update={
                    "accepted": False,
                    "phase": Phase.FAILED,
                    "message": (
                        f"{error}; operation {op.operation_id} is recorded as failed and "
                        "nothing changed: check the server log, then retry with a new "
                        "operation_id"
                    ),
                }
            )
            status = HTTPStatus.UNPROCESSABLE_ENTITY if refused else HTTPStatus.SERVICE_UNAVAILABLE
            return ScaleAnswer(status=int(status), response=body)
        return answer

    def _admit_locked(self, request: ScaleRequest) -> Admission:
        """The registry's answer to ``request`` against the membership now (the lock held)."""
        m = self._membership
        current = m.serving_size
        verdict: ScaleVerdict | None = None
        if request.remove_ranks is not None:
            known = self._registry.get(request.operation_id) \
                if request.operation_id is not None else None
            if known is not None and sorted(known.ranks) == request.remove_ranks:
                request = request.as_size(known.new_ep_size)  # a retry: the registry replays
            else:
                resolved = resolve_removal(
                    request.remove_ranks, m.effective_size, failed=m.failed_in_range(),
                    launch_size=self._topology.launch_size, removed=m.removed,
                    attn_replica_size=self._topology.attn_replica_size,
                    min_size=self._topology.min_ep_size,
                    ranks_per_node=self._topology.ranks_per_node)
                if isinstance(resolved, int):
                    request = request.as_size(resolved - len(m.removed))
                elif resolved.ok:
                    request = request.as_size(current - len(resolved.leaving_ranks))
                    verdict = resolved
                else:
                    refusal = Admission(
                        status=resolved.status, accepted=False, message=resolved.message,
                        old_ep_size=current, new_ep_size=current,
                        phase=self._registry.current_phase(),
                        operation_id=request.operation_id, reason=resolved.reason)
                    return refusal
        if verdict is None:
            verdict = judge_with_holes(request.target_ep_size, current, m.removed) \
                or validate_scale(request.target_ep_size, current_size=current,
                                  topology=self._topology, failed_ranks=m.failed)
        admission = self._registry.admit(request, verdict, current_size=current)
        if admission.started:
            assert admission.operation is not None
            if verdict.leaves_holes:
                self._holes_removed.add(admission.operation.operation_id)
            if verdict.refills_holes:
                self._hole_refills.add(admission.operation.operation_id)
        return admission

    async def cancel_operation(self, operation_id: str, *,
                               wait_s: float = CANCEL_WAIT_S) -> CancelAnswer:
        """Call off a scale-up that has not committed; idempotent."""
        def answer(status: int, cancelled: bool, message: str) -> CancelAnswer:
            op = self._registry.get(operation_id)
            return CancelAnswer(status, CancelResponse(
                message=message, cancelled=cancelled, operation_id=operation_id,
                instance_id=self._instance_id, operation=op.to_status() if op else None,
            ))

        known = self._registry.get(operation_id)
        if known is not None and known.result is OperationResult.CANCELLED:
            return answer(int(HTTPStatus.OK), True, f"operation {operation_id} is cancelled")
        refusal = self._registry.cancel_refusal(operation_id)
        if refusal is not None:
            return answer(refusal[0], False, refusal[1])
        assert known is not None
        with self._lock:  # a refill's relaunch or timeout may end it meanwhile
            refill = operation_id in self._hole_refills
            if refill:  # nothing was sent to the schedulers
                self._cancelling.add(operation_id)
                self.finish_operation(operation_id, error="cancelled before the removed ranks "
                                      "rejoined")
        if refill:
            return answer(int(HTTPStatus.OK), True,
                          f"operation {operation_id} is cancelled; EP size stays "
                          f"{known.old_ep_size}, and ranks {list(known.ranks)} stay removed "
                          "(a relaunch of them still rejoins in place)")
        if self._canceller is None:
            return answer(int(HTTPStatus.NOT_IMPLEMENTED), False,
                          "this server has no engine to cancel with")
        self._cancelling.add(operation_id)
        try:
            accepted, message = await self._canceller(known)
        except Exception as exc:  # noqa: BLE001 - the schedulers did not answer: nothing sent
            self._cancelling.discard(operation_id)
            logger.exception("elastic EP: cancel of %s failed", operation_id)
            return answer(int(HTTPStatus.SERVICE_UNAVAILABLE), False,
                          f"the schedulers did not take the cancel ({type(exc).__name__}: "
                          f"{exc}); retry the DELETE")
        if not accepted:
            self._cancelling.discard(operation_id)
            return answer(int(HTTPStatus.CONFLICT), False,
                          f"{message}; GET /elastic_ep/status shows how it ends")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            op = self._registry.get(operation_id)
            if op is not None and op.result is not OperationResult.RUNNING:
                break
            await asyncio.sleep(0.1)
        op = self._registry.get(operation_id)
        if op is not None and op.result is OperationResult.CANCELLED:
            return answer(int(HTTPStatus.OK), True,
                          f"operation {operation_id} is cancelled; EP size stays "
                          f"{op.old_ep_size}, and the ranks it was waiting for "
                          f"({list(op.ranks)}) are safe to terminate")
        if op is not None and op.result is OperationResult.RUNNING:
            return answer(int(HTTPStatus.ACCEPTED), False,
                          f"cancel of {operation_id} requested; the schedulers drop it on a "
                          "coming pass: GET /elastic_ep/status, or DELETE again")
        result = op.result.value if op is not None else "unknown"
        return answer(int(HTTPStatus.CONFLICT), False,
                      f"operation {operation_id} ended as {result} before the cancel took")

    def expire_overdue_refill(self) -> Operation | None:
        """Fail the running refill of removed ranks' holes once its timeout has passed without
        every relaunch serving (called periodically); the failed operation, or None."""
        with self._lock:  # the check and the end at once: a relaunch may commit it meanwhile
            op = self._registry.current
            timeout = self._refill_timeout_s
            if (op is None or op.operation_id not in self._hole_refills or timeout is None
                    or self._clock() < op.started_at + timeout):
                return None
            missing = sorted(set(op.ranks) & self._membership.removed)
            return self.finish_operation(op.operation_id, error=(
                f"no relaunch of removed ranks {missing} served within "
                f"{timeout:g} s (--elastic-ep-scale-timeout): EP size stays "
                f"{op.old_ep_size} and the ranks stay removed; relaunch them with their original "
                "arguments plus --ep-join-mode recover (they rejoin in place), or POST "
                f"new_ep_size {op.new_ep_size} again"))

    def status(self) -> StatusResponse:
        with self._lock:
            status = self._registry.status(self._membership)
            if status.current_operation is None and self._recovery_phase is not None:
                status = status.model_copy(update={"phase": self._recovery_phase})
            placement, effective = self._placement, self._membership.effective_size
            slots, rebalances = dict(self._slots), list(self._rebalances)
        # A placement reported for another size is stale (the poll runs every few seconds):
        # show none until the engine reports the current one.
        if placement and len(placement) == effective:
            ranks = [
                r.model_copy(update={"experts": placement.get(r.rank),
                                     "expert_slots": slots.get(r.rank)})
                if r.rank < effective else r
                for r in status.ranks
            ]
            status = status.model_copy(update={"ranks": ranks})
        if rebalances:
            status = status.model_copy(update={"eplb_rebalances": rebalances})
        stalled = self._stalled
        if stalled is not None:
            status = status.model_copy(update={"stalled": stalled.model_copy(
                update={"phase": status.phase})})
        return status

    def report_expert_placement(
        self,
        experts_by_rank: Mapping[int, list[int]],
        slots_by_rank: Mapping[int, list[int]] | None = None,
        rebalances: Iterable[int] = (),
    ) -> None:
        """The engine's current placement (logical experts per rank, and the expert in each
        slot) and the EP size at each EPLB rebalance so far, shown in the status."""
        with self._lock:
            self._placement = {int(r): list(e) for r, e in experts_by_rank.items()}
            self._slots = {int(r): list(e) for r, e in (slots_by_rank or {}).items()}
            self._rebalances = [int(size) for size in rebalances]

    def health(self) -> HealthResponse:
        with self._lock:
            health = (self._health_snapshot if self._health_snapshot is not None
                      else self._health.to_response(self._instance_id))
            stalled = self._stalled
        if stalled is not None:
            health = health.model_copy(update={"stalled": stalled})
        return health

    def observe_stall(self, since: float | None, waiting_requests: int,
                      positions: list[RankPosition] | None = None,
                      count_out_s: float | None = None) -> None:
        """The stall watch's verdict (``core.stall``): stalled since ``since``, or not, and
        where each scheduler is (``positions``). With no request waiting, the verdict came from
        the positions alone (a scheduler stuck in a pass of an idle server). ``count_out_s``:
        how long Mooncake takes to count a silent member out (``mooncake_count_out_s``)."""
        if since is None:
            if self._stalled is not None:
                logger.warning("elastic EP: serving resumed after a stall of %.0f s",
                               self._clock() - self._stalled.since)
                self._stalled = None
                self.refresh_metrics()
            return
        now = self._clock()
        phase = self.status().phase
        positions = positions or []
        where = describe_positions(positions)
        if waiting_requests > 0:
            what = (f"{waiting_requests} requests wait and no scheduler has answered for "
                    f"{now - since:.0f} s")
        else:
            what = (f"no request waits, but a scheduler has been in one step of a pass for "
                    f"{now - since:.0f} s")
        serving = [r.rank for r in self.status().ranks
                   if r.state in (RankState.ACTIVE, RankState.LEAVING)]
        counted_out = outlasted_count_out(now - since, count_out_s)
        # Rank 0's server hosts the HTTP server: its ranks are named only when nothing else
        # frees them.
        apart = self._topology.ranks_per_node
        to_end = ranks_to_end(positions, serving, own_from=apart, counted_out=counted_out)
        if self._stalled is None:
            logger.warning("elastic EP: serving stalled: %s (phase %s): %s", what, phase.value,
                           where)
        self._stalled = StallStatus(
            since=since, stalled_s=round(now - since, 3), waiting_requests=waiting_requests,
            phase=phase, ranks=positions, count_out_s=count_out_s,
            ranks_to_relaunch=sorted(to_end),
            message=(f"{what} (phase {phase.value}): {where}. A scheduler is stuck, often in a "
                     "collective whose peer never came; the schedulers' stacks (py-spy dump) "
                     f"show where. {stall_action(to_end, apart)}"),
        )
        self.refresh_metrics()

    # --- engine -> control plane --------------------------------------------------------

    def record_phase(self, operation_id: str, phase: Phase) -> None:
        """The running operation entered ``phase`` (repeats are ignored)."""
        self._registry.record_phase(operation_id, phase)
        self.refresh_metrics()

    def finish_operation(
        self,
        operation_id: str,
        *,
        error: str | None = None,
        failed_in: Phase | None = None,
        safe_to_terminate: Iterable[int] | None = None,
    ) -> Operation:
        """End the running operation: committed when ``error`` is None, failed otherwise.

        Membership follows: a committed scale-up makes ``[old, new)`` active, a committed
        scale-down releases ``[new, old)`` (listed as safe to terminate); a failed operation
        leaves the old size. ``safe_to_terminate`` overrides which ranks may be deleted; by
        default a committed scale-down's leaving ranks and a failed scale-up's joining ranks
        (they never became part of the serving group).
        """
        # One critical section with admission: no request may see the registry idle while
        # the membership still shows the finished operation.
        cancelled = error is not None and operation_id in self._cancelling
        self._cancelling.discard(operation_id)
        leaves_holes = operation_id in self._holes_removed
        self._holes_removed.discard(operation_id)
        refills_holes = operation_id in self._hole_refills
        self._hole_refills.discard(operation_id)
        with self._lock:
            op = self._registry.finish(operation_id, error=error, failed_in=failed_in,
                                       cancelled=cancelled)
            release: frozenset[int]
            if safe_to_terminate is not None:
                release = frozenset(safe_to_terminate)
            elif op.kind is OperationKind.SCALE_DOWN and error is None:
                release = frozenset(op.ranks)
            elif op.kind is OperationKind.SCALE_UP and error is not None:
                release = frozenset(op.ranks)
            else:
                release = frozenset()
            m = self._membership
            if error is None and leaves_holes:
                m = replace(m, leaving=frozenset(), failed=m.failed - frozenset(op.ranks),
                            removed=m.removed | frozenset(op.ranks))
            elif refills_holes:  # the ranks left ``removed`` as they rejoined
                m = replace(m, pending_size=None)
            elif error is None and op.kind is OperationKind.SCALE_UP:
                m = replace(m, effective_size=op.new_ep_size, pending_size=None)
            elif error is None and op.kind is OperationKind.SCALE_DOWN:
                launch = self._topology.launch_size
                if launch is not None and op.new_ep_size < launch:
                    # The released launch-time slots leave the launch-time groups for good, as
                    # on the schedulers: joiners that refill them count as scale-joined.
                    self._topology = replace(self._topology, launch_size=op.new_ep_size)
                m = replace(
                    m,
                    effective_size=op.new_ep_size,
                    leaving=frozenset(),
                    failed=frozenset(r for r in m.failed if r < op.new_ep_size),
                )
            else:
                m = replace(m, pending_size=None, leaving=frozenset())
            m = replace(m, safe_to_terminate=m.safe_to_terminate | release)
            self._membership = m
            if not m.failed_in_range():
                self._recovery_phase = None  # e.g. the failed tail rank was scaled away
            self._health.set_ranks(m.managed_ranks())
            for rank in op.ranks:
                self._health.clear(rank)
        # The registry already announced a committed scale-down's leaving ranks.
        announced = frozenset(op.ranks) if op.kind is OperationKind.SCALE_DOWN and not error else ()
        extra = sorted(release - frozenset(announced))
        if extra:
            self._events.emit(SafeToTerminateEvent, operation_id=op.operation_id, ranks=extra)
        if self._metrics is not None:
            self._metrics.observe_operation(op.to_status())
        self.refresh_metrics()
        return op

    def report_rank_joined(self, ranks: Iterable[int], operation_id: str | None = None) -> None:
        """Joining ranks connected (before the commit); informational."""
        self._events.emit(RankJoinedEvent, operation_id=operation_id, ranks=sorted(ranks))

    def report_rank_failed(
        self, ranks: Iterable[int], reason: str, operation_id: str | None = None
    ) -> None:
        """Ranks in ``[0, effective)`` died or were isolated; they stay failed until recovered."""
        failed = sorted(set(ranks))
        with self._lock:
            m = replace(self._membership, failed=self._membership.failed | frozenset(failed))
            launch = self._topology.launch_size or m.effective_size
            tail = m.failed_tail(launch)
            taken_in = frozenset() if tail is None else m.removed & frozenset(tail.ranks)
            if taken_in:  # awaited again: no longer holes, nor safe to delete
                m = replace(m, failed=m.failed | taken_in, removed=m.removed - taken_in,
                            safe_to_terminate=m.safe_to_terminate - taken_in)
                self._health.set_ranks(m.managed_ranks())
            self._membership = m
            if self._recovery_phase in (None, Phase.SERVING_RECOVERED):
                # Until the engine says more precisely (isolating_fault, rejoining, ...).
                self._recovery_phase = Phase.SERVING_DEGRADED
        self._events.emit(
            RankFailedEvent, operation_id=operation_id, ranks=failed, reason=reason
        )
        if taken_in:
            assert tail is not None
            self._events.emit(
                RankFailedEvent, operation_id=operation_id, ranks=sorted(taken_in),
                reason=(f"removed where they were, and every rank above them has failed: the "
                        f"survivors let ranks {tail.first}..{tail.effective_size - 1} go as "
                        "one failed tail; relaunch them all with --elastic-ep-join-mode "
                        f"recover from --elastic-ep-join-rank-offset {tail.first}"
                        + ("" if m.removed else f", or scale down to {tail.first}")),
            )
        self.refresh_metrics()

    def observe_rank_liveness(self, down: Iterable[int], reason: str) -> None:
        """The engine's latest liveness view (``down``: ranks it no longer talks to).

        Ranks inside the effective size that went down become ``rank_failed``; the health
        monitor counts the check (``GET /elastic_ep/health``) and hard-blocks a rank dead for
        ``dead_rank_threshold`` checks, which emits ``recovery_required`` once. Failed ranks that
        are up again become ``rank_recovered``. Ranks outside the effective size (not joined
        yet, or scaled away) are ignored.
        """
        down_set = frozenset(down)
        with self._lock:
            m = self._membership
            newly_failed = sorted(
                r for r in down_set
                if r < m.effective_size and r not in m.failed and r not in m.leaving
                and r not in m.removed
            )
            back = sorted(r for r in m.failed | m.removed if r not in down_set)
            self._health_snapshot = None
            decision = self._health.observe(
                alive={r: r not in down_set for r in m.managed_ranks() if r not in m.leaving},
                expert_latency={},
                expert_rank={},
            )
        if newly_failed:
            self.report_rank_failed(newly_failed, reason=reason)
        if decision is not None:
            self.report_recovery_required(decision.ranks, decision.reason)
        if back:
            self.report_rank_recovered(back)

    def report_recovery_required(
        self,
        ranks: Iterable[int],
        reason: str,
        *,
        suggested_action: str | None = None,
        operation_id: str | None = None,
    ) -> None:
        """Tell orchestrators to relaunch ``ranks`` in recover mode or to scale them away."""
        decision = RecoveryRequired(ranks=tuple(sorted(set(ranks))), reason=reason)
        self._events.emit(
            RecoveryRequiredEvent,
            operation_id=operation_id,
            ranks=list(decision.ranks),
            reason=reason,
            suggested_action=suggested_action or decision.suggested_action,
        )

    def report_rank_recovered(
        self, ranks: Iterable[int], operation_id: str | None = None
    ) -> None:
        """Replacements for failed ranks joined, or refilled removed ranks' slots; they serve
        again."""
        recovered = sorted(set(ranks))
        with self._lock:
            m = self._membership
            back = frozenset(recovered)
            self._membership = replace(
                m, failed=m.failed - back, removed=m.removed - back,
                safe_to_terminate=m.safe_to_terminate - (back & m.removed))
            self._health.set_ranks(self._membership.managed_ranks())
            for rank in recovered:
                self._health.clear(rank)
            if not self._membership.failed_in_range():
                self._recovery_phase = Phase.SERVING_RECOVERED
            refill = self._registry.current
            refilled = (refill is not None and refill.operation_id in self._hole_refills
                        and not set(refill.ranks) & self._membership.removed)
        self._events.emit(RankRecoveredEvent, operation_id=operation_id, ranks=recovered)
        if refilled:
            assert refill is not None
            with self._lock:  # unless its timeout or a cancel ended it meanwhile
                if refill.operation_id in self._hole_refills:
                    self.finish_operation(refill.operation_id)
        self.refresh_metrics()

    def report_recovery_phase(self, phase: Phase | None) -> None:
        """Phase of the recovery machine; status shows it until the next operation starts.

        ``report_rank_recovered()`` sets ``serving_recovered`` by itself once no rank is
        failed; None clears it (status falls back to the last operation's outcome).
        """
        if phase is not None and phase not in RECOVERY_PHASES:
            raise ValueError(f"{phase.value} is not a recovery phase")
        with self._lock:
            self._recovery_phase = phase
        self.refresh_metrics()

    def set_membership(self, membership: Membership) -> None:
        """Replace the membership with the engine's view (e.g. after a restart)."""
        if membership.max_size != self._topology.max_ep_size:
            raise ValueError(
                f"membership max_size {membership.max_size} != --max-ep-size "
                f"{self._topology.max_ep_size}"
            )
        with self._lock:
            self._membership = membership
            self._health.set_ranks(membership.managed_ranks())
        self.refresh_metrics()

    def forget_safe_to_terminate(self, ranks: Iterable[int]) -> None:
        """The orchestrator deleted these released ranks; stop listing them."""
        with self._lock:
            m = self._membership
            self._membership = replace(m, safe_to_terminate=m.safe_to_terminate - set(ranks))

    def observe_health(
        self,
        *,
        alive: Mapping[int, bool],
        expert_latency: Mapping[int, float | None],
        expert_rank: Mapping[int, int],
    ) -> RecoveryRequired | None:
        """One health check; emits ``recovery_required`` for newly hard-blocked ranks."""
        with self._lock:
            self._health_snapshot = None
            decision = self._health.observe(
                alive=alive, expert_latency=expert_latency, expert_rank=expert_rank
            )
        if decision is not None:
            self.report_recovery_required(decision.ranks, decision.reason)
        return decision

    def set_health_snapshot(self, health: HealthResponse) -> None:
        """Use a health report computed elsewhere (e.g. in the scheduler) until the next one."""
        if health.instance_id != self._instance_id:
            health = health.model_copy(update={"instance_id": self._instance_id})
        with self._lock:
            self._health_snapshot = health

    # --- internals ----------------------------------------------------------------------

    def _apply_start_locked(self, op: Operation) -> None:
        m = self._membership
        if op.kind is OperationKind.SCALE_UP:
            self._membership = replace(
                m,
                pending_size=op.new_ep_size,
                safe_to_terminate=m.safe_to_terminate - frozenset(op.ranks),
            )
        elif op.kind is OperationKind.SCALE_DOWN:
            self._membership = replace(m, leaving=frozenset(op.ranks))

    def refresh_metrics(self) -> None:
        """Push the current status to the metrics (call every few seconds: degraded time)."""
        if self._metrics is not None:
            self._metrics.update_from_status(self.status())

"""The engine port the control plane drives: SGLang's own tokenizer -> scheduler path.

A scale (up or down) is handed to upstream's ``TokenizerManager.scale_elastic_ep``; a watcher
mirrors the schedulers' phase (reported back to the tokenizer) into the operation until it
commits or fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from sglang_elastic_ep.api.control_plane import EngineRefusal
from sglang_elastic_ep.core.api_models import OperationKind
from sglang_elastic_ep.core.operations import Operation
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.routing import LiveShardRouter
from sglang_elastic_ep.sglang.http_state import HttpAdapterState
from sglang_elastic_ep.sglang.removal_request import removal_size
from sglang_elastic_ep.sglang.scale_up import CANCEL_EP_SIZE
from sglang_elastic_ep.sglang.tokenizer_hooks import abort_with_503

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
SCHEDULER_ANSWER_TIMEOUT_S = 60.0  # every live scheduler answers a scale request at once
# The schedulers' scale_phase (as the tokenizer reports it) -> the operation's phase.
UPSTREAM_PHASES = {p.value: p for p in Phase}


def phase_of(state: dict[str, Any]) -> Phase | None:
    """The operation phase of the schedulers' ``scale_phase`` in the tokenizer's state."""
    return UPSTREAM_PHASES.get(str(state.get("scale_phase")))


LOST_TO_DRAIN_TIMEOUT = (
    "the scale-down drained DP shard {shard} (EP ranks leaving) and this request was still "
    "running after --elastic-ep-drain-timeout ({timeout:g} s); it was ended, nothing more "
    "will be returned for it: retry the request"
)


class UpstreamEngine:
    """Starts operations through SGLang's tokenizer manager and watches them to the end.

    A scale-up is upstream's. A scale-down first stops routing to the leaving shards (here, in
    the tokenizer's router), then hands the request to the schedulers, which commit it once
    the leaving shards hold no request (sglang/scale_down.py); requests still running there
    after ``--elastic-ep-drain-timeout`` are ended with 503 and a message. A removal of live
    ranks below the tail drains the same way (sglang/rank_removal.py); its shards then stay
    out of routing as holes until their relaunches serve. A scale-down that
    removes failed ranks (the only one validation admits while they are failed) asks only the
    live schedulers and drains nothing (sglang/tail_recovery.py)."""

    def __init__(self, tokenizer_manager: Any, adapter: HttpAdapterState) -> None:
        # The adapter state, not the plane: the plane is built with this engine, and set on the
        # state right after. Its router is the one the tokenizer hooks route with.
        self._tm = tokenizer_manager
        self._adapter = adapter
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def _router(self) -> LiveShardRouter:
        return self._adapter.router

    def _shards(self, ranks: Iterable[int]) -> frozenset[int]:
        """The DP shards (attention replicas) of ``ranks``."""
        replica = int(getattr(self._tm, "attn_replica_size", 1) or 1)
        return frozenset(r // replica for r in ranks)

    @staticmethod
    def _removes_below_the_tail(op: Operation) -> bool:
        """A scale-down whose ranks are not the tail: live launch-time ranks removed where
        they are (validation admits no other such scale-down through the engine)."""
        return (op.kind is OperationKind.SCALE_DOWN
                and tuple(sorted(op.ranks)) != tuple(range(op.new_ep_size, op.old_ep_size)))

    @staticmethod
    def _request_size(op: Operation) -> int:
        """The ``new_ep_size`` the schedulers are sent for ``op``."""
        if UpstreamEngine._removes_below_the_tail(op):
            return removal_size(op.ranks)
        return op.new_ep_size

    async def __call__(self, op: Operation) -> None:
        if op.kind not in (OperationKind.SCALE_UP, OperationKind.SCALE_DOWN):
            raise NotImplementedError(
                f"{op.kind.value} is not available in this build of sglang-elastic-ep"
            )
        from sglang.srt.managers.io_struct import ScaleElasticEPReqInput

        leaving: frozenset[int] = frozenset()
        drain = False
        dead: frozenset[int] = frozenset()
        if op.kind is OperationKind.SCALE_DOWN:
            leaving = self._shards(op.ranks)
            # Validation admits a scale-down over failed ranks when it removes exactly them
            # (nothing of theirs is left to drain), or when it reaches past failed
            # scale-joined ranks below live ones (those live ones drain). Failed schedulers
            # cannot answer: only the live ones are awaited.
            failed = self._adapter.control_plane().membership.failed
            dead = self._shards(failed & frozenset(op.ranks))
            drain = leaving != dead
            if dead:
                self._tm.update_control_communicator_fan_out(
                    int(self._tm.elastic_worker_count) - len(dead))
            if drain:
                self._router.start_drain(leaving, down=dead)  # stop new work first
        try:
            result = await asyncio.wait_for(
                self._tm.scale_elastic_ep(
                    ScaleElasticEPReqInput(new_ep_size=self._request_size(op),
                                           rid=op.operation_id)
                ),
                SCHEDULER_ANSWER_TIMEOUT_S,
            )
        except asyncio.TimeoutError:
            self._undo(op, restore_fan_out=bool(dead))
            raise RuntimeError(
                f"the schedulers did not answer within {SCHEDULER_ANSWER_TIMEOUT_S:g} s"
            ) from None
        if dead and drain:  # the drain confirmation and the commit set their own fan-out
            self._tm.update_control_communicator_fan_out(int(self._tm.elastic_worker_count))
        if not result.success:
            self._undo(op, restore_fan_out=bool(dead) and not drain)
            if op.kind is OperationKind.SCALE_DOWN:
                raise EngineRefusal(result.message)
            raise RuntimeError(result.message)
        task = asyncio.get_running_loop().create_task(self._watch(op, leaving, drain))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def cancel(self, op: Operation) -> tuple[bool, str]:
        """Ask every scheduler to call ``op`` (a scale-up not yet committed) off; they drop it
        together on a coming pass (``scale_up``), and ``_watch`` then sees it end."""
        from sglang.srt.managers.io_struct import ScaleElasticEPReqInput

        answers = await asyncio.wait_for(
            self._tm.scale_elastic_ep_communicator(
                ScaleElasticEPReqInput(new_ep_size=CANCEL_EP_SIZE, rid=op.operation_id)
            ),
            SCHEDULER_ANSWER_TIMEOUT_S,
        )
        refused = [a.message for a in answers if not a.success]
        if refused:
            return False, refused[0]
        return True, answers[0].message if answers else "cancel requested"

    def _undo(self, op: Operation, *, restore_fan_out: bool) -> None:
        """A refused or unanswered request changes nothing here either."""
        self._router.stop_draining()
        if op.kind is OperationKind.SCALE_DOWN and restore_fan_out:
            self._tm.update_control_communicator_fan_out(self._tm.elastic_worker_count)

    @property
    def _drain_timeout_s(self) -> float:
        return float(getattr(self._tm.server_args, "elastic_ep_drain_timeout", 120.0))

    def _end_drain_stragglers(self, leaving: frozenset[int]) -> int:
        timeout = self._drain_timeout_s
        ended = 0
        for shard, rids in self._router.still_running(leaving, self._tm.rid_to_state).items():
            abort_with_503(self._tm, rids,
                           LOST_TO_DRAIN_TIMEOUT.format(shard=shard, timeout=timeout))
            ended += len(rids)
        return ended

    async def _confirm_drain(self, op: Operation) -> None:
        """Every request routed to a leaving shard has ended: say so to the schedulers (the
        same request again, past upstream's pending check), so a leaving rank can commit.
        A shard that died during the drain cannot answer: only the live ones are awaited. A
        dead leaving one: the others commit without it (its gather row is blank). A dead
        staying one: the others have called the scale-down off, and say so."""
        from sglang.srt.managers.io_struct import ScaleElasticEPReqInput

        workers = int(self._tm.elastic_worker_count)
        dead = self._router.leaving_down | self._router.down
        live = sum(1 for shard in range(workers) if shard not in dead)
        if live != workers:
            self._tm.update_control_communicator_fan_out(live)
        try:
            answers = await self._answers_unless_decided(
                self._tm.scale_elastic_ep_communicator(
                    ScaleElasticEPReqInput(new_ep_size=self._request_size(op),
                                           rid=op.operation_id)
                ))
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"the drain confirmation got no answer from {live} schedulers within "
                f"{SCHEDULER_ANSWER_TIMEOUT_S:g} s (leaving shards seen down: {sorted(dead)})"
            ) from None
        finally:
            if live != workers:  # the commit sets the new size's fan-out itself
                self._tm.update_control_communicator_fan_out(int(self._tm.elastic_worker_count))
        if answers is None:
            logger.warning("elastic EP: the schedulers ended scale-down %s before every answer "
                           "to its drain confirmation arrived (a leaving rank exited or died "
                           "right after answering)", op.operation_id)
            return
        refused = [a.message for a in answers if not a.success]
        if refused:
            raise RuntimeError(f"drain confirmation refused: {refused[0]}")

    def _phase(self) -> Phase | None:
        return phase_of(self._tm.get_elastic_ep_state())

    async def _answers_unless_decided(self, answers: Any) -> list[Any] | None:
        """The schedulers' answers to a drain confirmation, or None once their reported phase
        changes to one that ends the operation (committed or failed) first: they act on the
        confirmation they received, and an answer lost with a rank that exited right after
        sending it must not hold the operation for ``SCHEDULER_ANSWER_TIMEOUT_S`` and fail a
        scale-down that committed. Only a change counts: a phase left over from an earlier
        operation is no decision on this one."""
        task = asyncio.ensure_future(answers)
        before = self._phase()
        deadline = time.monotonic() + SCHEDULER_ANSWER_TIMEOUT_S
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=WATCH_INTERVAL_S)
                if done:
                    return task.result()
                phase = self._phase()
                if phase != before and phase in (Phase.SERVING_CONTRACTED, Phase.FAILED):
                    return None
                if time.monotonic() > deadline:
                    raise asyncio.TimeoutError
        finally:
            if not task.done():
                task.cancel()

    def _why_failed(self, exc: Exception) -> str:
        """The error of a scale-down whose drain confirmation failed: the schedulers' own
        reason when they called it off meanwhile (a staying rank died before the HTTP process
        saw it, so the confirmation waited for it), else ``exc``."""
        state = self._tm.get_elastic_ep_state()
        if phase_of(state) is Phase.FAILED \
                and state.get("last_error"):
            return str(state["last_error"])
        return str(exc)

    async def _watch(self, op: Operation, leaving: frozenset[int], drain: bool) -> None:
        plane = self._adapter.control_plane()
        operation_id = op.operation_id
        draining = drain and bool(leaving)
        drain_deadline = time.monotonic() + self._drain_timeout_s if draining else None
        last = None
        while True:
            state = self._tm.get_elastic_ep_state()
            phase = phase_of(state)
            if draining:
                running = self._router.still_running(leaving, self._tm.rid_to_state)
                if not any(running.values()):
                    draining = False
                    try:
                        await self._confirm_drain(op)
                    except Exception as exc:  # the schedulers never commit without it
                        self._router.stop_draining()
                        plane.finish_operation(operation_id, error=self._why_failed(exc))
                        return
                elif drain_deadline is not None and time.monotonic() > drain_deadline:
                    drain_deadline = None  # once; the ended requests then leave rid_to_state
                    ended = self._end_drain_stragglers(leaving)
                    logger.warning("elastic EP: drain timeout (%g s) for shards %s: ended %d "
                                   "requests with 503", self._drain_timeout_s, sorted(leaving),
                                   ended)
            if phase is not None and phase != last and phase not in (Phase.IDLE,):
                last = phase
                if phase is Phase.SERVING_EXPANDED:
                    joined = range(op.old_ep_size, op.new_ep_size)
                    plane.report_rank_joined(joined, operation_id=operation_id)
                    plane.finish_operation(operation_id)
                    return
                if phase is Phase.SERVING_CONTRACTED:
                    if self._removes_below_the_tail(op):
                        self._router.retire(leaving)  # holes: no request until refilled
                    else:
                        self._router.forget(leaving)
                    plane.finish_operation(operation_id)
                    return
                if phase is Phase.FAILED:
                    self._router.stop_draining()
                    plane.finish_operation(operation_id, error=state.get("last_error") or "failed")
                    return
                try:
                    plane.record_phase(operation_id, phase)
                except Exception:  # an illegal jump in the mirror is not worth failing over
                    logger.debug("elastic EP: phase %s not recorded", phase, exc_info=True)
            await asyncio.sleep(WATCH_INTERVAL_S)

"""Mounts the orchestrator contract on SGLang's FastAPI app (HTTP server process only).

The control plane (operation ids, status, events, health) lives here; the engine underneath is
SGLang's own tokenizer -> scheduler path. A scale (up or down) is handed to upstream's
``TokenizerManager.scale_elastic_ep``; a watcher mirrors the schedulers' phase (reported back to
the tokenizer) into the operation until it commits or fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from sglang_elastic_ep.api.control_plane import EngineRefusal, InProcessControlPlane
from sglang_elastic_ep.core.api_models import OperationKind
from sglang_elastic_ep.core.health import HealthConfig
from sglang_elastic_ep.core.operations import Operation
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.routing import LiveShardRouter
from sglang_elastic_ep.core.validation import ScaleTopology

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
SCHEDULER_ANSWER_TIMEOUT_S = 60.0  # every live scheduler answers a scale request at once
_UPSTREAM_PHASES = {p.value: p for p in Phase}

_plane: InProcessControlPlane | None = None
_router = LiveShardRouter()
_last_status: tuple[bool, ...] | None = None  # the shard liveness last acted on
LOST_WITH_SHARD = (
    "the DP shard running this request (EP ranks {ranks}) failed before it finished; nothing "
    "was returned for it: retry the request"
)


def control_plane() -> InProcessControlPlane | None:
    """The process's control plane (None unless elastic EP is on and the server started)."""
    return _plane


def topology_from_args(
    server_args: Any, replica_size: int | None = None
) -> tuple[ScaleTopology, int]:
    """(topology, launch EP size): with DP attention one EP rank per TP rank.

    ``replica_size`` is the tokenizer manager's own ``attn_replica_size`` (attn TP x attn CP,
    what upstream's scale validation uses) when known: the HTTP process's server args do not
    always carry the resolved attention-DP degree (seen: 2-rank DP attention read as one
    2-rank replica, refusing 2 -> 3)."""
    ep_size = int(server_args.tp_size)
    if replica_size is None:
        # 0.5.23 keeps the attention-DP degree in attn_dp_size (--dp is a deprecated alias).
        attn_dp = int(getattr(server_args, "attn_dp_size", None) or server_args.dp_size or 1)
        replica_size = max(1, ep_size // attn_dp)
    replica = int(replica_size)
    max_ep = int(server_args.max_ep_size or ep_size)
    return ScaleTopology(max_ep_size=max_ep, attn_replica_size=replica), ep_size


LOST_TO_DRAIN_TIMEOUT = (
    "the scale-down drained DP shard {shard} (EP ranks leaving) and this request was still "
    "running after --elastic-ep-drain-timeout ({timeout:g} s); it was ended, nothing more "
    "will be returned for it: retry the request"
)


def _abort_with_503(tokenizer_manager: Any, rids: list[str], message: str) -> None:
    from sglang.srt.managers.io_struct import AbortReq

    for rid in rids:
        tokenizer_manager._handle_abort_req(AbortReq(
            rid=rid, abort_message=message,
            finished_reason={"type": "abort", "message": message, "status_code": 503},
        ))


class UpstreamEngine:
    """Starts operations through SGLang's tokenizer manager and watches them to the end.

    A scale-up is upstream's. A scale-down first stops routing to the leaving shards (here, in
    the tokenizer's router), then hands the request to the schedulers, which commit it once
    the leaving shards hold no request (sglang/scale_down.py); requests still running there
    after ``--elastic-ep-drain-timeout`` are ended with 503 and a message. A scale-down that
    removes failed ranks (the only one validation admits while they are failed) asks only the
    live schedulers and drains nothing (sglang/tail_recovery.py)."""

    def __init__(self, tokenizer_manager: Any, plane_ref: list[InProcessControlPlane]) -> None:
        self._tm = tokenizer_manager
        self._plane_ref = plane_ref
        self._watchers: set[asyncio.Task[None]] = set()

    def _leaving_shards(self, op: Operation) -> frozenset[int]:
        replica = int(getattr(self._tm, "attn_replica_size", 1) or 1)
        return frozenset(r // replica for r in range(op.new_ep_size, op.old_ep_size))

    async def __call__(self, op: Operation) -> None:
        if op.kind not in (OperationKind.SCALE_UP, OperationKind.SCALE_DOWN):
            raise NotImplementedError(
                f"{op.kind.value} is not available in this build of sglang-elastic-ep"
            )
        from sglang.srt.managers.io_struct import ScaleElasticEPReqInput

        leaving: frozenset[int] = frozenset()
        drain = False
        if op.kind is OperationKind.SCALE_DOWN:
            leaving = self._leaving_shards(op)
            # Validation admits a scale-down over failed ranks only when it removes exactly
            # them: nothing of theirs is left to drain, and their schedulers cannot answer.
            removing_failed = bool(self._plane_ref[0].membership.failed & frozenset(op.ranks))
            drain = not removing_failed
            if removing_failed:
                replica = int(getattr(self._tm, "attn_replica_size", 1) or 1)
                self._tm.update_control_communicator_fan_out(op.new_ep_size // replica)
            else:
                _router.leaving = leaving  # stop new work first
        try:
            result = await asyncio.wait_for(
                self._tm.scale_elastic_ep(ScaleElasticEPReqInput(new_ep_size=op.new_ep_size)),
                SCHEDULER_ANSWER_TIMEOUT_S,
            )
        except asyncio.TimeoutError:
            self._undo(op, drain)
            raise RuntimeError(
                f"the schedulers did not answer within {SCHEDULER_ANSWER_TIMEOUT_S:g} s"
            ) from None
        if not result.success:
            self._undo(op, drain)
            if op.kind is OperationKind.SCALE_DOWN:
                raise EngineRefusal(result.message)
            raise RuntimeError(result.message)
        task = asyncio.get_running_loop().create_task(self._watch(op, leaving, drain))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _undo(self, op: Operation, drain: bool) -> None:
        """A refused or unanswered request changes nothing here either."""
        _router.leaving = frozenset()
        if op.kind is OperationKind.SCALE_DOWN and not drain:
            self._tm.update_control_communicator_fan_out(self._tm.elastic_worker_count)

    @property
    def _drain_timeout_s(self) -> float:
        return float(getattr(self._tm.server_args, "elastic_ep_drain_timeout", 120.0))

    def _end_drain_stragglers(self, leaving: frozenset[int]) -> int:
        timeout = self._drain_timeout_s
        ended = 0
        for shard, rids in _router.still_running(leaving, self._tm.rid_to_state).items():
            _abort_with_503(self._tm, rids,
                            LOST_TO_DRAIN_TIMEOUT.format(shard=shard, timeout=timeout))
            ended += len(rids)
        return ended

    async def _confirm_drain(self, op: Operation) -> None:
        """Every request routed to a leaving shard has ended: say so to the schedulers (the
        same request again, past upstream's pending check), so a leaving rank can commit."""
        from sglang.srt.managers.io_struct import ScaleElasticEPReqInput

        answers = await asyncio.wait_for(
            self._tm.scale_elastic_ep_communicator(
                ScaleElasticEPReqInput(new_ep_size=op.new_ep_size)
            ),
            SCHEDULER_ANSWER_TIMEOUT_S,
        )
        refused = [a.message for a in answers if not a.success]
        if refused:
            raise RuntimeError(f"drain confirmation refused: {refused[0]}")

    async def _watch(self, op: Operation, leaving: frozenset[int], drain: bool) -> None:
        plane = self._plane_ref[0]
        operation_id = op.operation_id
        draining = drain and bool(leaving)
        drain_deadline = time.monotonic() + self._drain_timeout_s if draining else None
        last = None
        while True:
            state = self._tm.get_elastic_ep_state()
            phase = _UPSTREAM_PHASES.get(str(state.get("scale_phase")))
            if draining:
                running = _router.still_running(leaving, self._tm.rid_to_state)
                if not any(running.values()):
                    draining = False
                    try:
                        await self._confirm_drain(op)
                    except Exception as exc:  # the schedulers never commit without it
                        _router.leaving = frozenset()
                        plane.finish_operation(operation_id, error=str(exc))
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
                    _router.forget(leaving)
                    plane.finish_operation(operation_id)
                    return
                if phase is Phase.FAILED:
                    _router.leaving = frozenset()
                    plane.finish_operation(operation_id, error=state.get("last_error") or "failed")
                    return
                try:
                    plane.record_phase(operation_id, phase)
                except Exception:  # an illegal jump in the mirror is not worth failing over
                    logger.debug("elastic EP: phase %s not recorded", phase, exc_info=True)
            await asyncio.sleep(WATCH_INTERVAL_S)


def apply_scale_update(original: Any, tokenizer_manager: Any, msg: Any) -> Any:
    """AROUND ``TokenizerManager.forward_elastic_scale_update``: rank 0 reports a committed
    scale-down with the smaller size. Upstream only grows (it would hand the DP controller a
    negative slot count), so shrink the worker count and control fan-out here."""
    tm = tokenizer_manager
    replica = int(getattr(tm, "attn_replica_size", 1) or 1)
    if not msg.success or msg.effective_ep_size >= tm.elastic_worker_count * replica:
        return original(tm, msg)
    tm.elastic_worker_count = msg.effective_ep_size // replica
    tm.elastic_pending_ep_size = None
    tm.elastic_scale_phase = Phase.SERVING_CONTRACTED.value
    tm.elastic_last_error = None
    tm.update_control_communicator_fan_out(tm.elastic_worker_count)
    return None


def mirror_active_ranks(result: Any, tokenizer_manager: Any, ranks: Any) -> None:
    """AFTER ``TokenizerManager.update_active_ranks``: schedulers report which DP shards are
    alive after their batches (upstream forwards it to the DP router). The control plane turns
    a shard that went down into ``rank_failed``/``recovery_required`` and its return into
    ``rank_recovered``; requests the dead shard was running end with HTTP 503 and a message
    saying so, instead of waiting forever."""
    global _last_status
    plane = _plane
    # Schedulers report after every batch; only a change means anything.
    status = tuple(bool(up) for up in ranks.status)
    if plane is None or status == _last_status:
        return
    _last_status = status
    replica = int(getattr(tokenizer_manager, "attn_replica_size", 1) or 1)
    down_shards = {shard for shard, up in enumerate(status) if not up}
    down = [shard * replica + i for shard in sorted(down_shards) for i in range(replica)]
    # Leaving shards (a scale-down releasing them) are neither lost (router) nor failed (plane).
    lost = _router.mark_down(down_shards, tokenizer_manager.rid_to_state)
    plane.observe_rank_liveness(
        down, reason="the rank stopped answering its peers (Mooncake/NIXL fault detection)"
    )
    if any(lost.values()):
        for shard, rids in lost.items():
            first, last = shard * replica, shard * replica + replica - 1
            message = LOST_WITH_SHARD.format(ranks=f"{first}..{last}" if last > first else first)
            _abort_with_503(tokenizer_manager, rids, message)
            logger.warning("elastic EP: shard %d failed; ended %d running requests with 503",
                           shard, len(rids))


def route_to_live_shard(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``TokenizerManager._dispatch_to_scheduler``: a generate request not pinned to a
    shard goes round-robin to a live shard chosen here (upstream's DP controller would pick
    the same way), so the tokenizer knows which requests a shard holds if it dies."""
    if _plane is None:
        return
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    if not isinstance(obj, TokenizedGenerateReqInput):
        return
    pinned = getattr(obj, "routed_dp_rank", None)
    if pinned is not None:  # the client chose the shard: keep it, but know it (drain, faults)
        _router.track(int(pinned), obj.rid, tokenizer_manager.rid_to_state)
        return
    shard = _router.pick(int(getattr(tokenizer_manager, "elastic_worker_count", 0) or 0))
    if shard is None:
        return  # no live shard known: upstream's router decides (and refuses)
    obj.routed_dp_rank = shard
    _router.track(shard, obj.rid, tokenizer_manager.rid_to_state)


HEALTH_ANSWER_TIMEOUT_S = 10.0
_cannot_block: set[int] = set()


async def poll_expert_health(tokenizer_manager: Any, plane: InProcessControlPlane) -> None:
    """One health check from rank 0's gathered expert timings (sglang/expert_health.py): the
    monitor marks slow experts and hard-blocks a rank after enough slow checks
    (``recovery_required``); such a rank is then blocked in the data plane, where every expert
    it serves has a replica on another serving rank."""
    from sglang.srt.managers.io_struct import SetInternalStateReq

    from sglang_elastic_ep.core.health import ExpertTimings, blockable_ranks
    from sglang_elastic_ep.core.placement import experts_per_rank
    from sglang_elastic_ep.sglang.expert_health import BLOCKED_RANKS_KEY, REPORT_KEY

    tm = tokenizer_manager
    states = await asyncio.wait_for(tm.get_internal_state(), HEALTH_ANSWER_TIMEOUT_S)
    report = next((s[REPORT_KEY] for s in states if isinstance(s, dict) and REPORT_KEY in s),
                  None)
    if report is None or not report.get("local_slots"):
        return
    timings = ExpertTimings(local_slots=int(report["local_slots"]),
                            ns_per_row=tuple(report["ns_per_row"]), rows=tuple(report["rows"]))
    plane.report_expert_placement(
        experts_per_rank(report["physical_to_logical"], timings.local_slots)
    )
    m = plane.membership
    ranks = [r for r in range(m.effective_size) if r not in m.leaving]
    serving = [r for r in ranks if r not in m.failed]
    latency, owner = timings.for_monitor(ranks)
    plane.observe_health(alive={r: r not in m.failed for r in ranks},
                         expert_latency=latency, expert_rank=owner)
    slow = [r.rank for r in plane.health().ranks if r.hard_blocked and r.rank in serving]
    blocked, kept = blockable_ranks(slow, report["physical_to_logical"],
                                    timings.local_slots, serving)
    for rank, experts in kept.items():
        if rank not in _cannot_block:
            _cannot_block.add(rank)
            logger.warning("elastic EP: rank %d has slow experts but stays in use: logical "
                           "experts %s have no replica on another serving rank", rank, experts)
    mask = sum(1 << r for r in blocked)
    if mask != int(report.get("blocked_ranks_mask", 0)):
        await asyncio.wait_for(
            tm.set_internal_state(SetInternalStateReq(server_args={BLOCKED_RANKS_KEY: mask})),
            HEALTH_ANSWER_TIMEOUT_S,
        )
        logger.warning("elastic EP: ranks %s blocked for slow experts (data plane)",
                       sorted(blocked))


def _start_health_poller(tokenizer_manager: Any, plane: InProcessControlPlane,
                         interval_s: float) -> None:
    """Polls on the tokenizer's event loop (where its communicators live), from a thread."""

    def poll() -> None:
        while True:
            time.sleep(interval_s)
            loop = getattr(tokenizer_manager, "event_loop", None)
            if loop is None:
                continue  # the first request creates it
            try:
                asyncio.run_coroutine_threadsafe(
                    poll_expert_health(tokenizer_manager, plane), loop
                ).result(timeout=3 * HEALTH_ANSWER_TIMEOUT_S)
            except Exception:  # a missed check is retried at the next interval
                logger.debug("elastic EP: expert health poll failed", exc_info=True)

    threading.Thread(target=poll, name="elastic-ep-health", daemon=True).start()


METRICS_REFRESH_S = 5.0


def _start_metrics_refresher(plane: InProcessControlPlane) -> None:
    """Gauges follow every change already; time spent degraded also grows between changes."""

    def refresh() -> None:
        while True:
            time.sleep(METRICS_REFRESH_S)
            try:
                plane.refresh_metrics()
            except Exception:  # a metrics hiccup must never stop the refresher
                logger.debug("elastic EP: metrics refresh failed", exc_info=True)

    threading.Thread(target=refresh, name="elastic-ep-metrics", daemon=True).start()


def mount_on_server(result: Any, global_state: Any) -> None:
    """AFTER ``http_server.set_global_state``: build the control plane and mount the routes."""
    global _plane
    tm = global_state.tokenizer_manager
    server_args = tm.server_args
    if getattr(server_args, "elastic_ep_backend", None) is None or _plane is not None:
        return
    from sglang.srt.entrypoints import http_server

    from sglang_elastic_ep.api.routes import mount_elastic_ep

    topology, ep_size = topology_from_args(server_args, getattr(tm, "attn_replica_size", None))
    metrics = None
    if getattr(server_args, "enable_metrics", False):
        from sglang_elastic_ep.api.metrics import ElasticEPMetrics

        metrics = ElasticEPMetrics()
    ref: list[InProcessControlPlane] = []
    plane = InProcessControlPlane(
        topology=topology, initial_ep_size=ep_size, engine=UpstreamEngine(tm, ref),
        metrics=metrics,
        health_config=HealthConfig(
            latency_threshold=float(getattr(server_args, "elastic_ep_slow_expert_threshold",
                                            3.0)),
            persistence_threshold=int(getattr(server_args, "elastic_ep_slow_expert_checks", 10)),
        ),
    )
    ref.append(plane)
    if metrics is not None:
        _start_metrics_refresher(plane)
    interval = float(getattr(server_args, "elastic_ep_health_interval", 2.0))
    if interval > 0:
        _start_health_poller(tm, plane, interval)
    mount_elastic_ep(
        http_server.app,
        plane,
        api_key=getattr(server_args, "api_key", None),
        admin_api_key=getattr(server_args, "admin_api_key", None),
    )
    url = getattr(server_args, "elastic_ep_webhook_url", None)
    if url:
        from sglang_elastic_ep.api.webhook import WebhookSender

        WebhookSender(plane.events, url).start()
    _plane = plane
    logger.info(
        "elastic EP API mounted: instance %s, ep size %d (max %d)",
        plane.instance_id, ep_size, topology.max_ep_size,
    )

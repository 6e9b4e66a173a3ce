"""Hooks on SGLang's tokenizer manager (HTTP server process): scale updates, shard liveness,
and routing requests to live shards, so the process knows which requests a shard holds.

Each finds the adapter's state on the tokenizer manager (``http_state``) and passes through
when there is none (elastic EP off).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.http_state import adapter_state

logger = logging.getLogger(__name__)

LOST_WITH_SHARD = (
    "the DP shard running this request (EP ranks {ranks}) failed before it finished; nothing "
    "was returned for it: retry the request"
)


def abort_with_503(tokenizer_manager: Any, rids: list[str], message: str) -> None:
    """End the requests ``rids`` with HTTP 503 and ``message`` (retrying them is safe)."""
    from sglang.srt.managers.io_struct import AbortReq

    for rid in rids:
        tokenizer_manager._handle_abort_req(AbortReq(
            rid=rid, abort_message=message,
            finished_reason={"type": "abort", "message": message, "status_code": 503},
        ))


def apply_scale_update(original: Any, tokenizer_manager: Any, msg: Any) -> Any:
    """AROUND ``TokenizerManager.forward_elastic_scale_update``: rank 0 reports a committed
    scale-down with the smaller size, and a committed removal below the tail with the same
    size. Upstream only grows (it would hand the DP controller a negative slot count), so
    shrink the worker count and control fan-out here."""
    tm = tokenizer_manager
    replica = int(getattr(tm, "attn_replica_size", 1) or 1)
    if msg.success and not msg.slot_count \
            and msg.effective_ep_size == tm.elastic_worker_count * replica:
        # Ranks removed below the tail (the size stays, no slot is added): upstream would
        # hand the DP controller an empty scale-up; the holes are the control plane's.
        tm.elastic_pending_ep_size = None
        tm.elastic_scale_phase = Phase.SERVING_CONTRACTED.value
        tm.elastic_last_error = None
        return None
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
    state = adapter_state(tokenizer_manager)
    plane = None if state is None else state.plane
    # Schedulers report after every batch; only a change means anything: of the report, or of
    # the size it is read against (a commit can count in a slot whose rank died on the commit
    # pass, which every report then shows down, the same as before the scale).
    if state is None or plane is None:
        return
    status = tuple(bool(up) for up in ranks.status)
    seen = (status, plane.membership.effective_size)
    if seen == state.last_status:
        return
    state.last_status = seen
    replica = int(getattr(tokenizer_manager, "attn_replica_size", 1) or 1)
    down_shards = {shard for shard, up in enumerate(status) if not up}
    down = [shard * replica + i for shard in sorted(down_shards) for i in range(replica)]
    # Leaving shards (a scale-down releasing them) are neither lost (router) nor failed (plane).
    lost = state.router.mark_down(down_shards, tokenizer_manager.rid_to_state)
    plane.observe_rank_liveness(
        down, reason="the rank stopped answering its peers (Mooncake/NIXL fault detection)"
    )
    if any(lost.values()):
        for shard, rids in lost.items():
            first, last = shard * replica, shard * replica + replica - 1
            message = LOST_WITH_SHARD.format(ranks=f"{first}..{last}" if last > first else first)
            abort_with_503(tokenizer_manager, rids, message)
            logger.warning("elastic EP: shard %d failed; ended %d running requests with 503",
                           shard, len(rids))


def route_to_live_shard(tokenizer_manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``TokenizerManager._dispatch_to_scheduler``: a generate request not pinned to a
    shard goes round-robin to a live shard chosen here (upstream's DP controller would pick
    the same way), so the tokenizer knows which requests a shard holds if it dies."""
    state = adapter_state(tokenizer_manager)
    if state is None or state.plane is None:
        return
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput

    if not isinstance(obj, TokenizedGenerateReqInput):
        return
    router = state.router
    pinned = getattr(obj, "routed_dp_rank", None)
    if pinned is not None:  # the client chose the shard: keep it, but know it (drain, faults)
        router.track(int(pinned), obj.rid, tokenizer_manager.rid_to_state)
        return
    shard = router.pick(int(getattr(tokenizer_manager, "elastic_worker_count", 0) or 0))
    if shard is None:
        return  # no live shard known: upstream's router decides (and refuses)
    obj.routed_dp_rank = shard
    router.track(shard, obj.rid, tokenizer_manager.rid_to_state)

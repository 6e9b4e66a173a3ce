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
3. On the pass where every rank is ready (the lockstep agreement in ``scale_progress``), all
   ranks run ``finalize_scale_down`` together: the expert location metadata shrinks to the
   staying ranks' slots (each rank keeps its number of physical slots, so layouts stay valid),
   the leaving ranks become inactive, Mooncake deactivates them in WORLD, DP attention shrinks,
   and the NIXL data plane is told the new size (it disconnects at the next dispatch).
4. A leaving rank then takes no further part in any collective. When every rank of its
   ``launch_server`` tree leaves (a scale-up joiner, a node above 0), it stops that server,
   which exits 0; a rank whose server keeps other ranks (node 0's tree) parks.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch.distributed as dist

from sglang_elastic_ep.sglang import tail_recovery
from sglang_elastic_ep.sglang.expert_moves import move_experts_off_leaving_ranks, shrink_refusal

logger = logging.getLogger(__name__)

_scheduler: Any = None  # this process's scheduler, for the drain check in the agreement step
_drain_confirmed = False  # the HTTP process saw every request it routed to leaving shards end
_committed_shrink: int | None = None  # the size the last scale-down committed to


def _state_manager() -> Any:
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    return ElasticEPStateManager


def refusal(state: Any, new_ep_size: int) -> str | None:
    """Why this scheduler cannot shrink to ``new_ep_size`` now; None when it can."""
    from sglang.srt.elastic_ep.topology import attn_replica_size
    from sglang.srt.runtime_context import get_parallel

    from sglang_elastic_ep.sglang.scale_progress import _lockstep_agreement_on

    old = state.effective_ep_size
    if not _lockstep_agreement_on(state, get_parallel()):
        # Without the per-pass agreement the ranks could commit on different passes.
        return ("scale-down needs the per-pass rank agreement, which this build runs only "
                "where membership state is in host memory (the CPU engine) and with room to "
                "grow (--max-ep-size above the launch size); not available on this deployment")
    if new_ep_size < 1:
        return f"new_ep_size must be at least 1, got {new_ep_size}"
    replica = attn_replica_size()
    if new_ep_size % replica:
        return (f"new_ep_size ({new_ep_size}) would split an attention replica of {replica} "
                "ranks: choose a multiple of it")
    too_few = too_few_dp_ranks(bool(get_parallel().attn_dp_enabled), new_ep_size, replica)
    if too_few is not None:
        return too_few
    if _state_manager().is_scaling():
        return ("another scale or a recovery is in progress: wait until it finishes "
                "(GET /elastic_ep/status), then retry")
    return shrink_refusal(old, new_ep_size)


def too_few_dp_ranks(attn_dp_enabled: bool, new_ep_size: int, replica: int) -> str | None:
    """Attention DP needs two DP ranks: upstream asserts it on every pass, so a shrink to one
    crashed every scheduler right after its commit (seen: 3 -> 1)."""
    if attn_dp_enabled and new_ep_size // replica < 2:
        return (f"new_ep_size ({new_ep_size}) would leave {new_ep_size // replica} attention DP "
                "rank, and attention DP needs at least 2: keep at least "
                f"{2 * replica} ranks")
    return None


def is_late_drain_confirmation(state: Any, new_ep_size: int) -> bool:
    """The HTTP process's drain confirmation reached this scheduler only after the commit.
    Staying ranks are ready at once and the leaving ones as soon as they read it, so the
    commit can run before a staying rank has read the same message from its socket. Seen: the
    late confirmation was taken for a new request to the current size, refused, and the
    committed scale-down was reported failed."""
    return (state.pending_ep_size is None and _committed_shrink == new_ep_size
            and state.effective_ep_size == new_ep_size)


def handle_scale_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.handle_scale_elastic_ep``: a target below the effective size is a
    scale-down (upstream refuses those); anything else is upstream's scale-up."""
    global _scheduler, _drain_confirmed, _committed_shrink
    _scheduler = scheduler
    manager = _state_manager()
    state = manager.instance()
    new = int(recv_req.new_ep_size)
    if state is not None and new == state.effective_ep_size \
            and tail_recovery.awaiting_replacement() is not None:
        return tail_recovery.remove_failed_slots(scheduler, state, new)
    from sglang.srt.managers.io_struct import ScaleElasticEPReqOutput

    if state is not None and is_late_drain_confirmation(state, new):
        return ScaleElasticEPReqOutput(
            success=True, message=f"scale-down to {new} already committed", old_ep_size=new,
            new_ep_size=new, scale_phase=state.scale_phase,
        )
    if state is None or new >= state.effective_ep_size:
        return original(scheduler, recv_req)

    old = state.effective_ep_size
    if state.pending_ep_size == new and state.scale_phase == "draining":
        # The HTTP process's second message: every request it routed to the leaving shards
        # has finished (or was ended at the drain timeout), so none is still on its way here.
        _drain_confirmed = True
        return ScaleElasticEPReqOutput(
            success=True, message=f"drain of ranks {new}..{old - 1} confirmed",
            old_ep_size=old, new_ep_size=new, pending_ep_size=new, scale_phase="draining",
        )
    error = refusal(state, new)
    if error is not None:
        return ScaleElasticEPReqOutput(success=False, message=error, old_ep_size=old,
                                       new_ep_size=new, scale_phase=state.scale_phase)
    _drain_confirmed = False
    _committed_shrink = None
    state.pending_ep_size = new
    state.scale_phase = "draining"
    state.last_error = None
    state.pending_since = time.monotonic()
    eplb = scheduler.tp_worker.model_runner.eplb_manager
    if eplb is not None:
        eplb.disable_rebalance("elastic EP scale-down is pending")
    logger.info("[elastic-ep] scale-down %d -> %d requested; ranks %s drain first",
                old, new, list(range(new, old)))
    return ScaleElasticEPReqOutput(
        success=True, message=f"Scaling down from {old} to {new}: draining ranks {new}..{old - 1}",
        old_ep_size=old, new_ep_size=new, pending_ep_size=new, scale_phase="draining",
    )


def holds_no_request(scheduler: Any) -> bool:
    running = getattr(scheduler, "running_batch", None)
    return (
        (running is None or running.is_empty())
        and not getattr(scheduler, "waiting_queue", None)
        and getattr(scheduler, "chunked_req", None) is None
    )


def ready_to_shrink(state: Any, rank: int) -> int:
    """The shrink target when this rank can enter the commit now, else 0: staying ranks at
    once, a leaving rank once the HTTP process confirmed the drain (no request of its is on
    the way) and its scheduler holds no request."""
    target = state.pending_ep_size or 0
    if not target or rank < target:
        return target
    drained = _drain_confirmed and _scheduler is not None and holds_no_request(_scheduler)
    return target if drained else 0


def finalize_scale_down(runner: Any, target: int, *, tell_tokenizer: bool = True,
                        move_experts: bool = True) -> None:
    """Every active rank, on the same agreed pass: move experts, switch placement, then let
    the tail go.

    ``tell_tokenizer=False, move_experts=False`` when the tail failed rather than left
    (tail_recovery): nothing can be read from dead ranks (that path checks beforehand that
    the survivors hold every expert), and the HTTP process keeps its size and shows the slots
    failed until their replacement joins."""
    global _committed_shrink
    from mooncake.pg import deactivate_ranks
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_context

    manager = _state_manager()
    state = manager.instance()
    old = state.effective_ep_size
    rank = runner._elastic_global_rank()
    leaving = list(range(target, old))
    staying = rank < target
    runner.forward_pass_id = 0

    # 1. Experts: the staying ranks take every expert only the tail holds (weights move while
    # the leaving ranks are still members); then the leaving ranks' slots leave the map.
    state.scale_phase = "switching_placement"
    if move_experts:
        move_experts_off_leaving_ranks(runner, old, target)
    metadata = get_global_expert_location_metadata()
    if metadata is not None and staying:
        slots = metadata.num_physical_experts // old
        get_context().override("elastic_ep.scale_down", ep_size=target)
        shrunk = ExpertLocationMetadata.init_by_mapping(
            runner.model_config,
            physical_to_logical_map=metadata.physical_to_logical_map[:, : slots * target].clone(),
            moe_ep_rank=rank,
        )
        set_global_expert_location_metadata(shrunk, allow_overwrite=True)
        set_global_expert_distribution_recorder(
            ExpertDistributionRecorder.init_new(shrunk, rank=rank)
        )

    # 2. Ranks: inactive everywhere, then out of WORLD's collectives.
    state.scale_phase = "releasing"
    state.active_ranks[target:] = 0
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    answer = deactivate_ranks(dist.group.WORLD, leaving)
    logger.info("[elastic-ep] rank %d: Mooncake deactivate_ranks(%s): %s, epoch %s", rank,
                leaving, getattr(answer, "status", answer), getattr(answer, "new_epoch", "?"))
    state.effective_ep_size = target
    state.pending_ep_size = None
    state.pending_since = None
    state.has_scaled = True
    state.scale_phase = "serving_contracted" if staying else "released"
    if tell_tokenizer:
        _committed_shrink = target
    if manager._on_scale is not None:  # the NIXL data plane (upstream sets it for nixl only)
        from sglang_elastic_ep.sglang.nixl_buffer_hooks import mark_ranks_drained

        # Agreed this pass: the leaving ranks hold no request, and every rank finished its
        # last dispatch and combine before entering, so no token is in flight to them.
        mark_ranks_drained(leaving)
    manager.on_scale(old, target)  # NIXL: disconnect the tail at the next dispatch

    if not staying:
        logger.info("[elastic-ep] rank %d left (scale-down %d -> %d)", rank, old, target)
        _leave(target)
        return

    from sglang.srt.elastic_ep.elastic_ep import update_dp_attention_for_elastic_ep
    from sglang.srt.elastic_ep.topology import attn_replica_size, physical_ep_size_to_dp_size

    update_dp_attention_for_elastic_ep(physical_ep_size=target, physical_ep_rank=rank)
    if runner.eplb_manager is not None:
        runner.eplb_manager.reset_generator()
        runner._rearm_eplb_after_elastic_scale()
    if rank == 0 and tell_tokenizer:
        from sglang.srt.managers.io_struct import ElasticScaleUpdateReq

        forget_cohorts(range(target, old))
        runner._pending_elastic_scale_update = ElasticScaleUpdateReq(
            success=True, effective_ep_size=target,
            slot_offset=physical_ep_size_to_dp_size(target, attn_replica_size()), slot_count=0,
        )
        logger.info("[elastic-ep] Scale-down completed: old_ep_size=%d new_ep_size=%d "
                    "released_ranks=%s", old, target, leaving)


def forget_cohorts(offsets: range) -> None:
    """Delete the scale cohorts registered for the freed slots (rank 0 only; the store is
    shared). Upstream never deletes one: a joiner that left keeps its cohort (its target size)
    in the store, and a later scale-up from that size then read the stale target and failed
    with "does not match joining cohort target" before the new joiner registered."""
    from sglang.srt.distributed.utils import get_global_tcp_store
    from sglang.srt.elastic_ep.elastic_ep import _SCALE_COHORT_KEY_PREFIX

    store = get_global_tcp_store()
    if store is None:
        return
    for offset in offsets:
        key = f"{_SCALE_COHORT_KEY_PREFIX}/{offset}"
        if store.check([key]):
            store.delete_key(key)


def first_rank_of_server(*, is_joiner: bool, join_offset: int, node_rank: int,
                         ranks_per_node: int) -> int:
    """The lowest EP rank served by this process's ``launch_server`` tree."""
    return join_offset if is_joiner else node_rank * ranks_per_node


def _leave(target: int) -> None:
    """A released rank takes part in no collective again. When every rank of its server
    leaves (a scale-up joiner, a node above 0), the server is stopped with SIGTERM and exits 0;
    otherwise (node 0's tree, or a server that keeps some ranks) the rank parks."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    parallel = get_parallel()
    nnodes = max(1, int(getattr(parallel, "nnodes", 1) or 1))
    first = first_rank_of_server(
        is_joiner=bool(get_exec().moe.is_ep_joiner),
        join_offset=int(parallel.ep_join_rank_offset or 0),
        node_rank=int(parallel.node_rank or 0),
        ranks_per_node=int(parallel.tp_size) // nnodes,
    )
    if first >= target and first > 0:
        parent = os.getppid()
        logger.info("[elastic-ep] every rank of this server leaves: stopping it (pid %d)", parent)
        threading.Timer(0.5, os.kill, (parent, signal.SIGTERM)).start()
    else:
        logger.info("[elastic-ep] this server keeps other ranks; the released rank parks until "
                    "the server stops")
    while True:  # never return to the event loop (its next pass would run a collective)
        time.sleep(3600)


def is_shrink(state: Any) -> bool:
    pending = state.pending_ep_size
    return pending is not None and pending < state.effective_ep_size

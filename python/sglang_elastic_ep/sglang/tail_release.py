"""Letting the tail ranks go: the membership step shared by a scale-down and by a failed tail.

A scale-down (``scale_down``) and letting go of a failed tail of scale-joined ranks
(``tail_recovery``) end the same way, on one pass every active rank agreed on
(``scale_progress``): experts move off the tail where they can, the expert location metadata
shrinks to the staying ranks' slots (each rank keeps its number of physical slots, so layouts
stay valid), the tail becomes inactive, Mooncake deactivates it in WORLD, DP attention shrinks,
and the NIXL data plane is told the new size (it disconnects at the next dispatch). A released
rank then takes no further part in any collective: its scheduler process exits 0, and when
every rank of its ``launch_server`` tree left (a scale-up joiner, a node above 0), that server
exits 0 with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import replacement_notices
from sglang_elastic_ep.sglang.expert_moves import move_experts_off_leaving_ranks
from sglang_elastic_ep.sglang.join_kind import slot_history
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import expert_location_metadata, state_manager
from sglang_elastic_ep.sglang.world_registration import release_launch_ranks
from sglang_elastic_ep.sglang.world_view import world_quiesce

logger = get_logger(__name__)


def release_tail(runner: Any, target: int, *, tell_tokenizer: bool = True,
                 move_experts: bool = True,
                 enter_phase: Callable[[Phase], None] | None = None) -> None:
    """Every active rank, on the same agreed pass: move experts, switch placement, then let
    ranks ``target..`` go. Does not return on a released rank. ``enter_phase`` is told each
    step and the end (the scale-down's machine); by default the phase is written as is.

    ``tell_tokenizer=False, move_experts=False`` when the tail failed rather than left
    (tail_recovery): nothing can be read from dead ranks (that path checks beforehand that
    the survivors hold every expert), and the HTTP process keeps its size and shows the slots
    failed until their replacement joins."""
    from sglang.srt.eplb.expert_distribution import (
        ExpertDistributionRecorder,
        set_global_expert_distribution_recorder,
    )
    from sglang.srt.eplb.expert_location import (
        ExpertLocationMetadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_context

    manager = state_manager()
    state = manager.instance()

    def enter(phase: Phase) -> None:
        if enter_phase is not None:
            enter_phase(phase)
        else:
            state.scale_phase = phase.value

    old = state.effective_ep_size
    rank = runner._elastic_global_rank()
    leaving = list(range(target, old))
    staying = rank < target
    runner.forward_pass_id = 0

    # 1. Experts: the staying ranks take every expert only the tail holds (weights move while
    # the leaving ranks are still members); then the leaving ranks' slots leave the map.
    enter(Phase.MOVING_EXPERTS)
    if move_experts:
        move_experts_off_leaving_ranks(runner, old, target)
    enter(Phase.SWITCHING_PLACEMENT)
    metadata = expert_location_metadata()
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
    enter(Phase.RELEASING)
    state.active_ranks[target:] = 0
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    slot_history(state).release(leaving)  # their experts left the map: a rejoin is a scale-up
    if staying:
        release_launch_ranks(state, target, rank)
        # A failed joiner among them that was awaited in place (a live rank was above it)
        # leaves with the tail: the next process in its slot joins by scale-up.
        replacement_notices.withdraw_in_place(leaving)
    world_quiesce(state).before_view_change("release", leaving)
    answer = propose_deactivation(dist.group.WORLD, leaving, leaving=not staying)
    logger.info("[elastic-ep] rank %d: Mooncake deactivate_ranks(%s): %s, epoch %s", rank,
                leaving, getattr(answer, "status", answer), getattr(answer, "new_epoch", "?"))
    state.effective_ep_size = target
    state.pending_ep_size = None
    state.pending_since = None
    state.has_scaled = True
    enter(Phase.SERVING_CONTRACTED if staying else Phase.RELEASED)
    if manager._on_scale is not None:  # the NIXL data plane (upstream sets it for nixl only)
        from sglang_elastic_ep.sglang.nixl_buffer_hooks import mark_ranks_drained

        # Agreed this pass: the leaving ranks hold no request, and every rank finished its
        # last dispatch and combine before entering, so no token is in flight to them.
        mark_ranks_drained(leaving)
    manager.on_scale(old, target)  # NIXL: disconnect the tail at the next dispatch

    if not staying:
        logger.info("[elastic-ep] rank %d left (scale-down %d -> %d)", rank, old, target)
        first = server_ranks().start
        leave(whole_server=first >= target and first > 0)
        return

    from sglang.srt.elastic_ep.elastic_ep import update_dp_attention_for_elastic_ep
    from sglang.srt.elastic_ep.topology import attn_replica_size, physical_ep_size_to_dp_size

    update_dp_attention_for_elastic_ep(physical_ep_size=target, physical_ep_rank=rank)
    # The decode graphs were captured for the old DP size: re-capture them for the new one, as
    # upstream does at a scale-up's commit (the staying ranks together, over the shrunk WORLD;
    # nothing to do without CUDA graphs).
    runner._recapture_elastic_cuda_graphs()
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


def server_ranks() -> range:
    """The EP ranks this process's ``launch_server`` tree serves (node 0's from rank 0)."""
    from sglang.srt.runtime_context import get_exec, get_parallel

    parallel = get_parallel()
    nnodes = max(1, int(getattr(parallel, "nnodes", 1) or 1))
    per_server = int(parallel.tp_size) // nnodes
    first = first_rank_of_server(
        is_joiner=bool(get_exec().moe.is_ep_joiner),
        join_offset=int(parallel.ep_join_rank_offset or 0),
        node_rank=int(parallel.node_rank or 0),
        ranks_per_node=per_server,
    )
    return range(first, first + per_server)


def propose_deactivation(group: Any, ranks: list[int], *, leaving: bool) -> Any:
    """Mooncake's answer to this rank's proposal that ``ranks`` leave ``group``; None when the
    proposal failed on a rank that leaves.

    Every rank of the agreed pass proposes the same change and Mooncake applies it once. A
    leaving rank whose own proposal fails (the coordinator's RPC can time out while it handles
    the others') still leaves as released, exit 0: the staying ranks' proposals make
    the change, and a staying rank's failure raises as before. Exiting 1 instead would have its
    orchestrator relaunch a rank the scale-down released."""
    from mooncake.pg import deactivate_ranks

    try:
        return deactivate_ranks(group, ranks)
    except RuntimeError as exc:
        if not leaving:
            raise
        logger.warning("[elastic-ep] this rank leaves although its own Mooncake proposal to "
                       "deactivate %s failed (%s): the staying ranks propose the same change",
                       ranks, exc)
        return None


def leave(*, whole_server: bool) -> None:
    """A released rank takes part in no collective again: its scheduler process exits 0. That
    frees the rank's device and its seat in Mooncake (which refuses a joiner for a slot while the
    old process still answers), so a scale-up can refill the slot. When every rank of its server
    leaves (``whole_server``: a scale-up joiner, a node above 0), the server's DP controller and
    then its main process end with exit 0 too, once all its schedulers have exited
    (``server_exit`` tells this exit 0 from a crash). Otherwise (node 0's tree, or a server that
    keeps some ranks) SGLang's subprocess watchdog lets a child that exited 0 go."""
    if whole_server:
        logger.info("[elastic-ep] every rank of this server leaves: its scheduler exits 0 "
                    "(pid %d), and the server with it", os.getpid())
    else:
        logger.info("[elastic-ep] this server keeps other ranks: the released rank's scheduler "
                    "process exits 0 (pid %d)", os.getpid())
    deliver_queued_messages()
    logging.shutdown()
    # No interpreter teardown: process-group destructors would talk to peers that no longer
    # count this rank.
    os._exit(0)


# How long a leaving scheduler waits for ZeroMQ to hand over its last messages.
DELIVERY_LINGER_MS = 5000


def deliver_queued_messages(linger_ms: int = DELIVERY_LINGER_MS) -> int:
    """Hand over what this scheduler's ZeroMQ sockets still queue before the process ends; the
    number of contexts flushed.

    ``os._exit`` drops ZeroMQ's queues, and a released rank may leave on the very pass on which
    it answered the HTTP process's drain confirmation (an idle cluster drains at once): without
    this, the HTTP process waits for that answer until its timeout. The sockets are found
    through the ``SenderWrapper`` objects of the scheduler's IPC channels (not reachable from the
    pass that releases it); each of their contexts is destroyed with a linger, which returns
    once everything queued was sent or ``linger_ms`` passed. Only this thread uses them.
    """
    import gc

    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper

    contexts = {}
    for obj in gc.get_objects():
        if isinstance(obj, SenderWrapper) and obj.socket is not None and not obj.socket.closed:
            contexts[id(obj.socket.context)] = obj.socket.context
    for context in contexts.values():
        context.destroy(linger=linger_ms)
    return len(contexts)

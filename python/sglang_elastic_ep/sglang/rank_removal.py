"""Removing live ranks below the tail: their slots become holes.

``{"remove_ranks": [1]}`` of ``[0, 1, 2]`` with rank 1 serving. The cluster already serves
around a failed launch-time rank (it is inactive in every mask, the dispatch skips its slots,
and a relaunch with ``--ep-join-mode recover`` is taken back in place on an agreed pass by
``launch_recovery``, as after a scale); so it does around a failed scale-joined rank below a
live one. A live removal brings rank 1 into that state on one agreed pass instead of by a
crash, after the HTTP process drained its shard as for a scale-down (``scale_down`` drives the
drain and the machine; this module holds the checks and the release). The HTTP process has
checked the set (whole launch nodes other than node 0, scale-joined ranks only below a live
one that stays, whole attention replicas) before sending it, so every scheduler answers the
same request:

- every rank marks the removed ranks inactive in WORLD's mask and in each launch-time group's
  that holds them (a scale-joined rank is in none), and Mooncake deactivates them in each of
  those groups, as its fault detection would have;
- no expert moves and the map keeps the removed ranks' slots (skipped while inactive): the
  request is refused unless the staying ranks hold every expert;
- the NIXL data plane keeps its connection to them, as to a crashed rank: the take-back of a
  relaunch replaces the peer (``nixl_buffer_hooks.recover_ranks``);
- a removed rank then leaves as a released tail rank does (``tail_release.leave``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from sglang_elastic_ep.core.membership import not_removable_in_place
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.nixl_buffer_hooks import mirror_of
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.tail_recovery import live_mask, uncovered_on_ranks
from sglang_elastic_ep.sglang.tail_release import leave, propose_deactivation, server_ranks
from sglang_elastic_ep.sglang.upstream import lockstep_agreement_on, state_manager
from sglang_elastic_ep.sglang.world_view import world_quiesce

logger = get_logger(__name__)


def removal_refusal(state: Any, ranks: Sequence[int]) -> str | None:
    """Why this scheduler cannot remove ``ranks`` (live, below the tail) now; None when it
    can. Each reason names what works instead."""
    from sglang.srt.elastic_ep.topology import attn_replica_size
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if not lockstep_agreement_on(state, parallel):
        return ("removing ranks needs the per-pass rank agreement, which runs only in a "
                "deployment started with --max-ep-size (room to grow): restart with it")
    if state_manager().is_scaling() or state.pending_ep_size is not None:
        return ("another scale or a recovery is in progress: wait until it finishes "
                "(GET /elastic_ep/status), then retry")
    size = int(state.effective_ep_size)
    launch = int(state.original_ep_size)
    mask = live_mask(state)
    outside = not_removable_in_place(ranks, size, launch,
                                     live=(r for r in range(size) if mask[r]))
    if outside:
        return (f"ranks {outside} are neither launch-time ranks above 0 nor scale-joined "
                f"ranks below a live one that stays (EP size {size}): remove them from the "
                "tail (new_ep_size) instead")
    failed = [r for r in range(size) if not mask[r]]
    if failed:
        return (f"ranks {failed} have failed: relaunch them with --ep-join-mode recover, or "
                f'remove them first ({{"remove_ranks": {failed}}}), then retry')
    replica = attn_replica_size()
    staying = [r for r in range(size) if r not in ranks]
    if parallel.attn_dp_enabled and len(staying) // replica < 2:
        return (f"removing {list(ranks)} would leave {len(staying) // replica} attention DP "
                f"rank, and attention DP needs at least 2: keep at least {2 * replica} ranks")
    uncovered = uncovered_on_ranks(staying, size)
    if uncovered is not None:
        layer, experts = uncovered
        return (f"logical experts {experts} (layer {layer}) have no replica outside ranks "
                f"{list(ranks)}, and a removal moves no expert: remove the tail instead "
                "(new_ep_size), which moves experts first, or launch with more "
                "--ep-num-redundant-experts")
    return None


def release_removed_ranks(runner: Any, ranks: Sequence[int],
                          enter_phase: Callable[[Phase], None]) -> None:
    """Every active rank, on the same agreed pass: ``ranks`` become inactive everywhere and
    leave WORLD's and the launch-time groups' collectives. Does not return on a removed rank.
    ``enter_phase`` is told each step and the end (the removal's machine)."""
    from sglang.srt.elastic_ep.elastic_ep import (
        _iter_live_parallel_groups,
        _map_global_to_group_local_ranks,
    )

    state = state_manager().instance()
    rank = runner._elastic_global_rank()
    removed = sorted(int(r) for r in ranks)
    # Nothing moves: the staying ranks hold every expert (checked at the request), and the
    # removed ranks' slots stay in the map, skipped while they are inactive.
    enter_phase(Phase.MOVING_EXPERTS)
    enter_phase(Phase.SWITCHING_PLACEMENT)
    enter_phase(Phase.RELEASING)
    state.active_ranks[removed] = 0
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    mirror_of(state).set_active(removed, active=False)
    world_quiesce(state).before_view_change("remove", removed)
    leaving = rank in removed
    answer = propose_deactivation(dist.group.WORLD, removed, leaving=leaving)
    logger.info("[elastic-ep] rank %d: Mooncake deactivate_ranks(%s): %s, epoch %s", rank,
                removed, getattr(answer, "status", answer), getattr(answer, "new_epoch", "?"))
    # The launch-time groups too, as Mooncake's fault detection marks a crashed rank in each:
    # their masks then show the hole, and upstream's recovery takes a relaunch back in each.
    for group in _iter_live_parallel_groups():
        local = _map_global_to_group_local_ranks(group.ranks, removed)
        if not local or group.world_size <= 1:
            continue
        for backend in (group.device_group, group.cpu_group):
            propose_deactivation(backend, local, leaving=leaving)
        for name in ("active_ranks", "active_ranks_cpu"):
            mask = getattr(group, name, None)
            if mask is not None:
                mask[local] = 0
    # A membership change, as a tail release is (upstream's ``has_scaled``); a relaunch is
    # taken back on a pass every survivor agreed on (launch_recovery's RECOVER step).
    state.has_scaled = True
    enter_phase(Phase.RELEASED if leaving else Phase.SERVING_CONTRACTED)
    if leaving:
        logger.info("[elastic-ep] rank %d left (removed where it was; ranks %s)", rank, removed)
        server = server_ranks()
        leave(whole_server=server.start > 0 and all(r in removed for r in server))
        return
    if rank == 0:
        from sglang.srt.managers.io_struct import ElasticScaleUpdateReq

        # The size stays and no slot is added: the HTTP process reads this as the removal's
        # commit (``tokenizer_hooks.apply_scale_update``).
        runner._pending_elastic_scale_update = ElasticScaleUpdateReq(
            success=True, effective_ep_size=int(state.effective_ep_size), slot_count=0)
    logger.info("[elastic-ep] ranks %s removed where they were: serving on %s", removed,
                [r for r, up in enumerate(live_mask(state)) if up])

"""Recovery of ranks that joined by scale-up (upstream answers ``recovery_unsupported``).

Upstream recovers a crashed rank by rebuilding the launch-time world: WORLD and every
launch-time TP/EP group (``try_recover_ranks``). A rank that joined by scale-up was never in
those groups, only in the expandable WORLD, so after any scale upstream gives up on recovery.

A failed tail of scale-joined ranks comes back the way it first came in, in two agreed steps:

1. **Let go** (every survivor, on one agreed pass): the failed slots are cut from the expert map
   and from DP attention, exactly as a scale-down does (``tail_release.release_tail``), except
   that the HTTP process is not told to shrink: its router keeps the shard marked failed and
   the status keeps showing the slot as failed. Requests the dead shard held were already ended
   with 503 by the HTTP process. Only when every logical expert keeps a replica on the
   surviving ranks; otherwise nothing changes and the reason is reported.
2. **Re-admit**: a replacement launched with ``--ep-join-mode recover`` and the slots' join
   offset joins as a scale joiner (``args.join_mode_for_slot``) and registers its cohort. Each
   survivor that sees that cohort and the replacement in Mooncake's WORLD requests the scale
   back to the old size; upstream's scale-up
   then admits it on a pass every rank agreed on, and the HTTP process sees the shard alive
   again (``rank_recovered``).

Launch-time ranks that failed with the tail stay failed below it once it is let go and rejoin
in place first (``launch_recovery``); the re-admission waits for them, and their replacements
wait for the tail with the survivors (``await_the_tail_with_the_survivors``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from sglang_elastic_ep.core.membership import failed_in_place, failed_tail
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.placement import uncovered_experts
from sglang_elastic_ep.core.stall import in_their_forward_since, positions_from_reports
from sglang_elastic_ep.core.tail_recovery_machine import ReplacementVerdict, TailRecoveryMachine
from sglang_elastic_ep.sglang import replacement_notices
from sglang_elastic_ep.sglang.gather_repair import (
    LastGatheredRows,
    repair_after_failed_gather,
    repair_after_gather,
    run_a_forward_for,
    seeing_the_all_reduce,
)
from sglang_elastic_ep.sglang.nixl_buffer_hooks import mirror_of
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.pass_progress import pass_progress, read_reports
from sglang_elastic_ep.sglang.tail_release import forget_cohorts, release_tail
from sglang_elastic_ep.sglang.upstream import (
    RECOVERY_UNSUPPORTED,
    attached_state,
    expert_location_metadata,
    state_manager,
)

logger = get_logger(__name__)

@dataclass
class TailRecoveryState:
    """This scheduler process's driver of a failed tail's recovery (one per process:
    ``tail_recovery_state``): the survivor's machine of the current or last recovery
    (``core.tail_recovery_machine``), fed from the store, Mooncake's peer state and upstream's
    scale state."""

    machine: TailRecoveryMachine | None = None
    reported: set[str] = field(default_factory=set)  # errors already logged (each once)
    # The failed ranks a recovery was refused for: the refusal stands until they change.
    refused_for: tuple[int, ...] | None = None

    @property
    def awaiting_replacement(self) -> bool:
        return self.machine is not None and self.machine.awaiting_replacement

    def report_once(self, message: str) -> None:
        if message not in self.reported:
            self.reported.add(message)
            logger.error("[elastic-ep] %s", message)


_STATE_ATTR = "_elastic_ep_tail_recovery"
_LAST_ROWS_ATTR = "_elastic_ep_last_gathered_rows"


def tail_recovery_state(state: Any) -> TailRecoveryState:
    """The recovery state kept on upstream's ``ElasticEPState`` ``state`` (one per scheduler
    process, whichever model runner runs the per-pass step); built on first use."""
    return attached_state(state, _STATE_ATTR, TailRecoveryState)


def live_mask(state: Any) -> list[int]:
    """1 for each EP slot that is active by both the device mask (through its host mirror) and
    upstream's host copy, else 0."""
    # The MoE dispatcher (Mooncake EP's or NIXL's) clears a rank in active_ranks when it stops
    # answering a forward, and an idle rank folds in Mooncake's group evictions
    # (scale_progress.fold_group_evictions); the host copy lags until the next sync. Either
    # one marks the rank failed (upstream's recovery reads both the same way). active_ranks
    # is read through its host mirror: on a GPU the mirror folds in an asynchronous copy (a
    # pass or two late) instead of waiting for the device.
    mirror = mirror_of(state)
    mirror.poll_refresh()
    mirror.refresh_async()
    live = mirror.as_list()
    host = state.active_ranks_cpu.tolist() if state.active_ranks_cpu is not None else live
    return [int(a and b) for a, b in zip(live, host, strict=True)]


def contraction_target(state: Any, runner: Any) -> int:
    """The size to contract to now (the first failed rank), or 0: nothing failed, a scale is
    pending, or the failed ranks cannot be recovered this way (then the recovery is failed
    with the reason, once, and upstream's state says so)."""
    if state.pending_ep_size is not None or not state.has_scaled:
        return 0
    mask = live_mask(state)
    failed = tuple(r for r in range(state.effective_ep_size) if not mask[r])
    if (state.scale_phase == RECOVERY_UNSUPPORTED
            and failed == tail_recovery_state(state).refused_for):
        # Judged already. Another failure can turn the set into a tail to let go (the live
        # joiner above a failed one stopped, as the refusal asked): judged again then.
        return 0
    tail = failed_tail(mask, state.effective_ep_size, state.original_ep_size)
    if tail is None:
        return 0  # none failed, or ranks that rejoin in place (launch_recovery)
    problem = _uncovered_without(tail.first, state.effective_ep_size, mask)
    if problem is not None:
        _fail_recovery(runner, state, problem, failed)
        return 0
    return tail.first


def failed_tail_to_let_go(state: Any) -> bool:
    """Whether the failed ranks are a tail of scale-joined ranks that the survivors will let go
    of: their slots leave the layout, and EPLB rebalances the smaller one afterwards."""
    if state.pending_ep_size is not None or not state.has_scaled:
        return False
    return failed_tail(live_mask(state), state.effective_ep_size,
                       state.original_ep_size) is not None


def uncovered_on_ranks(ranks: Sequence[int], effective: int) -> tuple[int, list[int]] | None:
    """The first layer with logical experts that no slot of ``ranks`` holds, and those
    experts; None when ``ranks`` hold every expert (or there is no expert map)."""
    metadata = expert_location_metadata()
    if metadata is None:
        return None
    p2l = metadata.physical_to_logical_map.tolist()
    per_rank = len(p2l[0]) // effective
    kept = [p for r in ranks for p in range(r * per_rank, (r + 1) * per_rank)]
    # uncovered_experts reads a row's first slots as the staying ones, the whole row as the
    # layer's experts: the kept slots, then the row
    missing = uncovered_experts([[row[p] for p in kept] + row for row in p2l], slots=len(kept))
    return next(iter(missing.items())) if missing else None


def _uncovered_without(first: int, effective: int, mask: list[int]) -> str | None:
    """Why the live ranks below ``first`` cannot serve every expert once the tail is let go
    (None: they can). A launch-time rank that failed with the tail does not count."""
    live = [r for r in range(first) if mask[r]]
    uncovered = uncovered_on_ranks(live, effective)
    if uncovered is None:
        return None
    layer, experts = uncovered
    failed = [r for r in range(effective) if not mask[r]]
    return (f"ranks {failed} failed and logical experts {experts} (layer {layer}) "
            f"have no replica on the live ranks {live}: the "
            "survivors cannot serve without them. Relaunching with --ep-num-redundant-experts "
            "avoids this; restart the deployment")


def _fail_recovery(runner: Any, state: Any, problem: str, failed: tuple[int, ...]) -> None:
    manager = state_manager()
    manager.fail_recovery(problem)
    runner._report_elastic_scale_failure(problem, state.effective_ep_size)
    holder = tail_recovery_state(state)
    holder.refused_for = failed
    holder.report_once(problem)


def let_go_of_failed_tail(runner: Any, target: int) -> None:
    """Step 1, on every survivor in the same agreed pass."""
    state = state_manager().instance()
    old = state.effective_ep_size
    machine = TailRecoveryMachine(first_failed=target, return_to=old,
                                  started_at=time.monotonic())
    release_tail(runner, target, tell_tokenizer=False, move_experts=False)
    machine.let_go(time.monotonic())
    tail_recovery_state(state).machine = machine
    state.scale_phase = machine.phase.value
    logger.warning(
        "[elastic-ep] ranks %d..%d failed; the survivors let go of their slots and serve on %d "
        "ranks. Relaunch the failed joiners with --ep-join-mode recover (their own "
        "--elastic-ep-join-rank-offset, one server per rank or one from %d for them all) to "
        "return to %d ranks",
        target, old - 1, target, target, old,
    )


def awaited_return(state: Any) -> int:
    """The size this survivor returns to once a let-go tail's replacement joins (0: none
    awaited)."""
    machine = tail_recovery_state(state).machine
    return machine.return_to if machine is not None and machine.awaiting_replacement else 0


def await_the_tail_with_the_survivors(state: Any, return_to: int) -> None:
    """On a launch-time rank's replacement that rejoins while the survivors wait for a let-go
    tail's replacement (to ``return_to``; 0: none): it waits with them, so that every rank asks
    for the old size when that replacement registers and the agreement can admit it."""
    if not return_to or return_to <= int(state.effective_ep_size):
        return
    now = time.monotonic()
    machine = TailRecoveryMachine(first_failed=int(state.effective_ep_size),
                                  return_to=return_to, started_at=now)
    machine.let_go(now)
    tail_recovery_state(state).machine = machine
    logger.info("[elastic-ep] the survivors wait for the replacement of ranks %d..%d: this rank "
                "waits with them", machine.first_failed, return_to - 1)


def request_return_when_replacement_registered(state: Any) -> None:
    """Step 2: once the replacement's cohort is in the store and its process in Mooncake's
    WORLD, ask for the old size again (this rank only; the per-pass agreement then waits for
    every survivor)."""
    recovery = tail_recovery_state(state)
    machine = recovery.machine
    if machine is None or state.pending_ep_size is not None \
            or not machine.check_due(time.monotonic()):
        return
    if failed_in_place(live_mask(state), int(state.effective_ep_size),
                       int(state.original_ep_size)):
        return  # ranks below the tail that failed with it rejoin first (launch_recovery)
    from sglang.srt.elastic_ep.elastic_ep import get_scale_cohort

    cohort = get_scale_cohort(state.effective_ep_size)
    target = None if cohort is None else int(cohort.target_ep_size)
    peers_joined = False
    if target is not None and machine.first_failed < target <= machine.return_to:
        from mooncake.pg import get_peer_state

        peers_joined = all(get_peer_state(dist.group.WORLD,
                                          list(range(machine.first_failed, target))))
    verdict = machine.replacement_verdict(target, peers_joined)
    if verdict is ReplacementVerdict.WRONG_SIZE and target is not None:
        recovery.report_once(machine.wrong_size_message(target))
    elif verdict is ReplacementVerdict.READMIT and target is not None \
            and state_manager().request_scale(target):
        replacement_notices.announce_partial_return(target, machine.return_to)
        machine.readmission_requested(time.monotonic(), target)
        logger.info("[elastic-ep] replacement for ranks %d..%d registered: re-admitting it",
                    machine.first_failed, target - 1)


def note_committed(state: Any) -> None:
    """After the per-pass step: the replacement is in once the old size is back; a failed
    re-admission waits for the next replacement."""
    machine = tail_recovery_state(state).machine
    if machine is None:
        return
    asked = machine.readmitting_to
    entered = machine.observe(int(state.effective_ep_size), state.pending_ep_size is not None,
                              time.monotonic())
    if entered is not None and asked < machine.return_to:  # read before its commit barrier
        replacement_notices.withdraw_partial_return(asked)
    if entered is Phase.SERVING_RECOVERED:
        logger.info("[elastic-ep] recovered ranks that joined by scale-up: back at %d ranks",
                    machine.return_to)
    elif entered is Phase.AWAITING_REPLACEMENT and machine.partly_back is not None:
        logger.info("[elastic-ep] ranks %s are back (%d ranks); ranks %d..%d await their "
                    "replacement", list(machine.partly_back), machine.first_failed,
                    machine.first_failed, machine.return_to - 1)
    elif entered is Phase.AWAITING_REPLACEMENT:
        logger.warning("[elastic-ep] re-admitting ranks %d..%d failed (%s): waiting for the "
                       "next replacement", machine.first_failed, machine.return_to - 1,
                       state.last_error)


def world_gather_width(original: Any, num_dp_ranks: int, **kwargs: Any) -> int:
    """AROUND ``dp_attn._resolve_elastic_world_num_dp_ranks``: after a scale-up the DP
    all-gather spans the expanded WORLD. When a rank of it dies, Mooncake drops it from WORLD's
    size while the effective size still counts its slot (until the survivors let it go, a few
    passes later). Upstream raises there and every scheduler dies. The gather itself, an
    all-reduce of one row per DP rank, works with the dead rank's row left empty, so keep the
    width while the missing ranks are exactly failed ones."""
    try:
        return original(num_dp_ranks, **kwargs)
    except RuntimeError:
        state = state_manager().instance()
        group = kwargs.get("group")
        if state is None or group is None:
            raise
        # Mooncake shrank WORLD below the effective size: a member died. (Its entry in
        # active_ranks may clear a moment later: Mooncake's view changes first.)
        if dist.get_world_size(group) >= state.effective_ep_size:
            raise
        from sglang.srt.layers.dp_attention import dp_gather_width

        return dp_gather_width()


def remove_failed_slots(scheduler: Any, state: Any, new_ep_size: int) -> Any:
    """A scale-down to the size the survivors already serve on (after letting go of a failed
    tail): the orchestrator removes the failed ranks instead of replacing them. Nothing moves;
    the HTTP process is told to shrink and no replacement is awaited any more."""
    from sglang.srt.elastic_ep.topology import attn_replica_size, physical_ep_size_to_dp_size
    from sglang.srt.managers.io_struct import ElasticScaleUpdateReq, ScaleElasticEPReqOutput
    from sglang.srt.runtime_context import get_exec, get_parallel

    machine = tail_recovery_state(state).machine
    if machine is None:
        raise RuntimeError("removing failed slots with no failed tail let go of")
    old = machine.return_to
    machine.removed(time.monotonic())
    state.scale_phase = machine.phase.value
    state.last_error = None
    runner = scheduler.tp_worker.model_runner
    if get_parallel().tp_rank == 0 and not get_exec().moe.is_ep_scale_joiner:
        forget_cohorts(range(new_ep_size, old))  # the dead joiners' cohorts, now stale
        runner._pending_elastic_scale_update = ElasticScaleUpdateReq(
            success=True, effective_ep_size=new_ep_size,
            slot_offset=physical_ep_size_to_dp_size(new_ep_size, attn_replica_size()),
            slot_count=0,
        )
    logger.info("[elastic-ep] failed ranks %d..%d removed by scale-down: serving on %d ranks",
                new_ep_size, old - 1, new_ep_size)
    return ScaleElasticEPReqOutput(
        success=True, message=f"failed ranks {new_ep_size}..{old - 1} removed",
        old_ep_size=old, new_ep_size=new_ep_size, pending_ep_size=new_ep_size,
        scale_phase=Phase.RELEASING.value,
    )


def gather_seeing_failures(
    original: Any, info: Any, device: Any, group: Any, use_all_reduce: bool = False,
    checked_rows: bool = False,
) -> tuple[Any, list[int]]:
    """Upstream's ``dp_attn.MLPSyncBatchInfo.all_gather`` with WORLD's mask (called by its hook,
    ``gather_agreement.gather_with_agreement``): upstream blanks the rows of inactive
    ranks with the launch-time TP group's mask, which has no entry for a rank that joined by
    scale-up. Over the expanded WORLD (``use_all_reduce``) the mask is the one with every
    slot, ``ElasticEPState.active_ranks`` (the MoE dispatcher clears a rank that dies). Seen
    without it: a joiner killed during the gather left a garbage token count in its row, and a
    survivor died building an idle batch of 32622 tokens. A peer that dies before its mask
    entry is cleared can still leave garbage: ``gather_repair`` asks the all-reduce whether it
    completed with every peer and checks the rows after every gather of an elastic server
    (``checked_rows``: each row ends with its ``gather_repair.row_check``). Returns the
    result and the peers that failed during this gather (``repair_after_failed_gather``)."""
    elastic = state_manager().instance()
    if elastic is None:  # elastic EP off: upstream's gather as it is
        return original(info, device, group, use_all_reduce), []
    state = elastic if use_all_reduce else None
    if state is None or state.active_ranks is None:
        result = original(info, device, group, use_all_reduce)
        repair_after_gather(info)
        return result, []
    from sglang.srt.runtime_context import get_parallel

    tp_group = get_parallel().tp_group
    saved = (tp_group.active_ranks, tp_group.active_ranks_cpu)
    world = state.active_ranks
    # Upstream masks with active_ranks_cpu only when the gather runs on the host, where WORLD's
    # mask is that host tensor; elsewhere it reads the device mask, and the host copy is never
    # read (so no device-to-host copy of it either).
    tp_group.active_ranks_cpu = world if world.device.type == "cpu" else state.active_ranks_cpu
    tp_group.active_ranks = world
    started = time.time()
    try:
        with seeing_the_all_reduce(group) as seen:
            result = original(info, device, group, use_all_reduce)
    finally:
        tp_group.active_ranks, tp_group.active_ranks_cpu = saved
    failed = repair_after_failed_gather(
        info, seen, group, checked=checked_rows,
        last=attached_state(state, _LAST_ROWS_ATTR, LastGatheredRows))
    if failed:
        follow_a_forwarding_peer(info, state, failed, started)
    repair_after_gather(info)
    return result, failed


def follow_a_forwarding_peer(info: Any, state: Any, failed: Sequence[int],
                             started: float) -> list[int]:
    """After a gather this rank completed without ``failed``, whose repaired rows run no
    forward: the live peers that run this pass's forward anyway (their fresh progress reports),
    and if there are any, this rank runs its idle forward too (``gather_repair``'s
    ``run_a_forward_for``).

    A peer that received every row, the dying peer's current one among them, may decide that
    the pass has work while this rank, holding the dying peer's last row, decides it has none.
    The peer then waits in its dispatch for this rank, and this rank in the next gather for
    it, until each takes the other for failed. This rank sat in Mooncake's post-failure sync
    until the fault window closed, so such a peer has been in its forward for seconds by now
    and says so in its report. Read only on a pass that lost a peer."""
    if max(info.global_num_tokens or [0]) > 0:
        return []
    progress = pass_progress(state)
    connect = None if progress is None else progress.connect
    if connect is None:
        return []
    mirror = mirror_of(state)
    own = dist.get_rank()
    peers = [rank for rank in range(mirror.size)
             if rank != own and rank not in failed and mirror.is_active(rank)]
    try:
        store = connect()
        reports = [] if store is None else read_reports(store, peers)
    except Exception as exc:  # noqa: BLE001 - the store's host may be gone: decide as before
        logger.info("[elastic-ep] rank %d: no progress report of ranks %s readable after a "
                    "failed gather (%s)", own, peers, exc)
        return []
    now = time.time()
    forwarding = in_their_forward_since(positions_from_reports(reports, now), now - started)
    if forwarding and run_a_forward_for(info, failed):
        logger.warning("[elastic-ep] rank %d: ranks %s run this pass's forward (they received "
                       "every row of the gather that lost %s): this rank runs it too, idle",
                       own, forwarding, list(failed))
        return forwarding
    return []


def gather_masks_expanded_world(
    original: Any, info: Any, device: Any, group: Any, use_all_reduce: bool = False,
) -> Any:
    """:func:`gather_seeing_failures` for a gather that carries no agreement."""
    return gather_seeing_failures(original, info, device, group, use_all_reduce)[0]

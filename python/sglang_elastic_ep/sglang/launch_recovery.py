"""Launch-time ranks that fail rejoin in place, after a scale too (upstream:
``recovery_unsupported``), on one agreed pass.

Upstream recovers a failed launch-time rank by rebuilding the launch-time world: its
replacement registers in WORLD and in every launch-time group, and the survivors take it back
(``try_recover_ranks``), broadcast the expert map and count it active again. After any scale
upstream refuses: WORLD has grown past the launch size, so the replacement's registration was
rejected, and a scale-joined survivor has no launch-time group with the failed rank in it.

Before any scale, upstream's survivors each take the replacement back on the pass they see
it registered: with two survivors, one could enter the take-back's collectives while the
other ran the next forward (the race a scale-up had). Here the replacement registers for the
largest WORLD so far (``world_registration``) and takes on the size the survivors serve on
while it rejoins (``take_on_serving_size``). The survivors (launch-time and scale-joined
alike) wait, serving, until every replacement is in Mooncake's WORLD, then run upstream's
recovery steps together on one agreed pass (``StepKind.RECOVER`` in the gather): each
survivor takes the replacement back into the groups it shares with it (WORLD only, for a
scale-joined survivor). Each survivor's side runs as a core machine
(``core.launch_recovery_machine``), driven from here. No slot leaves the layout meanwhile: the
failed rank's experts are served from their replicas.

A failed scale-joined rank below a live one rejoins the same way (``failed_in_place``):
Mooncake admits a scale joiner by recovering its WORLD slot, and no launch-time group holds
it. Its replacement, a scale joiner by its arguments, learns from the survivors' notice
(``replacement_notices``) to run upstream's rejoin instead of a scale join
(``scale_up_joiner``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.core.launch_recovery_machine import (
    LaunchRecoveryMachine,
    ReplacementMachine,
)
from sglang_elastic_ep.core.membership import failed_in_place
from sglang_elastic_ep.sglang import replacement_notices
from sglang_elastic_ep.sglang.nixl_buffer_hooks import (
    mark_ranks_activated,
    mark_ranks_drained,
    mirror_of,
    prepare_data_plane,
    recover_ranks,
)
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.replica_loading import own_slots, reload_moved_experts
from sglang_elastic_ep.sglang.start_up_steps import breakdown, run_step
from sglang_elastic_ep.sglang.tail_recovery import (
    await_the_tail_with_the_survivors,
    awaited_return,
    live_mask,
)
from sglang_elastic_ep.sglang.upstream import (
    attached_state,
    elastic_state,
    expert_location_metadata,
    state_manager,
)
from sglang_elastic_ep.sglang.world_registration import adopt_launch_group_size
from sglang_elastic_ep.sglang.world_view import world_members_alive, world_quiesce

logger = get_logger(__name__)


def ranks_to_rejoin(state: Any) -> tuple[int, ...]:
    """The failed ranks this survivor waits for in place (``()`` while a scale is pending, or
    while a failed tail of scale-joined ranks is still to be let go). Before any scale too:
    upstream's own recovery has each survivor take the replacement back on the pass it sees it
    registered: with two survivors, on different passes."""
    if state.pending_ep_size is not None:
        return ()
    return failed_in_place(live_mask(state), int(state.effective_ep_size),
                           int(state.original_ep_size))


@dataclass
class LaunchRecoveryState:
    machine: LaunchRecoveryMachine | None = None  # this survivor's side of the latest rejoin


_STATE_ATTR = "_elastic_ep_launch_recovery"


def launch_recovery_machine(state: Any, ranks: tuple[int, ...],
                            now: float | None = None) -> LaunchRecoveryMachine:
    """This survivor's machine for the failed ``ranks`` that rejoin in place: built on first
    sight, and again when the failed set changes (what was seen of the ranks both share
    carries over)."""
    now = time.monotonic() if now is None else now
    holder = attached_state(state, _STATE_ATTR, LaunchRecoveryState)
    machine = holder.machine
    machine = (LaunchRecoveryMachine(ranks, now) if machine is None
               else machine.following(ranks, now))
    if machine is not holder.machine:
        joined = _scale_joined(state, ranks)
        logger.info("[elastic-ep] rank failure: ranks %s failed (%s); serving on without them "
                    "until their replacements are in WORLD (phase %s)", list(ranks),
                    f"scale-joined ranks {joined} below a live rank rejoin in place too"
                    if joined else "launched with the server", machine.phase.value)
        replacement_notices.announce_in_place(joined, int(state.effective_ep_size))
        holder.machine = machine
    return machine


def replacements_registered(state: Any, ranks: tuple[int, ...]) -> bool:
    """Every replacement of ``ranks`` is in Mooncake's WORLD (the local check upstream makes
    before ``recover_ranks``, read through this survivor's machine)."""
    return launch_recovery_machine(state, ranks).replacements_ready(world_members_alive(ranks))


def rejoin_in_place(runner: Any, state: Any, ranks: tuple[int, ...]) -> None:
    """The agreed step, on every survivor in the same pass: upstream's recovery over WORLD and
    the launch-time groups each survivor shares with the replacements."""
    machine = launch_recovery_machine(state, ranks)
    machine.entered(time.monotonic())
    what = _which(state, ranks)
    logger.info("[elastic-ep] rank %d takes back %s %s at %d ranks (phase %s)",
                runner._elastic_global_rank(), what, list(ranks), state.effective_ep_size,
                machine.phase.value)
    if recover_ranks(list(ranks), mirror_of(state), eplb_manager=runner.eplb_manager,
                     model_config=runner.model_config,
                     moe_ep_rank=runner._elastic_global_rank()):
        runner.forward_pass_id = 0
        machine.rejoined(time.monotonic())
        replacement_notices.withdraw_in_place(_scale_joined(state, ranks))
        logger.info("[elastic-ep] %s %s rejoined: serving on %d ranks again "
                    "(phase %s)", what, list(ranks), state.effective_ep_size, machine.phase.value)
    elif world_quiesce(state).take_backed_out():  # a member never came: nothing changed
        machine.rejoin_failed(time.monotonic())
        logger.warning("[elastic-ep] %s %s are taken back on a later agreed pass (phase %s)",
                       what, list(ranks), machine.phase.value)
    else:  # every survivor saw them registered on the agreed pass: Mooncake went back on it
        machine.rejoin_failed(time.monotonic())
        logger.error("[elastic-ep] %s %s left WORLD again before they were taken "
                     "back: waiting for the next replacement (phase %s)", what, list(ranks),
                     machine.phase.value)


def _scale_joined(state: Any, ranks: tuple[int, ...]) -> list[int]:
    """The ranks among ``ranks`` outside the launch-time groups (they joined by scale-up)."""
    return [r for r in ranks if r >= int(state.original_ep_size)]


def _which(state: Any, ranks: tuple[int, ...]) -> str:
    return "ranks" if _scale_joined(state, ranks) else "launch-time ranks"


# --------------------------------------------------------------------- the replacement's side

HEALTHY, REJOINING = 1, 2  # a rank's code in the source-rank exchange (0: no row)


def _started_as_joiner(state: Any) -> bool:
    """This process was started as a scale joiner (a scale-joined slot's replacement): its
    join offset is past rank 0."""
    return int(getattr(state, "ep_join_rank_offset", 0) or 0) > 0


def rejoin_then_reload_moved_experts(original: Callable[[Any], Any], runner: Any) -> Any:
    """AROUND ``ModelRunner.post_capture_elastic_ep_recover`` (the replacement's rejoin at
    start-up, after its weights were loaded for the launch layout): upstream's rejoin, then a
    reload of its experts if the survivors' map puts other experts in its slots. Its NIXL EP
    buffer (agent, memory registration) is created first, while the survivors serve on: on
    the pass that takes it back, only the handshakes are left."""
    state = elastic_state()
    if state is None:
        return original(runner)
    prepare_data_plane(runner.model, connect=False)
    rank = dist.get_rank()
    machine = ReplacementMachine(rank, time.monotonic())
    attached_state(state, _REPLACEMENT_ATTR, ReplacementState).machine = machine
    who = (f"replacement of scale-joined rank {rank}" if _started_as_joiner(state)
           else f"replacement of launch-time rank {rank}")
    logger.info("[elastic-ep] %s: waits for the survivors to take it back (phase %s)", who,
                machine.phase.value)
    loaded = own_slots(rank)
    result = run_step(machine, who, original, runner)
    machine.taken_back(time.monotonic())
    run_step(machine, who, reload_moved_experts, runner, rank, loaded)
    machine.serving(time.monotonic())
    logger.info("[elastic-ep] %s serves again; its rejoin: %s", who, breakdown(machine))
    return result


@dataclass
class ReplacementState:
    machine: ReplacementMachine | None = None  # this process's, when it is a replacement


_REPLACEMENT_ATTR = "_elastic_ep_replacement"


def replacement_machine(state: Any) -> ReplacementMachine | None:
    return attached_state(state, _REPLACEMENT_ATTR, ReplacementState).machine


def healthy_source_rank(original: Callable[..., int], *,
                        invoked_in_elastic_ep_rejoin_path: bool) -> int:
    """AROUND ``elastic_ep.get_healthy_expert_location_src_rank``: every member of WORLD (the
    survivors and the replacements, on the same step of a recovery) says whether it is healthy
    and, if so, the EP size it serves on; the first healthy rank broadcasts the expert map.

    Upstream gathers the flags over its launch-time ``world`` group; after a scale that group
    differs between ranks (a scale-joined rank built its own), so the exchange is one
    all-reduce over WORLD instead, where every member has one row. A replacement learns the
    size the survivors serve on here and takes it on before the broadcast that follows, and
    whether they wait for the replacement of a let-go tail (then it waits with them)."""
    state = elastic_state()
    if state is None or state.active_ranks is None:
        return original(invoked_in_elastic_ep_rejoin_path=invoked_in_elastic_ep_rejoin_path)
    rejoining = bool(invoked_in_elastic_ep_rejoin_path)
    rows = torch.zeros((int(state.active_ranks.numel()), 3), dtype=torch.int64,
                       device=state.active_ranks.device)
    own = (REJOINING, 0, 0) if rejoining else (HEALTHY, int(state.effective_ep_size),
                                                awaited_return(state))
    rows[dist.get_rank()] = torch.tensor(own, dtype=torch.int64)
    dist.all_reduce(rows, group=dist.group.WORLD)
    table = rows.cpu().tolist()  # a recovery step, not the per-pass path
    source = next((r for r, (code, _size, _back) in enumerate(table) if code == HEALTHY), None)
    if source is None:
        raise RuntimeError("No healthy rank found for broadcasting expert location metadata: "
                           f"every member of WORLD is rejoining ({table})")
    if rejoining:
        take_on_serving_size(state, int(table[source][1]))
        await_the_tail_with_the_survivors(state, int(table[source][2]))
    return source


def take_on_serving_size(state: Any, serving: int) -> None:
    """On a replacement, before the expert map is broadcast: serve at ``serving`` ranks (the
    survivors' size), not at the size its arguments describe (the launch size; for a
    scale-joined slot's replacement, its join offset plus its ranks). The same local steps as
    a scale-up's commit: the expert map's shape, DP attention, the NIXL data plane's size."""
    from sglang.srt.elastic_ep.elastic_ep import update_dp_attention_for_elastic_ep
    from sglang.srt.runtime_context import get_context, get_parallel

    parallel = get_parallel()
    rank = dist.get_rank()
    if _started_as_joiner(state):
        started = int(state.effective_ep_size)  # upstream's joiner state: offset + its ranks
    else:
        started = int(parallel.elastic_ep_initial_size or parallel.tp_size)
        state.original_ep_size = started
    adopt_launch_group_size(state)  # lower when a scale-down released launch-time ranks
    if serving == started == int(state.effective_ep_size) == int(state.original_ep_size):
        return  # the deployment never scaled: upstream's recovery as it is
    metadata = expert_location_metadata()
    if metadata is not None:
        # The broadcast that follows receives into this tensor and then rebuilds the metadata
        # from it (upstream's broadcast_global_expert_location_metadata): only its shape must
        # be the survivors' here, nothing reads it before.
        slots = metadata.num_physical_experts // started
        metadata.physical_to_logical_map = torch.zeros(
            (metadata.physical_to_logical_map.shape[0], slots * serving),
            dtype=metadata.physical_to_logical_map.dtype,
            device=metadata.physical_to_logical_map.device)
        get_context().override("elastic_ep.scale", ep_size=serving)
    state.effective_ep_size = serving
    state.has_scaled = True
    update_dp_attention_for_elastic_ep(physical_ep_size=serving, physical_ep_rank=rank)
    manager = state_manager()
    if manager._on_scale is not None:  # the NIXL data plane: every survivor is a member
        mark_ranks_activated(range(serving))
        if serving < started:
            # Slots a scale-down released before this process started: its buffer (created
            # before the rejoin, at the size it started with) never connected them, and no
            # token can be in flight to them, so its pending connects to them are dropped.
            mark_ranks_drained(range(serving, started))
    manager.on_scale(started, serving)
    logger.info("[elastic-ep] rank %d rejoins at the size the survivors serve on: %d ranks "
                "(launched at %d)", rank, serving, started)

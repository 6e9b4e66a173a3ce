"""A scale joiner's start-up: the driver of its machine (``core.scale_up_machine.JoinerMachine``).

Upstream's joiner start-up blocks in each step: it registers its cohort and waits in Mooncake's
``join_group`` until the serving ranks admit it (``join_scale_process_group``), receives the
expert map, builds its graphs, then meets the serving ranks at the commit barrier
(``_finalize_elastic_ep_joiner``). The hooks here wrap the first and the last, and tell the
machine when each returned, so the joiner's log says which step it is in, and how long each
took once it serves; a step that raises ends the machine in FAILED with the error before the
exception goes on. Before the barrier, a joiner whose slots the serving ranks' map fills with
other experts than it loaded at start-up loads them again (``replica_loading``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_up_machine import JoinerMachine
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.replica_loading import own_slots, reload_moved_experts
from sglang_elastic_ep.sglang.start_up_steps import breakdown, run_step
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_state
from sglang_elastic_ep.sglang.world_registration import adopt_launch_group_size

logger = get_logger(__name__)

_STATE_ATTR = "_sglang_eep_scale_joiner"


@dataclass
class JoinerState:
    machine: JoinerMachine | None = None
    # The logical expert of each of its slots, per layer, as it loaded them at start-up.
    loaded: list[list[int]] | None = None


def joiner_machine() -> JoinerMachine | None:
    """This process's joiner machine (None on a process that is not a scale joiner)."""
    state = elastic_state()
    return None if state is None else attached_state(state, _STATE_ATTR, JoinerState).machine


def _is_scale_joiner() -> bool:
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    return bool(moe.elastic_ep_backend is not None and moe.is_ep_scale_joiner)


def join_world(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``model_runner.join_scale_process_group`` (its cohort registered, the joiner waits
    in Mooncake's ``join_group`` until the serving ranks admit it): builds the joiner's
    machine, which leaves PENDING when this returns."""
    state = elastic_state()
    if state is None or not _is_scale_joiner():
        return original(*args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    adopt_launch_group_size(state)
    machine = JoinerMachine(join_offset=int(parallel.ep_join_rank_offset),
                            new_size=int(parallel.ep_join_rank_offset + parallel.tp_size),
                            started_at=time.monotonic())
    holder = attached_state(state, _STATE_ATTR, JoinerState)
    holder.machine = machine
    # Before the serving ranks' map arrives: the slots as this rank loaded them.
    holder.loaded = own_slots(int(parallel.ep_join_rank_offset) + int(parallel.tp_rank))
    logger.info("[elastic-ep] scale joiner for EP ranks %s of %d registered its cohort: waits "
                "for the serving ranks to admit it (phase %s)", list(machine.ranks),
                machine.new_size, machine.phase.value)
    result = run_step(machine, _who(machine), original, *args, **kwargs)
    machine.admitted(time.monotonic())
    logger.info("[elastic-ep] scale joiner admitted into WORLD after %.1f s: receives the expert "
                "map and builds its graphs (phase %s)",
                machine.seconds_in_phases()[Phase.PENDING], machine.phase.value)
    return result


def commit_joining(original: Any, runner: Any, target_size: int) -> Any:
    """AROUND ``ModelRunner._finalize_elastic_ep_joiner``: the commit barrier with the serving
    ranks, then serving; one line with the start-up's breakdown."""
    machine = joiner_machine()
    if machine is None or machine.done:
        return original(runner, target_size)
    holder = attached_state(elastic_state(), _STATE_ATTR, JoinerState)
    reload_moved_experts(runner, runner._elastic_global_rank(), holder.loaded)
    machine.syncing(time.monotonic())
    result = run_step(machine, _who(machine), original, runner, target_size)
    machine.serving(time.monotonic())
    logger.info("[elastic-ep] scale joiner serves EP ranks %s at EP size %d; its start-up: %s",
                list(machine.ranks), machine.new_size, breakdown(machine))
    return result


def _who(machine: JoinerMachine) -> str:
    return f"scale joiner for EP ranks {list(machine.ranks)}"

"""A scale joiner's start-up: the driver of its machine (``core.scale_up_machine.JoinerMachine``).

Upstream's joiner start-up blocks in each step: it registers its cohort and waits in Mooncake's
``join_group`` until the serving ranks admit it (``join_scale_process_group``), receives the
expert map, allocates its KV cache, builds its graphs, then meets the serving ranks at the
commit barrier (``_finalize_elastic_ep_joiner``). The serving ranks stop serving from the
admission to the barrier, so everything the joiner does in between is a pause for every client.

Prepare, then join: the joiner does its own work first, while the serving ranks serve on
(:func:`prepare_then_join`). It creates its NIXL EP buffer, and, when its start-up captures no
graphs, it applies the topology of the new size and leaves the steps over WORLD (register,
admission, the expert map) to the commit (:func:`commit_joining`): the KV cache is allocated
before it registers. Graph capture runs the model over the expanded WORLD, so a joiner that
captures graphs keeps upstream's order, and so does a joiner started with
``SGLANG_EEP_JOINER_PREPARE=0`` (to compare the two, or as a fallback). At the commit every rank
connects its NIXL buffer to the new ranks before the barrier
(``commit_barrier.agreed_commit_barrier``).

The hooks tell the machine when each step returned, so the joiner's log says which step it is
in, and how long each took once it serves; a step that raises ends the machine in FAILED with
the error before the exception goes on. Before the barrier, a joiner whose slots the serving
ranks' map fills with other experts than it loaded at start-up loads them again
(``replica_loading``).

A replacement of a scale-joined rank below a live one starts as a scale joiner too (its
arguments name its slot's offset), but the survivors await it in place and say so in the
rendezvous store (``replacement_notices``): it then registers no cohort and meets no commit
barrier, and at its commit point runs upstream's rejoin instead (``launch_recovery``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.scale_up_machine import JoinerMachine
from sglang_elastic_ep.sglang import replacement_notices, tail_recovery
from sglang_elastic_ep.sglang.nixl_buffer_hooks import prepare_data_plane
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.replica_loading import own_slots, reload_moved_experts
from sglang_elastic_ep.sglang.start_up_steps import breakdown, run_step
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_state, scale_timeout_s
from sglang_elastic_ep.sglang.world_registration import adopt_launch_group_size

logger = get_logger(__name__)

_STATE_ATTR = "_sglang_eep_scale_joiner"
# "0": the joiner registers first, as upstream does (read once, at its start-up).
PREPARE_ENV = "SGLANG_EEP_JOINER_PREPARE"


@dataclass
class JoinerState:
    machine: JoinerMachine | None = None
    # The logical expert of each of its slots, per layer, as it loaded them at start-up.
    loaded: list[list[int]] | None = None
    # Its steps over WORLD (register, admission, the expert map) wait for the commit.
    join_deferred: bool = False
    # The survivors' size when it replaces a scale-joined rank below a live one (0: it joins).
    rejoin_in_place_at: int = 0
    # From its registration until it serves: ends it once the serving ranks count it out.
    counted_out_watch: AdmissionWatchdog | None = None


def joiner_machine() -> JoinerMachine | None:
    """This process's joiner machine (None on a process that is not a scale joiner)."""
    state = elastic_state()
    return None if state is None else attached_state(state, _STATE_ATTR, JoinerState).machine


def _is_scale_joiner() -> bool:
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    return bool(moe.elastic_ep_backend is not None and moe.is_ep_scale_joiner)


def prepare_then_join(original: Any, runner: Any) -> Any:
    """AROUND ``ModelRunner._initialize_elastic_ep_joiner`` (the model is loaded): prepare what
    needs no other rank before registering (see the module docstring)."""
    state = elastic_state()
    if state is None or not _is_scale_joiner() or getattr(runner, "is_draft_worker", False):
        return original(runner)
    prepare_data_plane(runner.model, connect=False)
    holder = attached_state(state, _STATE_ATTR, JoinerState)
    rank = _join_size_and_rank()[1]
    holder.rejoin_in_place_at = replacement_notices.in_place_size(rank)
    if holder.rejoin_in_place_at:
        # Its slot is below a live rank: the survivors take it back where it is, as a
        # launch-time rank's replacement (upstream's rejoin over WORLD), not as a scale joiner.
        from sglang.srt.layers.dp_attention import enable_joiner_all_gather

        enable_joiner_all_gather()
        logger.info("[elastic-ep] replacement of scale-joined rank %d: the survivors serve on "
                    "%d ranks and await it in place; it rejoins once its start-up is done",
                    rank, holder.rejoin_in_place_at)
        return None
    if not _joins_at_the_commit():
        return original(runner)
    _apply_join_topology(runner, state)
    holder.join_deferred = True
    logger.info("[elastic-ep] scale joiner prepares before it registers: KV cache and start-up "
                "first, the serving ranks admit it at the commit")
    return None


def _joins_at_the_commit() -> bool:
    """Whether this joiner leaves its steps over WORLD to the commit: its start-up captures no
    graphs, and the operator did not ask for upstream's order."""
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    return os.environ.get(PREPARE_ENV, "1") != "0" and bool(cuda_graph_fully_disabled())


def _join_size_and_rank() -> tuple[int, int]:
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return (int(parallel.ep_join_rank_offset + parallel.tp_size),
            int(parallel.ep_join_rank_offset + parallel.tp_rank))


def _apply_join_topology(runner: Any, state: Any) -> None:
    """The local half of upstream's ``_initialize_elastic_ep_joiner``: this process's view of
    the new size (config, DP attention over WORLD, the active ranks), in upstream's order."""
    from sglang.srt.layers.dp_attention import enable_joiner_all_gather
    from sglang.srt.model_executor import model_runner as mr

    join_size, global_ep_rank = _join_size_and_rank()
    mr.get_context().override("elastic_ep.scale_join", ep_size=join_size)
    enable_joiner_all_gather()
    mr.update_dp_attention_for_elastic_ep(physical_ep_size=join_size,
                                          physical_ep_rank=global_ep_rank)
    if runner.eplb_manager is not None:
        runner.eplb_manager.disable_rebalance(
            "EPLB rebalance is disabled while elastic EP scale-up is being finalized")
    state.active_ranks.zero_()
    state.active_ranks[:join_size] = 1
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    state.scale_phase = Phase.SYNCING_NEW_WORLD.value


def _register_and_join(runner: Any) -> None:
    """The WORLD half of upstream's ``_initialize_elastic_ep_joiner``: register the cohort,
    wait for the admission (:func:`join_world`), receive the serving ranks' expert map."""
    import torch.distributed as dist
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    join_size, global_ep_rank = _join_size_and_rank()
    dist.barrier(group=parallel.tp_group.cpu_group)
    if parallel.tp_rank == 0:
        mr.register_scale_cohort(parallel.ep_join_rank_offset, join_size,
                                 runner._elastic_cuda_graph_enabled())
    mr.join_scale_process_group()
    mr.broadcast_global_expert_location_metadata(model_config=runner.model_config,
                                                 moe_ep_rank=global_ep_rank, src_rank=0)
    mr.set_global_expert_distribution_recorder(mr.ExpertDistributionRecorder.init_new(
        mr.get_global_expert_location_metadata(), rank=global_ep_rank))


# The exit code of a joiner that was never admitted (its server then exits non-zero too).
EXIT_NOT_ADMITTED = 3


# How often a joiner waiting for its admission looks for the survivors' notices.
TURNED_AWAY_POLL_S = 2.0


def end_the_joiners_server(code: int) -> None:
    """End this scheduler with ``code`` as upstream's scheduler ends on an exception: SIGQUIT
    to its parent (which then takes the server down), then its own exit. An exit alone, in
    the scheduler's start-up, is not seen by its parent, which waits for the scheduler's
    start-up report on a pipe whose write end it holds too: the server would live on."""
    os.kill(os.getppid(), signal.SIGQUIT)
    os._exit(code)


class AdmissionWatchdog:
    """Ends a scale joiner's process when it has waited in Mooncake's ``join_group`` longer
    than ``timeout_s`` (``--elastic-ep-scale-timeout``) after registering its cohort, or as soon
    as ``turned_away`` (polled every ``poll_s``) gives a reason no admission will come.

    ``join_group`` has no timeout that can be set (Mooncake's own wait there lasts minutes,
    docs/cpu-testbed.md): a joiner whose scale-up was called off (cancelled, timed out on the
    serving ranks) or whose admission Mooncake gave up on would wait there, alive and silent.
    By then the serving ranks have dropped the scale (or committed without it), so the joiner
    exits with :data:`EXIT_NOT_ADMITTED` and a line that says why, and the orchestrator sees a
    failed process instead of one that never becomes ready. ``timeout_s`` 0: no limit."""

    def __init__(self, timeout_s: float, who: str,
                 exit_process: Callable[[int], None] = end_the_joiners_server,
                 turned_away: Callable[[], str | None] | None = None,
                 poll_s: float = TURNED_AWAY_POLL_S) -> None:
        self.timeout_s = timeout_s
        self.who = who
        self.poll_s = poll_s
        self._exit_process = exit_process
        self._turned_away = turned_away
        self._admitted = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> AdmissionWatchdog:
        if self.timeout_s > 0 or self._turned_away is not None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="eep-admission-watchdog")
            self._thread.start()
        return self

    def stop(self) -> None:
        """The wait it watches is over: it ends without firing."""
        self._admitted.set()

    def __enter__(self) -> AdmissionWatchdog:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _watch(self) -> None:
        deadline = time.monotonic() + self.timeout_s if self.timeout_s > 0 else float("inf")
        while True:
            left = deadline - time.monotonic()
            step = left if self._turned_away is None else min(left, self.poll_s)
            if self._admitted.wait(max(0.0, step)):
                return
            if time.monotonic() >= deadline:
                self._expire()
                return
            reason = self._why_turned_away()
            if reason is not None and not self._admitted.is_set():
                logger.error("[elastic-ep] %s gives up its admission: %s. It exits %d",
                             self.who, reason, EXIT_NOT_ADMITTED)
                self._exit_process(EXIT_NOT_ADMITTED)
                return

    def _why_turned_away(self) -> str | None:
        if self._turned_away is None:
            return None
        try:
            return self._turned_away()
        except Exception as exc:  # noqa: BLE001 - a store hiccup: the deadline still holds
            logger.debug("[elastic-ep] %s: could not read the survivors' notices: %s",
                         self.who, exc)
            return None

    def _expire(self) -> None:
        logger.error("[elastic-ep] %s was not admitted within --elastic-ep-scale-timeout "
                     "(%.0f s) of registering its cohort: the serving ranks have dropped that "
                     "scale-up (cancelled or timed out) or Mooncake gave up on this joiner. It "
                     "exits %d; POST /scale_elastic_ep again and start a new joiner",
                     self.who, self.timeout_s, EXIT_NOT_ADMITTED)
        self._exit_process(EXIT_NOT_ADMITTED)


def awaited_in_place(ranks: range) -> str | None:
    """Why a registered cohort for ``ranks`` will never be admitted: the survivors await some
    of them in place (failed below a live rank; they noticed after this joiner had read no
    notice at start-up), else None."""
    waiting = [r for r in ranks if replacement_notices.in_place_size(r)]
    if not waiting:
        return None
    return (f"the survivors await ranks {waiting} in place (failed below a live rank) and "
            "admit no scale cohort for them; relaunch this joiner with the same arguments: "
            "it reads their notice at start-up and rejoins in place")


def counted_out_since(registered: dict[int, int]) -> str | None:
    """Why a registered cohort will never be admitted: the serving ranks counted some of its
    ranks out of Mooncake's WORLD at their commit since it registered (``registered``: each
    rank's count then), and let their slots go; else None."""
    out = [rank for rank, seen in registered.items()
           if replacement_notices.times_counted_out(rank) > seen]
    if not out:
        return None
    return (f"the serving ranks counted ranks {out} out of Mooncake's WORLD at their commit "
            "(this joiner's admission was not acknowledged in time) and let the slots go; "
            "relaunch this joiner with --ep-join-mode recover and the same arguments")


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
    # Admitted by Mooncake, it may still be counted out at the serving ranks' commit (its
    # acknowledgement too late): they then go on without it, and its next collective (the
    # expert map, the commit barrier) would wait for good. So this watch lasts until it serves.
    counted_out = {rank: replacement_notices.times_counted_out(rank) for rank in machine.ranks}
    holder.counted_out_watch = AdmissionWatchdog(
        0, _who(machine), turned_away=lambda: counted_out_since(counted_out)).start()
    try:
        with AdmissionWatchdog(scale_timeout_s(), _who(machine),
                               turned_away=lambda: awaited_in_place(machine.ranks)):
            result = run_step(machine, _who(machine), original, *args, **kwargs)
    except BaseException:
        stop_the_counted_out_watch(holder)
        raise
    machine.admitted(time.monotonic())
    logger.info("[elastic-ep] scale joiner admitted into WORLD after %.1f s: receives the expert "
                "map (phase %s)",
                machine.seconds_in_phases()[Phase.PENDING], machine.phase.value)
    return result


def commit_joining(original: Any, runner: Any, target_size: int) -> Any:
    """AROUND ``ModelRunner._finalize_elastic_ep_joiner``: the steps over WORLD a prepared
    joiner left for now, then the commit barrier with the serving ranks, then serving; one line
    with the start-up's breakdown."""
    state = elastic_state()
    if state is None:
        return original(runner, target_size)
    holder = attached_state(state, _STATE_ATTR, JoinerState)
    if holder.rejoin_in_place_at:
        holder.rejoin_in_place_at = 0
        # Upstream's rejoin (through launch_recovery.rejoin_then_reload_moved_experts): WORLD
        # takes it back, it takes on the survivors' size and receives their expert map. No
        # commit barrier: the survivors' take-back has none.
        return runner.post_capture_elastic_ep_recover()
    try:
        if holder.join_deferred:
            holder.join_deferred = False
            _register_and_join(runner)
        machine = joiner_machine()
        if machine is None or machine.done:
            return original(runner, target_size)
        reload_moved_experts(runner, runner._elastic_global_rank(), holder.loaded)
        # A replacement of the lowest slots of a let-go tail: the survivors still await the
        # rest.
        awaited = replacement_notices.tail_awaited_above(machine.new_size)
        machine.syncing(time.monotonic())
        result = run_step(machine, _who(machine), original, runner, target_size)
        machine.serving(time.monotonic())
    finally:
        stop_the_counted_out_watch(holder)
    tail_recovery.await_the_tail_with_the_survivors(state, awaited)
    logger.info("[elastic-ep] scale joiner serves EP ranks %s at EP size %d; its start-up: %s",
                list(machine.ranks), machine.new_size, breakdown(machine))
    return result


def stop_the_counted_out_watch(holder: JoinerState) -> None:
    if holder.counted_out_watch is not None:
        holder.counted_out_watch.stop()
        holder.counted_out_watch = None


def _who(machine: JoinerMachine) -> str:
    return f"scale joiner for EP ranks {list(machine.ranks)}"

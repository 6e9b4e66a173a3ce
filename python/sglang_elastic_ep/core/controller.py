"""The controller's decisions, pure: observations of the server and the launcher in, actions out.

``ElasticController`` is fed what the I/O loop reads (``GET /elastic_ep/status``,
``GET /elastic_ep/health``, the load from ``/metrics``, the event stream, what the launcher
runs) and answers ``decide(now)`` with a ``Decision``: actions to carry out (``ScaleTo``,
``LaunchJoiner``, ``Relaunch``, ``Terminate``, ``CancelScale``) and holds (why nothing else
happens), each with its reason and the inputs it was based on.

Resuming: every decision is derived from the server's state as it is now (status, health,
the event buffer, which the loop replays from the start on every connection to a new server
instance) and from what the launcher runs. The operation ids carry what the controller needs
to remember between operations: ``<prefix>-<n>-<purpose>-to-<size>``, e.g.
``ctl-4-remove-to-2`` then ``ctl-5-regrow-to-3`` (the removal's ``old_ep_size`` says what to
regrow to). The only memory of its own is short-lived: the load windows, the operation it
just asked for until the status shows it, and relaunches that died before rejoining (the
server never saw those); a restarted controller starts these afresh.

Rules, in order, on every decision:

1. Processes of ranks the server lists ``safe_to_terminate`` are terminated, and no other
   process ever is, except the previous process of a rank the server reports failed,
   hard-blocked or stuck, which its replacement takes over (``Relaunch``).
2. One operation at a time: while one runs (anyone's), the only actions are launching the
   joiners of a running scale-up that have none yet, and cancelling a scale-up of this
   controller's whose joiner exited before its commit point.
3. A failed rank (status ``failed``), a slow one (health ``hard_blocked``), or one stuck
   while serving has stalled for ``heal_stall_after_s`` (``core.stall.ranks_to_end``) is
   relaunched in recover mode
   (``<prefix>-recover-r<rank>-e<event id of the fault>-<attempt>``); after
   ``max_relaunches`` relaunches that failed again it is removed with a scale-down of the
   failed tail (or past failed ranks with active ranks above them, which drain), and a
   scale-up then restores the size it had. A relaunch brings back any rank: a failed tail of
   scale-joined ranks is re-admitted, and any other failed rank rejoins in place.
4. Otherwise the autoscaling policy (``core.autoscaler``) decides.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.core.api_models import (
    EventModel,
    HealthResponse,
    OperationKind,
    OperationResult,
    OperationStatus,
    RankFailedEvent,
    RankRecoveredEvent,
    RankState,
    RecoveryRequiredEvent,
    ScaleCommittedEvent,
    StatusResponse,
)
from sglang_elastic_ep.core.autoscaler import Autoscaler, AutoscalerConfig, LoadSample
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.core.stall import outlasted_count_out, ranks_to_end


class JoinMode(str, enum.Enum):
    SCALE = "scale"  # a new rank for a scale-up
    RECOVER = "recover"  # a replacement for a failed rank


class Purpose(str, enum.Enum):
    GROW = "grow"
    SHRINK = "shrink"
    REMOVE = "remove"  # scale-down that removes failed ranks the controller gave up on
    REGROW = "regrow"  # scale-up that restores the size a removal took away


@dataclass(frozen=True)
class JoinerSpec:
    """One joiner process: ranks ``[rank_offset, rank_offset + num_ranks)``."""

    rank_offset: int
    num_ranks: int
    mode: JoinMode
    operation_id: str  # the scale-up it joins, or the recovery attempt's id
    ep_size: int  # the EP size it joins into

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.num_ranks)


@dataclass(frozen=True)
class Launch:
    """What a launcher runs (or ran) for one joiner."""

    handle: str  # pid, pod name
    rank_offset: int
    num_ranks: int
    mode: JoinMode
    operation_id: str
    alive: bool
    started_at: float | None = None  # wall-clock seconds
    exit_code: int | None = None  # once it ended, where the launcher can tell

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.num_ranks)


@dataclass(frozen=True)
class LoadReading:
    """The load as read from ``/metrics``: means over the shards that report it."""

    queued_per_rank: float | None
    running_per_rank: float | None
    kv_usage: float | None = None
    shards: int = 0


@dataclass(frozen=True)
class ScaleTo:
    target: int
    operation_id: str
    purpose: Purpose
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class LaunchJoiner:
    spec: JoinerSpec
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Relaunch:
    """Stop what still runs for exactly ``spec.ranks`` (the server reports them failed or
    hard-blocked, or they are stuck in a stall) and launch a replacement in recover mode.
    ``stuck``: the old process is stuck in a pass and cannot stop gracefully (its server waits
    for a shutdown its scheduler never takes): it is killed at once, without a grace."""

    spec: JoinerSpec
    attempt: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)
    stuck: bool = False


@dataclass(frozen=True)
class Terminate:
    ranks: tuple[int, ...]  # every one listed safe_to_terminate by the server
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class CancelScale:
    """``DELETE /scale_elastic_ep/{operation_id}``: a scale-up of this controller's whose
    joiner exited before the commit point is called off, so nothing waits for the scale
    timeout; its slots are then listed safe to terminate and the policy may try again."""

    operation_id: str
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Hold:
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict, compare=False)


Action = ScaleTo | LaunchJoiner | Relaunch | Terminate | CancelScale


@dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...] = ()
    holds: tuple[Hold, ...] = ()


@dataclass(frozen=True)
class ControllerConfig:
    policy: AutoscalerConfig
    launch_size: int | None = None  # ranks [0, launch_size) are `sglang serve`'s; default min
    max_relaunches: int = 2  # recover relaunches of one rank before it is removed instead
    recover_timeout_s: float = 900.0  # a replacement not back by then counts as failed
    heal_retry_s: float = 15.0  # wait after a failed removal before trying again
    # Serving stalled this long (the status's ``stalled_s``): end the stuck ranks and relaunch
    # them as failed ones; 0 never does.
    heal_stall_after_s: float = 120.0
    request_timeout_s: float = 120.0  # forget an asked-for operation the status never shows
    autoscale: bool = True
    heal: bool = True
    op_prefix: str = "ctl"

    def __post_init__(self) -> None:
        step = self.policy.step
        if self.launch_size is not None and (
            self.launch_size < 1 or self.launch_size % step
            or self.launch_size > self.policy.max_size
        ):
            raise ValueError(
                f"launch_size must be a multiple of step ({step}) in [1, max_size] "
                f"(got {self.launch_size})"
            )
        if self.max_relaunches < 0:
            raise ValueError("max_relaunches must be >= 0")
        if min(self.recover_timeout_s, self.heal_retry_s, self.request_timeout_s,
               self.heal_stall_after_s) < 0:
            raise ValueError("timeouts must be >= 0 seconds")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}", self.op_prefix):
            raise ValueError(
                f"op_prefix must be 1-32 letters, digits, '.', '_' or '-' (got {self.op_prefix!r})"
            )

    @property
    def first_own_rank(self) -> int:
        return self.launch_size if self.launch_size is not None else self.policy.min_size


@dataclass(frozen=True)
class ParsedOperationId:
    number: int
    purpose: Purpose
    target: int


def operation_id(prefix: str, number: int, purpose: Purpose, target: int) -> str:
    return f"{prefix}-{number}-{purpose.value}-to-{target}"


def parse_operation_id(prefix: str, op_id: str) -> ParsedOperationId | None:
    """The parts of an id made by ``operation_id`` with this prefix; None for anyone else's."""
    purposes = "|".join(p.value for p in Purpose)
    match = re.fullmatch(rf"{re.escape(prefix)}-(\d+)-({purposes})-to-(\d+)", op_id)
    if match is None:
        return None
    return ParsedOperationId(int(match[1]), Purpose(match[2]), int(match[3]))


def recover_operation_id(prefix: str, rank_offset: int, fault: int, attempt: int) -> str:
    """Id of one relaunch: ``fault`` is the id of the event that reported the failure (0 when
    unknown), so relaunches for different faults of one slot never share an id."""
    return f"{prefix}-recover-r{rank_offset}-e{fault}-{attempt}"


@dataclass
class _EventMemory:
    """What the event buffer of one server instance says about failures (rebuilt on replay)."""

    instance_id: str
    last_event_id: int = 0
    failures: dict[int, int] = field(default_factory=dict)  # since the slot was last filled
    open: dict[int, int] = field(default_factory=dict)  # failed, not back: rank -> event id


class ElasticController:
    """Feed it observations, ask ``decide(now)``; it does no I/O."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self._policy = Autoscaler(config.policy)
        self._status: StatusResponse | None = None
        self._health: HealthResponse | None = None
        self._load: LoadReading | None = None
        self._launches: tuple[Launch, ...] = ()
        self._events: _EventMemory | None = None
        self._next_number = 1
        self._asked: tuple[str, float, Purpose] | None = None  # id, when we asked, why
        # A removal or regrow the server refused without recording it (or a dry run): wait
        # --heal-retry before asking again rather than asking on every pass.
        self._heal_quiet_until = float("-inf")
        # Relaunches that died or timed out before the rank rejoined: the server never saw
        # them, so only we count them (a restarted controller starts from zero).
        self._failed_relaunches: dict[int, int] = {}
        self._counted: set[str] = set()

    # --- observations ---------------------------------------------------------------

    def observe_status(self, status: StatusResponse) -> None:
        if self._status is not None and self._status.instance_id != status.instance_id:
            self._forget_instance()
        self._status = status
        ids = [op.operation_id for op in _operations(status)]
        numbers = [p.number for i in ids if (p := parse_operation_id(self.config.op_prefix, i))]
        if numbers:
            self._next_number = max(self._next_number, max(numbers) + 1)
        if self._asked is not None and self._asked[0] in ids:
            self._asked = None  # the server shows it: from now on the status speaks for it

    def observe_health(self, health: HealthResponse | None) -> None:
        self._health = health

    def observe_load(self, load: LoadReading | None) -> None:
        self._load = load

    def observe_launches(self, launches: Iterable[Launch]) -> None:
        self._launches = tuple(launches)
        # Ids stay unique across server restarts too: a joiner of an earlier instance's
        # "ctl-1-grow-to-3" must not pass for the new one's.
        numbers = [p.number for launch in self._launches
                   if (p := parse_operation_id(self.config.op_prefix, launch.operation_id))]
        if numbers:
            self._next_number = max(self._next_number, max(numbers) + 1)

    def observe_event(self, event: EventModel) -> None:
        """One event from the stream (replays of already-seen ids are ignored)."""
        memory = self._events
        if memory is None or memory.instance_id != event.instance_id:
            memory = self._events = _EventMemory(event.instance_id)
        if event.event_id <= memory.last_event_id:
            return
        memory.last_event_id = event.event_id
        if isinstance(event, RankFailedEvent | RecoveryRequiredEvent):
            # recovery_required usually follows rank_failed for the same fault: one failure.
            for rank in event.ranks:
                if rank not in memory.open:
                    memory.open[rank] = event.event_id
                    memory.failures[rank] = memory.failures.get(rank, 0) + 1
        elif isinstance(event, RankRecoveredEvent):
            for rank in event.ranks:
                memory.open.pop(rank, None)
        elif isinstance(event, ScaleCommittedEvent):
            # The slots were filled afresh (scale-up) or emptied (scale-down): a new rank.
            for rank in event.ranks:
                memory.failures.pop(rank, None)
                memory.open.pop(rank, None)
                self._failed_relaunches.pop(rank, None)

    def observe_missed(self, instance_id: str) -> None:
        """Events were lost (the server's buffer overran, or it restarted).

        From the same instance, the counts so far stay: with the lost events they were a lower
        bound and still are. Another instance's counts say nothing about this one.
        """
        if self._events is None or self._events.instance_id != instance_id:
            self._events = _EventMemory(instance_id)

    def observe_scale_answer(self, op_id: str, *, accepted: bool) -> None:
        """The answer to our POST (``accepted=False`` also for no answer, or a dry run)."""
        if not accepted and self._asked is not None and self._asked[0] == op_id:
            _, asked_at, purpose = self._asked
            if purpose in (Purpose.REMOVE, Purpose.REGROW):
                self._heal_quiet_until = asked_at + self.config.heal_retry_s
            self._asked = None

    # --- the decision ---------------------------------------------------------------

    def decide(self, now: float) -> Decision:
        status = self._status
        if status is None:
            return Decision(holds=(Hold("no status read from the server yet"),))
        actions: list[Action] = []
        holds: list[Hold] = []

        released = self._releasable(status)
        if released:
            actions.append(Terminate(
                tuple(released),
                f"the server lists rank(s) {_ranks(released)} safe to terminate",
                {"safe_to_terminate_ranks": list(status.safe_to_terminate_ranks)},
            ))

        if self._asked is not None:
            op_id, asked_at, _ = self._asked
            if now - asked_at <= self.config.request_timeout_s:
                holds.append(Hold(f"waiting for the server to show operation {op_id}"))
                return Decision(tuple(actions), tuple(holds))
            self._asked = None

        op = status.current_operation
        if op is not None:
            self._during_operation(status, op, now, actions, holds)
            self._policy.decide(self._sample(status, now, busy=True))
            return Decision(tuple(actions), tuple(holds))

        troubled = self._troubled(status)
        stuck = self._stuck(status, troubled)
        troubled = dict(sorted({**stuck, **troubled}.items()))
        if troubled:
            self._policy.decide(self._sample(status, now, busy=True))
            if self.config.heal:
                self._heal(status, troubled, set(stuck), now, actions, holds)
            else:
                holds.append(Hold(f"rank(s) {_ranks(troubled)} failed; healing is off (--no-heal)",
                                  {"troubled": _troubled_inputs(troubled)}))
            return Decision(tuple(actions), tuple(holds))

        stall = status.stalled
        if stall is not None:
            # No resize while passes do not complete: it would wait behind the stall.
            self._policy.decide(self._sample(status, now, busy=True))
            after = self.config.heal_stall_after_s
            if not self.config.heal or after == 0:
                then = "healing stalls is off (--no-heal or --heal-stall-after 0)"
            elif stall.stalled_s < after:
                then = f"its stuck ranks are relaunched from --heal-stall-after {after:g} s on"
            else:
                then = ("no rank to end: where each scheduler is could not be read (start the "
                        "server with --dist-init-addr) or none is stuck in a pass")
            holds.append(Hold(f"serving stalled for {stall.stalled_s:.0f} s ({stall.message}); "
                              f"{then}", {"stalled_s": stall.stalled_s}))
            return Decision(tuple(actions), tuple(holds))

        if released:
            # A slot about to be refilled must be free of its old process first.
            self._policy.decide(self._sample(status, now, busy=True))
            holds.append(Hold("terminating released ranks before anything else"))
            return Decision(tuple(actions), tuple(holds))

        holes = _holes(status)
        if holes:
            # Sizes count ranks 0..n-1: the server refuses every size change until the holes
            # close, and only their own relaunch closes them.
            self._policy.decide(self._sample(status, now, busy=True))
            holds.append(Hold(
                f"rank(s) {_ranks(holes)} were removed where they were and leave holes; "
                "relaunch them with --ep-join-mode recover to refill them (a launch-time "
                "rank's node, a scale-joined rank's joiner at its offset; scaling waits "
                "until then)", {"holes": holes},
            ))
            return Decision(tuple(actions), tuple(holds))

        if self._regrow(status, now, actions, holds):
            return Decision(tuple(actions), tuple(holds))

        if not self.config.autoscale:
            holds.append(Hold("autoscaling is off (--no-autoscale)"))
            return Decision(tuple(actions), tuple(holds))
        verdict = self._policy.decide(self._sample(status, now, busy=False))
        if verdict.target is None:
            holds.append(Hold(verdict.reason, verdict.inputs))
        elif verdict.target > status.max_ep_size:
            holds.append(Hold(
                f"{verdict.reason}, but {verdict.target} is above the server's --max-ep-size "
                f"{status.max_ep_size}", verdict.inputs,
            ))
        else:
            size = status.effective_ep_size
            target = verdict.target
            floor = self.config.first_own_rank
            if target < size and target < floor:
                # Ranks below the launch size are `sglang serve`'s processes, which this
                # controller neither launches nor terminates: it never shrinks below them.
                # (The policy shrinks one step at a time and the launch size is whole steps,
                # so this is at it.)
                holds.append(Hold(
                    f"{verdict.reason}, but ranks below --launch-size {floor} belong to "
                    f"`sglang serve`, not to this controller: staying at {size}", verdict.inputs,
                ))
                return Decision(tuple(actions), tuple(holds))
            purpose = Purpose.GROW if target > size else Purpose.SHRINK
            actions.append(self._scale(
                target, purpose, now,
                f"{purpose.value} {size} -> {target}: {verdict.reason}", verdict.inputs,
            ))
        return Decision(tuple(actions), tuple(holds))

    # --- parts ----------------------------------------------------------------------

    def _forget_instance(self) -> None:
        self._asked = None
        self._heal_quiet_until = float("-inf")
        self._failed_relaunches.clear()
        self._counted.clear()

    def _releasable(self, status: StatusResponse) -> list[int]:
        safe = set(status.safe_to_terminate_ranks)
        ranks: set[int] = set()
        for launch in self._launches:
            if launch.alive and set(launch.ranks) <= safe:
                ranks.update(launch.ranks)
        return sorted(ranks)

    def _sample(self, status: StatusResponse, now: float, *, busy: bool) -> LoadSample:
        load = self._load
        newest = status.recent_operations[0] if status.recent_operations else None
        active = sum(
            1 for r in status.ranks if r.state in (RankState.ACTIVE, RankState.LEAVING)
        )
        return LoadSample(
            now=now,
            current_size=status.effective_ep_size,
            active_ranks=active,
            queued_per_rank=load.queued_per_rank if load else None,
            running_per_rank=load.running_per_rank if load else None,
            kv_usage=load.kv_usage if load else None,
            busy=busy,
            last_finished_at=newest.finished_at if newest else None,
        )

    def _scale(
        self, target: int, purpose: Purpose, now: float, reason: str, inputs: Mapping[str, Any]
    ) -> ScaleTo:
        op_id = operation_id(self.config.op_prefix, self._next_number, purpose, target)
        self._next_number += 1
        self._asked = (op_id, now, purpose)
        return ScaleTo(target, op_id, purpose, reason, dict(inputs))

    def _spans(self, first: int, stop: int) -> list[int]:
        """Offsets of the joiners that cover ranks [first, stop)."""
        step = self.config.policy.step
        return list(range(first - first % step, stop, step))

    def _during_operation(
        self,
        status: StatusResponse,
        op: OperationStatus,
        now: float,
        actions: list[Action],
        holds: list[Hold],
    ) -> None:
        holds.append(Hold(
            f"operation {op.operation_id} runs ({op.kind.value} {op.old_ep_size} -> "
            f"{op.new_ep_size}, phase {op.phase.value}); one at a time",
        ))
        if op.kind is not OperationKind.SCALE_UP:
            return
        step = self.config.policy.step
        own = self.config.first_own_rank
        for offset in self._spans(op.old_ep_size, op.new_ep_size):
            span = range(offset, offset + step)
            if offset < own:
                holds.append(Hold(
                    f"rank(s) {_ranks(span)} are below --launch-size {own}: "
                    "`sglang serve` launches them, not this controller"
                ))
                continue
            mine = [launch for launch in self._launches
                    if launch.operation_id == op.operation_id and launch.rank_offset == offset]
            if mine:
                if not any(launch.alive for launch in mine):
                    self._cancel_dead_scale(op, span, mine, actions, holds)
                continue
            others = [launch for launch in self._launches
                      if launch.alive and set(launch.ranks) & set(span)]
            if others:
                holds.append(Hold(
                    f"rank(s) {_ranks(span)} still run an older process "
                    f"({', '.join(launch.handle for launch in others)}) that the server does "
                    "not list safe to terminate; not launching over it"
                ))
                continue
            spec = JoinerSpec(offset, step, JoinMode.SCALE, op.operation_id, op.new_ep_size)
            actions.append(LaunchJoiner(
                spec,
                f"operation {op.operation_id} ({op.old_ep_size} -> {op.new_ep_size}) waits for "
                f"rank(s) {_ranks(span)}",
                {"phase": op.phase.value},
            ))

    def _cancel_dead_scale(self, op: OperationStatus, span: range, mine: list[Launch],
                           actions: list[Action], holds: list[Hold]) -> None:
        exits = [launch.exit_code for launch in mine]
        if parse_operation_id(self.config.op_prefix, op.operation_id) is None \
                or op.phase is not Phase.WAITING_FOR_COHORT:
            # Someone else's operation, or past its commit point: the server ends it.
            holds.append(Hold(
                f"the joiner for rank(s) {_ranks(span)} exited (codes {exits}); operation "
                f"{op.operation_id} will fail and release it"
            ))
            return
        if any(isinstance(a, CancelScale) and a.operation_id == op.operation_id
               for a in actions):
            return  # one cancel per operation and pass, whichever joiner of it died
        actions.append(CancelScale(
            op.operation_id,
            f"the joiner for rank(s) {_ranks(span)} exited (codes {exits}) before operation "
            f"{op.operation_id} committed",
            {"phase": op.phase.value, "exit_codes": exits},
        ))

    def _troubled(self, status: StatusResponse) -> dict[int, str]:
        # By rank state, not below the size: removed ranks' holes make the size smaller than
        # the highest rank.
        troubled = {r.rank: "failed" for r in status.ranks if r.state is RankState.FAILED}
        active = {r.rank for r in status.ranks if r.state is RankState.ACTIVE}
        health = self._health
        if health is not None and health.instance_id == status.instance_id:
            for rank in health.ranks:
                if rank.hard_blocked and rank.rank in active and rank.rank not in troubled:
                    troubled[rank.rank] = "slow (hard-blocked by the health check)"
        return dict(sorted(troubled.items()))

    def _stuck(self, status: StatusResponse, troubled: Mapping[int, str]) -> dict[int, str]:
        """The ranks to end because serving has stalled for ``heal_stall_after_s``, with why
        (none already ``troubled``)."""
        stall = status.stalled
        after = self.config.heal_stall_after_s
        if not self.config.heal or stall is None or not 0 < after <= stall.stalled_s:
            return {}
        counted_out = outlasted_count_out(stall.stalled_s, stall.count_out_s)
        # With a rank failed, the survivors' stall is that failure's handling (they wait for
        # Mooncake to count it out): its replacement is the way on, not another end; unless
        # the stall outlasted that count, when the live ranks wait on each other.
        if any(r.state is RankState.FAILED for r in status.ranks) and not counted_out:
            return {}
        active = {r.rank for r in status.ranks if r.state is RankState.ACTIVE}
        own = self.config.first_own_rank
        stuck = ranks_to_end(stall.ranks, active, own, counted_out)
        if any(rank < own for rank in stuck) and stall.ranks_to_relaunch:
            # Launch-time ranks are only named: those the server's report names, which knows
            # the ranks that share rank 0's server (only a restart brings those back).
            named = {r: stuck.get(r, "named by the stall report (ranks_to_relaunch)")
                     for r in stall.ranks_to_relaunch if r < own}
            if 0 in named:  # a restart, which brings the others back too
                named = {0: named[0]}
            stuck = {**{r: why for r, why in stuck.items() if r >= own}, **named}
        return {rank: why for rank, why in sorted(stuck.items()) if rank not in troubled}

    def _failures(self, status: StatusResponse, span: range) -> int:
        """How often the ranks of ``span`` failed since their slot was filled (at least 1)."""
        memory = self._events
        counts = memory.failures if memory and memory.instance_id == status.instance_id else {}
        return max(max(counts.get(r, 0), 1) + self._failed_relaunches.get(r, 0) for r in span)

    def _fault(self, status: StatusResponse, span: range) -> int:
        """The event that reported the current failure of ``span`` (0 when not seen)."""
        memory = self._events
        if memory is None or memory.instance_id != status.instance_id:
            return 0
        return min((memory.open[r] for r in span if r in memory.open), default=0)

    def _count_failed_relaunch(self, launch: Launch) -> None:
        if launch.operation_id in self._counted:
            return
        self._counted.add(launch.operation_id)
        for rank in launch.ranks:
            self._failed_relaunches[rank] = self._failed_relaunches.get(rank, 0) + 1

    def _heal(
        self,
        status: StatusResponse,
        troubled: dict[int, str],
        stuck: set[int],
        now: float,
        actions: list[Action],
        holds: list[Hold],
    ) -> None:
        cfg = self.config
        step = cfg.policy.step
        own = cfg.first_own_rank
        give_up: dict[int, int] = {}
        for offset in sorted({r - r % step for r in troubled}):
            span = range(offset, offset + step)
            why = {r: troubled[r] for r in span if r in troubled}
            if offset < own:
                # Rank 0 hosts the HTTP server: no relaunch of it rejoins anything.
                then = ("restart the deployment (rank 0 hosts the HTTP server)" if 0 in why
                        else "relaunch their node with --ep-join-mode recover")
                holds.append(Hold(
                    f"rank(s) {_ranks(why)} {_what(why)}: launch-time rank(s) (below "
                    f"--launch-size {own}); {then}",
                    {"troubled": _troubled_inputs(why)},
                ))
                continue
            fault = self._fault(status, span)
            failures = self._failures(status, span)
            attempt_id = recover_operation_id(cfg.op_prefix, offset, fault, failures)
            # A relaunch made before the failure's event arrived carries fault 0: it is this
            # attempt too (else the event's arrival would start a second replacement).
            same_attempt = {attempt_id, recover_operation_id(cfg.op_prefix, offset, 0, failures)}
            current = [launch for launch in self._launches if launch.operation_id in same_attempt]
            if current:
                alive = [launch for launch in current if launch.alive]
                started = min((launch.started_at or now) for launch in current)
                if alive and now - started <= cfg.recover_timeout_s:
                    holds.append(Hold(
                        f"waiting for the replacement of rank(s) {_ranks(span)} "
                        f"({alive[0].operation_id}) to rejoin",
                        {"failures": failures, "age_s": round(now - started, 1)},
                    ))
                    continue
                # It died, or never rejoined: the server cannot know, so we count it.
                for launch in current:
                    self._count_failed_relaunch(launch)
                failures = self._failures(status, span)
                attempt_id = recover_operation_id(cfg.op_prefix, offset, fault, failures)
            inputs = {"troubled": _troubled_inputs(why), "failures": failures,
                      "max_relaunches": cfg.max_relaunches}
            if failures > cfg.max_relaunches:
                for rank in span:
                    give_up[rank] = failures
                continue
            spec = JoinerSpec(offset, step, JoinMode.RECOVER, attempt_id, _span(status))
            actions.append(Relaunch(
                spec, failures,
                f"rank(s) {_ranks(why)} {_what(why)}: relaunch in recover mode "
                f"(failure {failures}, up to --max-relaunches {cfg.max_relaunches})",
                inputs, stuck=bool(stuck.intersection(span)),
            ))
        if give_up:
            self._remove(status, troubled, give_up, now, actions, holds)

    def _remove(
        self,
        status: StatusResponse,
        troubled: dict[int, str],
        give_up: dict[int, int],
        now: float,
        actions: list[Action],
        holds: list[Hold],
    ) -> None:
        size = status.effective_ep_size
        target = min(give_up)
        failed = {r for r, why in troubled.items() if why == "failed"}
        tail = set(range(target, size))
        inputs = {"give_up": give_up, "failed": sorted(failed), "size": size,
                  "max_relaunches": self.config.max_relaunches}
        who = f"rank(s) {_ranks(give_up)} failed {max(give_up.values())} times"
        # The server accepts removing exactly the failed tail, or a tail holding failed
        # scale-joined ranks below live ones (a scale-down past them); give_up is this
        # controller's ranks only, so the tail holds no launch-time rank.
        if failed and not failed <= tail:
            holds.append(Hold(
                f"{who}, but only a scale-down of the tail [{target}, {size}) that removes "
                f"every failed rank {_ranks(failed)} is allowed: leaving them failed",
                inputs,
            ))
            return
        newest = status.recent_operations[0] if status.recent_operations else None
        parsed = parse_operation_id(self.config.op_prefix, newest.operation_id) if newest else None
        if (newest is not None and parsed is not None and parsed.purpose is Purpose.REMOVE
                and newest.result is OperationResult.FAILED and newest.finished_at is not None
                and now - newest.finished_at < self.config.heal_retry_s):
            holds.append(Hold(
                f"{who}; removal {newest.operation_id} failed ({newest.error}); retrying in "
                f"{self.config.heal_retry_s - (now - newest.finished_at):.0f}s",
                inputs,
            ))
            return
        if now < self._heal_quiet_until:
            holds.append(Hold(
                f"{who}; the last removal request was refused or unanswered: retrying in "
                f"{self._heal_quiet_until - now:.0f}s", inputs,
            ))
            return
        actions.append(self._scale(
            target, Purpose.REMOVE, now,
            f"{who} (> --max-relaunches {self.config.max_relaunches}): removing ranks "
            f"[{target}, {size}), then regrowing to {size}",
            inputs,
        ))

    def _regrow(
        self, status: StatusResponse, now: float, actions: list[Action], holds: list[Hold]
    ) -> bool:
        """Restore the size a removal took away (also after a failed regrow, once cooled)."""
        if not status.recent_operations:
            return False
        newest = status.recent_operations[0]
        parsed = parse_operation_id(self.config.op_prefix, newest.operation_id)
        if parsed is None:
            return False
        if parsed.purpose is Purpose.REMOVE and newest.result is OperationResult.SUCCEEDED:
            target = newest.old_ep_size
        elif parsed.purpose is Purpose.REGROW and newest.result is OperationResult.FAILED:
            wait = (newest.finished_at or now) + self.config.policy.cooldown_s - now
            if wait > 0:
                holds.append(Hold(
                    f"regrow {newest.operation_id} failed ({newest.error}); retrying in "
                    f"{wait:.0f}s"
                ))
                return True
            target = newest.new_ep_size
        else:
            return False
        target = min(target, self.config.policy.max_size, status.max_ep_size)
        size = status.effective_ep_size
        if target <= size:
            return False
        if now < self._heal_quiet_until:
            holds.append(Hold(
                f"regrow to {target}: the last request was refused or unanswered; retrying in "
                f"{self._heal_quiet_until - now:.0f}s"
            ))
            return True
        actions.append(self._scale(
            target, Purpose.REGROW, now,
            f"restore capacity after {newest.operation_id}: {size} -> {target}",
            {"after": newest.operation_id, "size": size},
        ))
        return True


def _operations(status: StatusResponse) -> Sequence[OperationStatus]:
    current = [status.current_operation] if status.current_operation else []
    return [*current, *status.recent_operations]


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def _what(why: Mapping[int, str]) -> str:
    return " / ".join(sorted(set(why.values())))


_MANAGED = (RankState.ACTIVE, RankState.FAILED, RankState.LEAVING)


def _span(status: StatusResponse) -> int:
    """The EP size the ranks are laid out in: the highest managed rank + 1 (the effective
    size, unless removed ranks leave holes below it)."""
    return max((r.rank + 1 for r in status.ranks if r.state in _MANAGED),
               default=status.effective_ep_size)


def _holes(status: StatusResponse) -> list[int]:
    """Ranks removed where they were (not managed, with a managed rank above them)."""
    managed = {r.rank for r in status.ranks if r.state in _MANAGED}
    top = _span(status) - 1
    return [r.rank for r in status.ranks if r.rank < top and r.rank not in managed]


def _troubled_inputs(troubled: Mapping[int, str]) -> dict[str, str]:
    return {str(rank): why for rank, why in troubled.items()}

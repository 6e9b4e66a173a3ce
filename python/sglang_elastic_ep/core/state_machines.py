"""One explicit state machine per role in an elastic EP operation.

Driving contract (the adapter, once per forward pass on every rank taking part):

    action = machine.step(Observation(now=..., pass_id=..., ...))
    while action.reported:              # a blocking step: run it now, then report
        try:
            run(action)
            obs = Observation(now=..., pass_id=..., completed=action.kind)
        except Exception as exc:
            obs = Observation(now=..., pass_id=..., error=str(exc))
        action = machine.step(obs)
    run(action)                         # KEEP_SERVING / STOP_ADMISSION / COMMIT / ...

``step`` never blocks. Until the ranks agree (``RankAgreement``) it only looks at the
observation and returns KEEP_SERVING, so serving continues; once they agree, it hands out
the blocking collective steps one by one, all inside the same forward pass. Only that
sequence stops serving. A machine's own timeout applies only before this rank published its
intent; afterwards only the agreement (which all ranks decide alike) may abort.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from sglang_elastic_ep.core.agreement import Decision, RankAgreement
from sglang_elastic_ep.core.phases import Phase, PhaseStamp, PhaseTracker, Role


class ActionKind(str, enum.Enum):
    KEEP_SERVING = "keep_serving"
    # Blocking steps: run them now and report completion (Observation.completed).
    WARM_UP = "warm_up"  # joiner: load weights, capture graphs
    REGISTER_COHORT = "register_cohort"  # joiner: publish its target size for the primaries
    JOIN_GROUPS = "join_groups"  # joiner: join_group on every process group
    ADMIT_RANKS = "admit_ranks"  # activate/recover the joining ranks in every group
    CONFIGURE_DATA_PLANE = "configure_data_plane"  # on_scale, connect dispatch buffers
    SYNC_NEW_WORLD = "sync_new_world"  # expert metadata broadcast, DP resize, graphs
    MOVE_EXPERTS = "move_experts"  # weight copies so staying ranks hold every expert
    SWITCH_PLACEMENT = "switch_placement"  # use the new expert location metadata
    RELEASE_RANKS = "release_ranks"  # deactivate leaving ranks, disconnect buffers
    ISOLATE_RANKS = "isolate_ranks"  # mask failed ranks, re-place their experts
    RESTORE_EXPERTS = "restore_experts"  # metadata to recovered ranks, rebalance
    # Local and immediate: do them, nothing to report.
    STOP_ADMISSION = "stop_admission"  # leaving rank: take no new requests
    ABORT_REQUESTS = "abort_requests"  # leaving rank: drain timed out, abort the rest
    COMMIT = "commit"  # record the new membership; re-enable EPLB
    SHUT_DOWN = "shut_down"  # leaving rank: released, report safe to terminate, exit
    ROLL_BACK = "roll_back"  # undo what ``failed_in`` implies; re-enable EPLB


REPORTED_ACTIONS: frozenset[ActionKind] = frozenset(
    {
        ActionKind.WARM_UP,
        ActionKind.REGISTER_COHORT,
        ActionKind.JOIN_GROUPS,
        ActionKind.ADMIT_RANKS,
        ActionKind.CONFIGURE_DATA_PLANE,
        ActionKind.SYNC_NEW_WORLD,
        ActionKind.MOVE_EXPERTS,
        ActionKind.SWITCH_PLACEMENT,
        ActionKind.RELEASE_RANKS,
        ActionKind.ISOLATE_RANKS,
        ActionKind.RESTORE_EXPERTS,
    }
)


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    ranks: tuple[int, ...] = ()  # the ranks the action is about (joining, leaving, failed)
    new_size: int | None = None
    reason: str | None = None
    failed_in: Phase | None = None  # ROLL_BACK: the phase that failed
    rebalance_experts: bool = False  # COMMIT: let EPLB redistribute (scale-up, recovery)

    @property
    def reported(self) -> bool:
        return self.kind in REPORTED_ACTIONS


KEEP_SERVING = Action(ActionKind.KEEP_SERVING)


@dataclass(frozen=True)
class Observation:
    """What the adapter saw this pass. Fields a role does not use are ignored."""

    now: float  # monotonic seconds
    pass_id: int = 0  # lockstep forward-pass counter, equal on all ranks (see agreement)
    completed: ActionKind | None = None  # the reported action that just finished
    error: str | None = None  # ...or how it failed
    cohort_target: int | None = None  # scale-up: target size the joining cohort announced
    cohort_error: str | None = None  # scale-up: the cohort does not fit (topology, graphs)
    peers_connected: bool = False  # joiners/replacements reachable (get_peer_state)
    drained: bool = False  # leaving rank: no queued or running requests


class StepProtocolError(RuntimeError):
    """The adapter reported something the machine did not ask for."""


class RoleStateMachine:
    """Shared mechanics: phases with timestamps, awaited actions, timeouts, agreement."""

    # completed action -> (next phase, next action or None for the final action)
    _SEQUENCE: dict[ActionKind, tuple[Phase, ActionKind | None]] = {}

    def __init__(
        self,
        role: Role,
        *,
        operation_id: str,
        now: float,
        timeout_s: float,
        agreement: RankAgreement | None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.role = role
        self.operation_id = operation_id
        self.started_at = now
        self.timeout_s = timeout_s
        self.agreement = agreement
        self.error: str | None = None
        self.failed_in: Phase | None = None
        self._tracker = PhaseTracker(role, now)
        self._awaiting: ActionKind | None = None
        self._awaiting_since = now
        self._cancel_reason: str | None = None
        self._new_size: int | None = None  # carried on every action of this operation

    # --- public -------------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def phase_stamps(self) -> tuple[PhaseStamp, ...]:
        return self._tracker.stamps

    @property
    def done(self) -> bool:
        return self._tracker.is_terminal

    @property
    def awaiting(self) -> ActionKind | None:
        return self._awaiting

    def cancel(self, reason: str) -> None:
        """Ask to give up (peer died, orchestrator cancelled); applied at a safe point."""
        self._cancel_reason = reason

    def step(self, obs: Observation) -> Action:
        if self.done:
            if obs.completed is not None:
                raise StepProtocolError(
                    f"{self.role.value} is {self.phase.value}; nothing was awaited but "
                    f"{obs.completed.value} was reported"
                )
            return KEEP_SERVING
        if self._awaiting is not None:
            return self._step_awaiting(obs)
        if obs.completed is not None:
            raise StepProtocolError(
                f"{self.role.value} in {self.phase.value} awaited nothing but "
                f"{obs.completed.value} was reported"
            )
        if obs.error is not None:
            # An error outside an awaited step means "give the operation up".
            self.cancel(obs.error)
        return self._on_poll(obs)

    # --- role hooks ---------------------------------------------------------------------

    def _on_poll(self, obs: Observation) -> Action:
        raise NotImplementedError

    def _final_action(self, obs: Observation) -> Action:
        raise NotImplementedError

    def _subject_ranks(self) -> tuple[int, ...]:
        return ()

    # --- mechanics ----------------------------------------------------------------------

    def _step_awaiting(self, obs: Observation) -> Action:
        assert self._awaiting is not None
        if obs.error is not None:
            # Past the agreement every member runs the same steps; no abort key needed.
            return self._fail(f"{self._awaiting.value} failed: {obs.error}", obs.now)
        if obs.completed is None:
            # The adapter runs the step elsewhere (e.g. a joiner thread) and polls us;
            # giving up is then the adapter's to carry out (ROLL_BACK).
            if self._cancel_reason is not None:
                return self._fail(self._cancel_reason, obs.now)
            if obs.now - self._awaiting_since > self.timeout_s:
                return self._fail(
                    f"{self._awaiting.value} did not finish within {self.timeout_s:g}s",
                    obs.now,
                )
            return KEEP_SERVING
        if obs.completed is not self._awaiting:
            raise StepProtocolError(
                f"{self.role.value} awaited {self._awaiting.value} but "
                f"{obs.completed.value} was reported"
            )
        done = self._awaiting
        self._awaiting = None
        next_phase, next_kind = self._SEQUENCE[done]
        self._tracker.advance(next_phase, obs.now)
        if next_kind is None:
            return self._final_action(obs)
        return self._await(
            Action(next_kind, ranks=self._subject_ranks(), new_size=self._new_size), obs.now
        )

    def _await(self, action: Action, now: float) -> Action:
        self._awaiting = action.kind
        self._awaiting_since = now
        return action

    def _advance(self, phase: Phase, now: float) -> None:
        self._tracker.advance(phase, now)

    def _fail(self, reason: str, now: float) -> Action:
        self.failed_in = self.phase
        self.error = reason
        self._awaiting = None
        self._tracker.advance(Phase.FAILED, now)
        return Action(
            ActionKind.ROLL_BACK,
            ranks=self._subject_ranks(),
            new_size=self._new_size,
            reason=reason,
            failed_in=self.failed_in,
        )

    def _abort(self, obs: Observation, reason: str) -> Action:
        """Fail before the collective; tell the other members through the agreement."""
        if self.agreement is not None:
            self.agreement.abort(reason, pass_id=obs.pass_id)
        return self._fail(reason, obs.now)

    def _pre_agreement_checks(self, obs: Observation) -> Action | None:
        """Abort key, cancel and timeout, for phases before this rank published."""
        if self.agreement is not None:
            reason = self.agreement.check_abort()
            if reason is not None:
                return self._fail(reason, obs.now)
        if self._cancel_reason is not None:
            return self._abort(obs, self._cancel_reason)
        if obs.now - self.started_at > self.timeout_s:
            return self._abort(
                obs, f"timed out after {self.timeout_s:g}s in phase {self.phase.value}"
            )
        return None

    def _enter_when_agreed(self, obs: Observation, phase: Phase, action: Action) -> Action:
        """Keep serving until every rank agrees, then enter ``phase`` and hand out ``action``;
        an aborted agreement fails the operation."""
        decision = self._poll_agreement(obs)
        if decision is Decision.WAIT:
            return KEEP_SERVING
        if decision is Decision.ABORT:
            return self._fail(self.agreement.abort_reason or "agreement aborted", obs.now)
        self._advance(phase, obs.now)
        return self._await(action, obs.now)

    def _poll_agreement(self, obs: Observation) -> Decision:
        """Poll the round; on WAIT, apply a pending cancel where it is safe."""
        assert self.agreement is not None
        decision = self.agreement.poll(pass_id=obs.pass_id, now=obs.now)
        if decision is Decision.WAIT and self._cancel_reason is not None:
            self.agreement.abort(self._cancel_reason, pass_id=obs.pass_id)
            return Decision.ABORT
        return decision


class ExistingRankScaleUp(RoleStateMachine):
    """A rank already serving while ranks [old_size, new_size) join."""

    _SEQUENCE = {
        ActionKind.ADMIT_RANKS: (Phase.CONFIGURING_DATA_PLANE, ActionKind.CONFIGURE_DATA_PLANE),
        ActionKind.CONFIGURE_DATA_PLANE: (Phase.SYNCING_NEW_WORLD, ActionKind.SYNC_NEW_WORLD),
        ActionKind.SYNC_NEW_WORLD: (Phase.SERVING_EXPANDED, None),
    }

    def __init__(
        self,
        *,
        operation_id: str,
        old_size: int,
        new_size: int,
        now: float,
        agreement: RankAgreement,
        timeout_s: float = 600.0,
    ) -> None:
        if new_size <= old_size:
            raise ValueError(f"scale-up needs new_size > old_size (got {old_size}->{new_size})")
        super().__init__(
            Role.EXISTING_SCALE_UP,
            operation_id=operation_id,
            now=now,
            timeout_s=timeout_s,
            agreement=agreement,
        )
        self.old_size = old_size
        self.new_size = new_size
        self._new_size = new_size
        self.joining_ranks = tuple(range(old_size, new_size))

    def _subject_ranks(self) -> tuple[int, ...]:
        return self.joining_ranks

    def _on_poll(self, obs: Observation) -> Action:
        assert self.agreement is not None
        if not self.agreement.published:
            early = self._pre_agreement_checks(obs)
            if early is not None:
                return early
            if self.phase is Phase.WAITING_FOR_COHORT:
                if obs.cohort_error is not None:
                    return self._abort(obs, f"joining cohort does not fit: {obs.cohort_error}")
                if obs.cohort_target is None:
                    return KEEP_SERVING
                if obs.cohort_target != self.new_size:
                    return self._abort(
                        obs,
                        f"joining cohort targets {obs.cohort_target} ranks but this operation "
                        f"targets {self.new_size}; relaunch the joiners for {self.new_size} "
                        f"or request new_ep_size={obs.cohort_target}",
                    )
                self._advance(Phase.PENDING, obs.now)
            if not obs.peers_connected:
                return KEEP_SERVING
        return self._enter_when_agreed(
            obs,
            Phase.JOINING,
            Action(ActionKind.ADMIT_RANKS, ranks=self.joining_ranks, new_size=self.new_size),
        )

    def _final_action(self, obs: Observation) -> Action:
        return Action(
            ActionKind.COMMIT,
            ranks=self.joining_ranks,
            new_size=self.new_size,
            rebalance_experts=True,
        )


class JoinMode(str, enum.Enum):
    SCALE = "scale"  # a new slot beyond the current size
    RECOVER = "recover"  # the replacement of a failed rank, same slot


class JoinerRank(RoleStateMachine):
    """A new or replacement rank from launch until it serves. Its steps are blocking by
    nature (it has no traffic yet); the adapter may run JOIN_GROUPS in a thread and poll
    ``step`` with empty observations so the timeout applies."""

    _SEQUENCE = {
        ActionKind.REGISTER_COHORT: (Phase.JOINING, ActionKind.JOIN_GROUPS),
        ActionKind.JOIN_GROUPS: (Phase.SYNCING_NEW_WORLD, ActionKind.SYNC_NEW_WORLD),
        ActionKind.SYNC_NEW_WORLD: (
            Phase.CONFIGURING_DATA_PLANE,
            ActionKind.CONFIGURE_DATA_PLANE,
        ),
    }

    def __init__(
        self,
        *,
        rank: int,
        mode: JoinMode,
        target_size: int,
        now: float,
        operation_id: str = "join",
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(
            Role.JOINER, operation_id=operation_id, now=now, timeout_s=timeout_s, agreement=None
        )
        if not 0 <= rank < target_size:
            raise ValueError(f"rank {rank} is outside the target size {target_size}")
        self.rank = rank
        self.mode = mode
        self.target_size = target_size
        self._new_size = target_size
        self._SEQUENCE = dict(self._SEQUENCE)
        if mode is JoinMode.SCALE:
            self._SEQUENCE[ActionKind.WARM_UP] = (Phase.PENDING, ActionKind.REGISTER_COHORT)
        else:
            self._SEQUENCE[ActionKind.WARM_UP] = (Phase.JOINING, ActionKind.JOIN_GROUPS)
        final = Phase.SERVING_EXPANDED if mode is JoinMode.SCALE else Phase.SERVING_RECOVERED
        self._SEQUENCE[ActionKind.CONFIGURE_DATA_PLANE] = (final, None)

    def _subject_ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def _on_poll(self, obs: Observation) -> Action:
        # Only reached once, at WARMING_UP; afterwards an action is always awaited.
        if self._cancel_reason is not None:
            return self._fail(self._cancel_reason, obs.now)
        return self._await(
            Action(ActionKind.WARM_UP, ranks=(self.rank,), new_size=self.target_size), obs.now
        )

    def _final_action(self, obs: Observation) -> Action:
        return Action(
            ActionKind.COMMIT,
            ranks=(self.rank,),
            new_size=self.target_size,
            rebalance_experts=self.mode is JoinMode.SCALE,
        )


class ScaleDown(RoleStateMachine):
    """Scale from old_size to new_size; ranks [new_size, old_size) leave.

    Every live rank runs one: staying ranks (rank < new_size) and leaving ranks. Leaving
    ranks stop taking requests and drain first (up to ``drain_timeout_s``, then abort what
    is left); staying ranks publish their intent at once. A leaving rank that already died
    runs no machine and is not a member of the agreement.
    """

    _SEQUENCE = {
        ActionKind.MOVE_EXPERTS: (Phase.SWITCHING_PLACEMENT, ActionKind.SWITCH_PLACEMENT),
        ActionKind.SWITCH_PLACEMENT: (Phase.RELEASING, ActionKind.RELEASE_RANKS),
    }

    def __init__(
        self,
        *,
        operation_id: str,
        rank: int,
        old_size: int,
        new_size: int,
        now: float,
        agreement: RankAgreement,
        drain_timeout_s: float = 120.0,
        timeout_s: float = 600.0,
    ) -> None:
        if not 1 <= new_size < old_size:
            raise ValueError(f"scale-down needs 1 <= new_size < old_size ({old_size}->{new_size})")
        if not 0 <= rank < old_size:
            raise ValueError(f"rank {rank} is outside the current size {old_size}")
        if agreement.timeout_s <= drain_timeout_s:
            raise ValueError(
                f"agreement timeout ({agreement.timeout_s:g}s) must exceed the drain timeout "
                f"({drain_timeout_s:g}s), or staying ranks give up while leaving ranks drain"
            )
        leaving = rank >= new_size
        super().__init__(
            Role.SCALE_DOWN_LEAVING if leaving else Role.SCALE_DOWN_STAYING,
            operation_id=operation_id,
            now=now,
            timeout_s=timeout_s,
            agreement=agreement,
        )
        self.rank = rank
        self.old_size = old_size
        self.new_size = new_size
        self._new_size = new_size
        self.leaving = leaving
        self.leaving_ranks = tuple(range(new_size, old_size))
        self.drain_timeout_s = drain_timeout_s
        self._admission_stopped = False
        self._requests_aborted = False
        final = Phase.RELEASED if leaving else Phase.SERVING_CONTRACTED
        self._SEQUENCE = {**self._SEQUENCE, ActionKind.RELEASE_RANKS: (final, None)}

    def _subject_ranks(self) -> tuple[int, ...]:
        return self.leaving_ranks

    def _on_poll(self, obs: Observation) -> Action:
        assert self.agreement is not None
        if not self.agreement.published:
            early = self._pre_agreement_checks(obs)
            if early is not None:
                return early
            if self.leaving:
                if not self._admission_stopped:
                    self._admission_stopped = True
                    return Action(ActionKind.STOP_ADMISSION, ranks=(self.rank,))
                if not obs.drained:
                    if (
                        not self._requests_aborted
                        and obs.now - self.started_at >= self.drain_timeout_s
                    ):
                        self._requests_aborted = True
                        return Action(
                            ActionKind.ABORT_REQUESTS,
                            ranks=(self.rank,),
                            reason=f"drain timed out after {self.drain_timeout_s:g}s",
                        )
                    return KEEP_SERVING
        return self._enter_when_agreed(
            obs,
            Phase.MOVING_EXPERTS,
            Action(ActionKind.MOVE_EXPERTS, ranks=self.leaving_ranks, new_size=self.new_size),
        )

    def _final_action(self, obs: Observation) -> Action:
        if self.leaving:
            return Action(ActionKind.SHUT_DOWN, ranks=(self.rank,), new_size=self.new_size)
        return Action(ActionKind.COMMIT, ranks=self.leaving_ranks, new_size=self.new_size)


class Recovery(RoleStateMachine):
    """A surviving rank while ``failed_ranks`` are down: isolate them, serve degraded, and
    readmit replacements once they connect. A rejoin attempt whose agreement aborts returns
    to serving degraded and retries with the next epoch. Serving degraded has no timeout:
    the orchestrator decides between a replacement and a scale-down (then the adapter drops
    this machine). ``cancel`` while degraded fails the recovery."""

    _SEQUENCE = {
        ActionKind.ADMIT_RANKS: (Phase.RESTORING_EXPERTS, ActionKind.RESTORE_EXPERTS),
        ActionKind.RESTORE_EXPERTS: (Phase.SERVING_RECOVERED, None),
    }

    def __init__(
        self,
        *,
        operation_id: str,
        failed_ranks: tuple[int, ...],
        now: float,
        agreement_for_epoch: Callable[[int], RankAgreement],
        timeout_s: float = 600.0,
    ) -> None:
        if not failed_ranks:
            raise ValueError("failed_ranks is empty")
        super().__init__(
            Role.RECOVERY,
            operation_id=operation_id,
            now=now,
            timeout_s=timeout_s,
            agreement=None,  # one per rejoin attempt
        )
        self.failed_ranks = tuple(sorted(set(failed_ranks)))
        self._agreement_for_epoch = agreement_for_epoch
        self.epoch = 0
        self.rejoin_attempts = 0
        self.last_attempt_error: str | None = None
        self._to_isolate = self.failed_ranks
        self._isolate_later: tuple[int, ...] = ()

    def _subject_ranks(self) -> tuple[int, ...]:
        return self.failed_ranks

    def add_failed_ranks(self, ranks: tuple[int, ...], now: float) -> None:
        """More ranks failed while degraded: isolate them too. A rejoin attempt in flight
        is abandoned at its next safe point first."""
        new = tuple(sorted(set(ranks) - set(self.failed_ranks) - set(self._isolate_later)))
        if not new:
            return
        if self.phase is not Phase.SERVING_DEGRADED:
            raise StepProtocolError(
                f"cannot add failed ranks in phase {self.phase.value}; "
                "finish or fail this recovery first"
            )
        if self.agreement is not None:
            self._isolate_later = tuple(sorted(set(self._isolate_later) | set(new)))
            self.cancel(f"rank(s) {list(new)} failed during the rejoin attempt")
            return
        self.failed_ranks = tuple(sorted(set(self.failed_ranks) | set(new)))
        self._to_isolate = new
        self._advance(Phase.ISOLATING_FAULT, now)

    def _on_poll(self, obs: Observation) -> Action:
        if self.phase is Phase.ISOLATING_FAULT:
            return self._await(Action(ActionKind.ISOLATE_RANKS, ranks=self._to_isolate), obs.now)
        # SERVING_DEGRADED: wait for replacements, then agree to readmit them.
        if self.agreement is None:
            if self._cancel_reason is not None:
                return self._fail(self._cancel_reason, obs.now)
            if not obs.peers_connected:
                return KEEP_SERVING
            self.agreement = self._agreement_for_epoch(self.epoch)
            self.rejoin_attempts += 1
        decision = self._poll_agreement(obs)
        if decision is Decision.WAIT:
            return KEEP_SERVING
        if decision is Decision.ABORT:
            self.last_attempt_error = self.agreement.abort_reason
            self.agreement = None
            self.epoch += 1
            if self._isolate_later:
                # The cancel only meant "leave the round to isolate new failures".
                self._cancel_reason = None
                later, self._isolate_later = self._isolate_later, ()
                self.add_failed_ranks(later, obs.now)
            elif self._cancel_reason is not None:
                return self._fail(self._cancel_reason, obs.now)
            return KEEP_SERVING
        self._advance(Phase.REJOINING, obs.now)
        return self._await(Action(ActionKind.ADMIT_RANKS, ranks=self.failed_ranks), obs.now)

    def _step_awaiting(self, obs: Observation) -> Action:
        # Isolation ends in serving degraded, not in a final action.
        if self._awaiting is ActionKind.ISOLATE_RANKS and obs.completed is ActionKind.ISOLATE_RANKS:
            self._awaiting = None
            self._advance(Phase.SERVING_DEGRADED, obs.now)
            return KEEP_SERVING
        return super()._step_awaiting(obs)

    def _final_action(self, obs: Observation) -> Action:
        self.agreement = None
        return Action(ActionKind.COMMIT, ranks=self.failed_ranks, rebalance_experts=True)

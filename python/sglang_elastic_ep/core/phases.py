"""Phases of elastic EP operations and the transitions each role may take between them."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(str, enum.Enum):
    # Upstream ElasticEPState.scale_phase names, kept so status output stays familiar.
    IDLE = "idle"
    WAITING_FOR_COHORT = "waiting_for_cohort"
    PENDING = "pending"
    JOINING = "joining"
    CONFIGURING_DATA_PLANE = "configuring_data_plane"
    SYNCING_NEW_WORLD = "syncing_new_world"
    SERVING_EXPANDED = "serving_expanded"
    FAILED = "failed"
    # Scale-down.
    DRAINING = "draining"
    MOVING_EXPERTS = "moving_experts"
    SWITCHING_PLACEMENT = "switching_placement"
    RELEASING = "releasing"
    SERVING_CONTRACTED = "serving_contracted"
    RELEASED = "released"
    # Recovery of a crashed or hard-blocked rank.
    ISOLATING_FAULT = "isolating_fault"
    SERVING_DEGRADED = "serving_degraded"
    REJOINING = "rejoining"
    RESTORING_EXPERTS = "restoring_experts"
    SERVING_RECOVERED = "serving_recovered"
    # Recovery of a failed tail of scale-joined ranks: the survivors let go of its slots and
    # serve on fewer ranks until a replacement joins (sglang/tail_recovery.py).
    AWAITING_REPLACEMENT = "awaiting_replacement"


class Role(str, enum.Enum):
    """A process's part in an operation driven by a machine of ``core`` (one per role)."""

    SCALE_UP_EXISTING = "scale_up_existing"  # a rank that serves while joiners come in
    SCALE_UP_JOINING = "scale_up_joining"  # a scale joiner, from its start-up to serving
    SCALE_DOWN_STAYING = "scale_down_staying"
    SCALE_DOWN_LEAVING = "scale_down_leaving"
    RECOVERY_SURVIVOR = "recovery_survivor"  # of a failed tail of scale-joined ranks
    LAUNCH_RECOVERY_SURVIVOR = "launch_recovery_survivor"  # of failed launch-time ranks
    LAUNCH_RECOVERY_REPLACEMENT = "launch_recovery_replacement"  # of a failed launch-time rank


P = Phase
_F = P.FAILED

INITIAL_PHASE: dict[Role, Phase] = {
    Role.SCALE_UP_EXISTING: P.WAITING_FOR_COHORT,
    Role.SCALE_UP_JOINING: P.PENDING,
    Role.SCALE_DOWN_STAYING: P.DRAINING,
    Role.SCALE_DOWN_LEAVING: P.DRAINING,
    Role.RECOVERY_SURVIVOR: P.SERVING_DEGRADED,
    Role.LAUNCH_RECOVERY_SURVIVOR: P.SERVING_DEGRADED,
    Role.LAUNCH_RECOVERY_REPLACEMENT: P.REJOINING,
}

# The admission and the release each start on one agreed pass; only the wait before it can be
# called off.
TRANSITIONS: dict[Role, dict[Phase, frozenset[Phase]]] = {
    Role.SCALE_UP_EXISTING: {  # core/scale_up_machine.py
        P.WAITING_FOR_COHORT: frozenset({P.JOINING, _F}),
        P.JOINING: frozenset({P.SERVING_EXPANDED, _F}),
    },
    Role.SCALE_UP_JOINING: {  # core/scale_up_machine.py: JoinerMachine
        P.PENDING: frozenset({P.JOINING, _F}),
        P.JOINING: frozenset({P.SYNCING_NEW_WORLD, _F}),
        P.SYNCING_NEW_WORLD: frozenset({P.SERVING_EXPANDED, _F}),
    },
    Role.SCALE_DOWN_STAYING: {
        P.DRAINING: frozenset({P.MOVING_EXPERTS, _F}),
        P.MOVING_EXPERTS: frozenset({P.SWITCHING_PLACEMENT}),
        P.SWITCHING_PLACEMENT: frozenset({P.RELEASING}),
        P.RELEASING: frozenset({P.SERVING_CONTRACTED}),
    },
    Role.SCALE_DOWN_LEAVING: {
        P.DRAINING: frozenset({P.MOVING_EXPERTS, _F}),
        P.MOVING_EXPERTS: frozenset({P.SWITCHING_PLACEMENT}),
        P.SWITCHING_PLACEMENT: frozenset({P.RELEASING}),
        P.RELEASING: frozenset({P.RELEASED}),
    },
    # A survivor of a failed scale-joined tail (core/tail_recovery_machine.py).
    Role.RECOVERY_SURVIVOR: {
        P.SERVING_DEGRADED: frozenset({P.AWAITING_REPLACEMENT}),
        P.AWAITING_REPLACEMENT: frozenset({P.REJOINING, P.SERVING_CONTRACTED}),
        P.REJOINING: frozenset({P.SERVING_RECOVERED, P.AWAITING_REPLACEMENT}),
    },
    # A survivor of failed launch-time ranks after a scale (core/launch_recovery_machine.py).
    Role.LAUNCH_RECOVERY_SURVIVOR: {
        P.SERVING_DEGRADED: frozenset({P.REJOINING}),
        P.REJOINING: frozenset({P.SERVING_RECOVERED, P.SERVING_DEGRADED}),
    },
    # Its replacement, started with --ep-join-mode recover (core/launch_recovery_machine.py).
    Role.LAUNCH_RECOVERY_REPLACEMENT: {
        P.REJOINING: frozenset({P.RESTORING_EXPERTS, _F}),
        P.RESTORING_EXPERTS: frozenset({P.SERVING_RECOVERED, _F}),
    },
}

TERMINAL_PHASES: frozenset[Phase] = frozenset(
    {P.SERVING_EXPANDED, P.SERVING_CONTRACTED, P.RELEASED, P.SERVING_RECOVERED, P.FAILED}
)


class IllegalTransition(RuntimeError):
    """A state machine was asked to move between phases its role does not connect."""


@dataclass(frozen=True)
class PhaseStamp:
    phase: Phase
    at: float  # the clock the owner uses: monotonic in state machines, Unix time in the registry


class PhaseTracker:
    """Current phase of one role plus the time each phase was entered; validates transitions."""

    def __init__(self, role: Role, now: float) -> None:
        self.role = role
        self._stamps: list[PhaseStamp] = [PhaseStamp(INITIAL_PHASE[role], now)]

    @property
    def phase(self) -> Phase:
        return self._stamps[-1].phase

    @property
    def entered_at(self) -> float:
        return self._stamps[-1].at

    @property
    def stamps(self) -> tuple[PhaseStamp, ...]:
        return tuple(self._stamps)

    @property
    def is_terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    def advance(self, to: Phase, now: float) -> None:
        allowed = TRANSITIONS[self.role].get(self.phase, frozenset())
        if to not in allowed:
            names = ", ".join(sorted(p.value for p in allowed)) or "none (terminal)"
            raise IllegalTransition(
                f"{self.role.value}: cannot go from {self.phase.value} to {to.value}; "
                f"allowed next phases: {names}"
            )
        self._stamps.append(PhaseStamp(to, now))


class PhaseMachine:
    """A machine that keeps its phases in a ``PhaseTracker`` (``_tracker``): its current phase
    and the time it entered each one."""

    _tracker: PhaseTracker

    @property
    def phase(self) -> Phase:
        return self._tracker.phase

    @property
    def phase_stamps(self) -> tuple[PhaseStamp, ...]:
        return self._tracker.stamps

    @property
    def done(self) -> bool:
        """The machine reached a terminal phase."""
        return self._tracker.is_terminal


class StartUpMachine(PhaseMachine):
    """A machine for a process whose part runs in its start-up (a joiner, a replacement):
    upstream's steps block, so the driver tells it when each returned, or what one raised."""

    error: str | None

    def fail(self, error: str, now: float) -> None:
        """A step raised ``error``; a machine already done keeps its end."""
        if self.done:
            return
        self.error = error
        self._tracker.advance(Phase.FAILED, now)

    def seconds_in_phases(self) -> dict[Phase, float]:
        """How long it spent in each phase it has left (its start-up's breakdown)."""
        stamps = self.phase_stamps
        return {a.phase: b.at - a.at for a, b in zip(stamps, stamps[1:], strict=False)}

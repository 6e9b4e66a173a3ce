"""Taking back failed launch-time ranks in place, before or after a scale: a survivor's side
and the replacement's.

The survivor's side (:class:`LaunchRecoveryMachine`).
Pure: the adapter (``sglang/launch_recovery.py``) builds one when the survivor first sees
launch-time ranks failed, shows it Mooncake's peer state of those ranks on each pass, and
tells it when the agreed pass began the rejoin and how it ended. Phases
(``core.phases.TRANSITIONS``)::

    SERVING_DEGRADED --agreed pass (every replacement in WORLD)--> REJOINING
    REJOINING --taken back--> SERVING_RECOVERED
    REJOINING --not taken back (the ranks left WORLD again, or a survivor never reached the
        change)--> SERVING_DEGRADED

A replacement counts only once its rank's peer state read False (the dead process gone) and
then True (its replacement registered): right after a kill Mooncake can still report the dead
process for a moment (seen: True on the pass after the failure, False a moment later), and
entering on that would send the survivors into a recovery some of them abandon.

The replacement's side (:class:`ReplacementMachine`), a process started with
``--ep-join-mode recover``. Its part runs in its start-up, whose steps block; the adapter tells
the machine when each returned::

    REJOINING --taken back, the expert map received--> RESTORING_EXPERTS
       --its slots hold what the map says (reloaded if moved since launch)--> SERVING_RECOVERED
    (either --a step raised--> FAILED)

Nothing here waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sglang_elastic_ep.core.phases import (
    Phase,
    PhaseMachine,
    PhaseTracker,
    Role,
    StartUpMachine,
)


@dataclass
class LaunchRecoveryMachine(PhaseMachine):
    """Launch-time ``ranks`` failed; this survivor serves on without them until they rejoin."""

    ranks: tuple[int, ...]
    started_at: float  # monotonic seconds: when this survivor saw them failed
    seen_gone: set[int] = field(default_factory=set)  # ranks whose peer state read False
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ranks or min(self.ranks) < 0 or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"failed launch-time ranks must be distinct EP ranks, got "
                             f"{list(self.ranks)}")
        self.seen_gone &= set(self.ranks)
        self._tracker = PhaseTracker(Role.LAUNCH_RECOVERY_SURVIVOR, self.started_at)

    def following(self, ranks: tuple[int, ...], now: float) -> LaunchRecoveryMachine:
        """The machine for the failed set ``ranks`` seen on a later pass: this one while the
        set is the same and the rejoin has not ended, else a new one that keeps what was seen
        of the ranks both share (a replacement already registered stays counted)."""
        if ranks == self.ranks and not self.done:
            return self
        return LaunchRecoveryMachine(ranks, now, set(self.seen_gone))

    def replacements_ready(self, peer_state: Sequence[bool]) -> bool:
        """One pass's peer state of ``ranks`` (in order): whether every replacement is in
        WORLD, so this survivor is ready for the rejoin."""
        if len(peer_state) != len(self.ranks):
            raise ValueError(f"peer state of {len(peer_state)} ranks for {list(self.ranks)}")
        self.seen_gone.update(r for r, up in zip(self.ranks, peer_state, strict=True) if not up)
        return self.phase is Phase.SERVING_DEGRADED and all(
            up and r in self.seen_gone for r, up in zip(self.ranks, peer_state, strict=True))

    def entered(self, now: float) -> None:
        """The agreed pass: upstream's recovery steps begin."""
        self._tracker.advance(Phase.REJOINING, now)

    def rejoined(self, now: float) -> None:
        """Taken back. A later failure of the same ranks starts over: their replacements count
        only once seen gone again."""
        self.seen_gone.clear()
        self._tracker.advance(Phase.SERVING_RECOVERED, now)

    def rejoin_failed(self, now: float) -> None:
        """Not taken back on the agreed pass: the ranks left WORLD again (their next
        replacements are waited for), or a survivor never reached the change and none was made
        (the replacements stay counted and the next agreed pass begins the rejoin again)."""
        self._tracker.advance(Phase.SERVING_DEGRADED, now)


@dataclass
class ReplacementMachine(StartUpMachine):
    """The replacement of launch-time EP rank ``rank``, from its rejoin (``started_at``) on."""

    rank: int
    started_at: float  # monotonic seconds
    error: str | None = None
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"a replacement needs an EP rank >= 0, got {self.rank}")
        self._tracker = PhaseTracker(Role.LAUNCH_RECOVERY_REPLACEMENT, self.started_at)

    def taken_back(self, now: float) -> None:
        """The survivors took it back and it received their expert map."""
        self._tracker.advance(Phase.RESTORING_EXPERTS, now)

    def serving(self, now: float) -> None:
        """Its slots hold the experts the map gives them."""
        self._tracker.advance(Phase.SERVING_RECOVERED, now)

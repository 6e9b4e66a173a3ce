"""A survivor's side of recovering a failed tail of ranks that joined by scale-up.

Pure: the adapter (``sglang/tail_recovery.py``) builds one when every survivor lets go of the
failed slots on an agreed pass, asks it on each pass whether to look for the replacement and
what the replacement's registration means, and reports what upstream's scale-up did. Phases
(``core.phases.TRANSITIONS``)::

    SERVING_DEGRADED --let go (agreed pass)--> AWAITING_REPLACEMENT
    AWAITING_REPLACEMENT --replacement registered, scale back requested--> REJOINING
    REJOINING --admitted at the old size--> SERVING_RECOVERED
    REJOINING --admitted below the old size--> AWAITING_REPLACEMENT (the slots above are awaited)
    REJOINING --the re-admission failed--> AWAITING_REPLACEMENT (the next replacement is awaited)
    AWAITING_REPLACEMENT --the failed slots removed by a scale-down--> SERVING_CONTRACTED

The replacement itself joins the way the failed ranks first came in, as a scale joiner
(``scale_up_machine.JoinerMachine``): one server for the whole tail, or one per rank (each
registers at the lowest slot still awaited, so the lowest comes back first, and a higher one
started earlier waits in its admission until the slots below it are back). Nothing here
waits: each call answers in O(1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sglang_elastic_ep.core.phases import Phase, PhaseMachine, PhaseTracker, Role

COHORT_CHECK_INTERVAL_S = 0.5  # a store round trip; a replacement takes a minute to start


class ReplacementVerdict(str, enum.Enum):
    """What a look at the store and Mooncake's peer state means for the awaited replacement."""

    NOT_YET = "not_yet"  # no cohort, or the new process has not joined WORLD yet
    WRONG_SIZE = "wrong_size"  # a joiner registered for another size: not this replacement
    READMIT = "readmit"  # ask for the old size again: upstream's scale-up admits it


@dataclass
class TailRecoveryMachine(PhaseMachine):
    """Slots ``[first_failed, return_to)`` failed; the survivors serve on ``first_failed``
    ranks until a replacement for all of them is admitted."""

    first_failed: int
    return_to: int
    started_at: float  # monotonic seconds
    check_interval_s: float = COHORT_CHECK_INTERVAL_S
    next_check_at: float = 0.0
    readmitting_to: int = 0  # the size the re-admission in progress asked for
    partly_back: range | None = None  # the slots the last re-admission below the old size refilled
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.first_failed < self.return_to:
            raise ValueError(f"a failed tail needs 1 <= first failed slot < size, got slots "
                             f"{self.first_failed}..{self.return_to - 1}")
        self._tracker = PhaseTracker(Role.RECOVERY_SURVIVOR, self.started_at)

    @property
    def awaiting_replacement(self) -> bool:
        """The failed slots are let go of and not yet refilled or removed."""
        return self.phase in (Phase.AWAITING_REPLACEMENT, Phase.REJOINING)

    @property
    def failed_slots(self) -> range:
        return range(self.first_failed, self.return_to)

    def let_go(self, now: float) -> None:
        """Every survivor cut the failed slots from its layout on the agreed pass."""
        self._tracker.advance(Phase.AWAITING_REPLACEMENT, now)

    def check_due(self, now: float) -> bool:
        """Whether to look for the replacement on this pass (at most every interval)."""
        if self.phase is not Phase.AWAITING_REPLACEMENT or now < self.next_check_at:
            return False
        self.next_check_at = now + self.check_interval_s
        return True

    def replacement_verdict(self, cohort_target: int | None, peers_joined: bool
                            ) -> ReplacementVerdict:
        """``cohort_target``: the size the joiner registered at the first failed slot asked
        for (None: no registration): the old size, or less for a replacement of the lowest
        failed slots only. ``peers_joined``: Mooncake shows a process in every slot from the
        first failed one up to ``cohort_target``. The dead joiner's registration stays in the
        store with the same payload, so only the peer state tells that a new process is
        there."""
        if cohort_target is None:
            return ReplacementVerdict.NOT_YET
        if not self.first_failed < cohort_target <= self.return_to:
            return ReplacementVerdict.WRONG_SIZE
        return ReplacementVerdict.READMIT if peers_joined else ReplacementVerdict.NOT_YET

    def wrong_size_message(self, cohort_target: int) -> str:
        return (f"a joiner registered for size {cohort_target} while ranks "
                f"{self.first_failed}..{self.return_to - 1} await their replacement: relaunch "
                f"them with --ep-join-mode recover from --elastic-ep-join-rank-offset "
                f"{self.first_failed} (one server for them all, or one per rank)")

    def readmission_requested(self, now: float, target: int | None = None) -> None:
        """The re-admission up to ``target`` (default: the old size) was asked for."""
        self.readmitting_to = self.return_to if target is None else target
        self._tracker.advance(Phase.REJOINING, now)

    def observe(self, effective_size: int, scale_pending: bool, now: float) -> Phase | None:
        """After upstream's per-pass step: the phase entered when the re-admission ended
        (recovered at the old size; or the slots below the size it asked for are back, and
        ``partly_back`` names them, the ones above are awaited; or failed: the next
        replacement is awaited), else None."""
        if self.phase is not Phase.REJOINING or scale_pending:
            return None
        self.partly_back = None
        if effective_size == self.return_to:
            to = Phase.SERVING_RECOVERED
        else:
            to = Phase.AWAITING_REPLACEMENT
            if self.first_failed < effective_size == self.readmitting_to:
                self.partly_back = range(self.first_failed, effective_size)
                self.first_failed = effective_size
        self._tracker.advance(to, now)
        return to

    def removed(self, now: float) -> None:
        """A scale-down to the survivors' size removed the failed slots: nothing is awaited."""
        self._tracker.advance(Phase.SERVING_CONTRACTED, now)

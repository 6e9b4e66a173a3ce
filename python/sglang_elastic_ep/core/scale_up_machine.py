"""The two sides of one scale-up: a rank that serves while joiners come in, and a joiner.

The serving rank's side (:class:`ScaleUpMachine`). Pure: the adapter (``sglang/scale_up.py``)
builds one when the rank first sees a scale-up pending, asks it on each pass whether to call the
scale-up off (a cancel, the timeout), tells it when upstream's admission began (on the pass
every rank agreed on, ``core.agreement``), and shows it what upstream's admission and commit
left. Phases (``core.phases.TRANSITIONS``)::

    WAITING_FOR_COHORT --agreed pass--> JOINING --committed at the new size--> SERVING_EXPANDED
       |                                   +--upstream failed it on this rank--> FAILED
       +--called off on an agreed pass (cancelled, timed out)--> FAILED

The agreed pass is the commit point: a cancel is taken before it and refused after it.

The joiner's side (:class:`JoinerMachine`). A joiner runs no scheduler pass until it serves:
its side is upstream's start-up, which blocks in each step, so the adapter
(``sglang/scale_up_joiner.py``) tells the machine when each step returned::

    PENDING --admitted into WORLD--> JOINING --map received, graphs built--> SYNCING_NEW_WORLD
       --met the serving ranks at the commit barrier--> SERVING_EXPANDED
    (any of them --a step raised--> FAILED)

Nothing here waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_elastic_ep.core.agreement import AbortReason
from sglang_elastic_ep.core.phases import (
    Phase,
    PhaseMachine,
    PhaseTracker,
    Role,
    StartUpMachine,
)


@dataclass
class ScaleUpMachine(PhaseMachine):
    """The EP size goes from ``old_size`` to ``new_size``; this rank serves throughout."""

    old_size: int
    new_size: int
    started_at: float  # monotonic seconds: when the rank took the request
    timeout_s: float = 0.0  # the joiners must be ready within it (0: no limit)
    cancel_requested: bool = False
    error: str | None = None
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.old_size < self.new_size:
            raise ValueError(f"a scale-up needs 1 <= old size < new size, got "
                             f"{self.old_size} -> {self.new_size}")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")
        self._tracker = PhaseTracker(Role.SCALE_UP_EXISTING, self.started_at)

    @property
    def waiting(self) -> bool:
        return self.phase is Phase.WAITING_FOR_COHORT

    # --- while waiting for the joiners: one call per pass, none of them waits ---------------

    def request_cancel(self) -> tuple[bool, str]:
        """A cancel reached this rank: ``(accepted, message)``. Taken only before the commit
        point; the ranks drop the scale-up together on the pass that reads it."""
        if not self.waiting:
            return False, (f"the scale-up to {self.new_size} is past its commit point "
                           f"({self.phase.value})")
        self.cancel_requested = True
        return True, f"cancel of the scale-up to {self.new_size} requested"

    def abort_reason(self, now: float) -> AbortReason:
        """Whether this rank calls the scale-up off on this pass (its ``abort`` column); a
        cancel wins over the timeout."""
        if not self.waiting:
            return AbortReason.NONE
        if self.cancel_requested:
            return AbortReason.CANCELLED
        if self.timeout_s and now - self.started_at > self.timeout_s:
            return AbortReason.TIMED_OUT
        return AbortReason.NONE

    # --- the agreed pass and after ----------------------------------------------------------

    def entered(self, now: float) -> None:
        """Upstream's admission began: on the pass every rank agreed on, the commit point."""
        self._tracker.advance(Phase.JOINING, now)

    def observe(self, effective_size: int, still_pending: bool, now: float) -> Phase | None:
        """After upstream's step on the agreed pass: the phase it ended in, or None while the
        commit is still under way (upstream finishes it on a later pass)."""
        if self.phase is not Phase.JOINING or still_pending:
            return None
        if effective_size == self.new_size:
            self._tracker.advance(Phase.SERVING_EXPANDED, now)
        else:
            self.error = (f"scale-up to {self.new_size} failed on this rank; serving on at "
                          f"{effective_size}")
            self._tracker.advance(Phase.FAILED, now)
        return self.phase

    def call_off(self, reason: AbortReason, detail: str, now: float) -> str:
        """The pass's verdict called the scale-up off: every rank serves on at the old size.
        The message to report."""
        if reason is AbortReason.CANCELLED:
            self.error = f"scale-up to {self.new_size} cancelled"
        elif reason is AbortReason.TIMED_OUT:
            self.error = (f"scale-up to {self.new_size} called off: the joiners were not ready "
                          f"within {self.timeout_s:g} s (--elastic-ep-scale-timeout)")
        else:
            self.error = f"scale-up to {self.new_size} called off: {detail or reason.name}"
        self._tracker.advance(Phase.FAILED, now)
        return self.error


@dataclass
class JoinerMachine(StartUpMachine):
    """A scale joiner for EP ranks ``join_offset..new_size-1``, from the registration of its
    cohort (``started_at``) to serving at ``new_size``."""

    join_offset: int  # the first EP rank this joiner takes
    new_size: int
    started_at: float  # monotonic seconds
    error: str | None = None
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.join_offset < self.new_size:
            raise ValueError(f"a scale joiner needs 1 <= first rank < new size, got first rank "
                             f"{self.join_offset}, new size {self.new_size}")
        self._tracker = PhaseTracker(Role.SCALE_UP_JOINING, self.started_at)

    @property
    def ranks(self) -> range:
        return range(self.join_offset, self.new_size)

    def admitted(self, now: float) -> None:
        """The serving ranks admitted it into WORLD (upstream's ``join_scale_process_group``
        returned): it receives the expert map next (and builds its graphs, if it captures
        any: a joiner without graphs prepared everything else before it registered)."""
        self._tracker.advance(Phase.JOINING, now)

    def syncing(self, now: float) -> None:
        """It enters the commit barrier with the serving ranks."""
        self._tracker.advance(Phase.SYNCING_NEW_WORLD, now)

    def serving(self, now: float) -> None:
        self._tracker.advance(Phase.SERVING_EXPANDED, now)


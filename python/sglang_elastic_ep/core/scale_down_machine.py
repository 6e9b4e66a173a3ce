"""One scheduler process's side of one scale-down: a staying rank or a leaving one.

A scale-down lets the tail ``[new_size, old_size)`` go; a removal below the tail
(``removed``) lets named launch-time ranks go and keeps the size: their slots become holes,
which a relaunch in recover mode refills. Both drain and commit the same way.

Pure: the adapter (``sglang/scale_down.py``) builds one per scale-down request, feeds it what
the process sees on each pass, and reports the steps of the release it runs; the per-pass
agreement (``core.agreement``, carried in upstream's DP-attention gather) decides on which pass
every rank enters the release or calls the scale-down off. Phases
(``core.phases.TRANSITIONS``)::

    DRAINING --agreed pass--> MOVING_EXPERTS -> SWITCHING_PLACEMENT -> RELEASING
       |                                              staying -> SERVING_CONTRACTED
       |                                              leaving -> RELEASED
       +--called off on an agreed pass (timed out, a staying rank failed)--> FAILED

Only the release blocks serving; while DRAINING the machine answers in O(1) and never waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_elastic_ep.core.agreement import AbortReason, ranks_bitmask
from sglang_elastic_ep.core.phases import Phase, PhaseMachine, PhaseTracker, Role

_RELEASE_STEPS = (Phase.MOVING_EXPERTS, Phase.SWITCHING_PLACEMENT, Phase.RELEASING)


@dataclass
class ScaleDownMachine(PhaseMachine):
    """Ranks ``[new_size, old_size)`` leave, or the ``removed`` ranks (then ``new_size`` is
    ``old_size``); ``rank`` is this process's EP rank."""

    rank: int
    old_size: int
    new_size: int
    started_at: float  # monotonic seconds
    timeout_s: float = 0.0  # the drain must end within it (0: no limit)
    # Ranks below the tail that leave where they are (sorted); () for a scale-down of the tail.
    removed: tuple[int, ...] = ()
    drain_confirmed: bool = False  # the HTTP process saw every request routed to the tail end
    error: str | None = None
    # The request's operation id: its drain confirmation carries the same one.
    operation_id: str | None = None
    _late_answered: bool = field(default=False, init=False, repr=False)
    _call_off_answered: bool = field(default=False, init=False, repr=False)
    _tracker: PhaseTracker = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.removed:
            if self.new_size != self.old_size:
                raise ValueError(f"a removal keeps the size, got {self.old_size} -> "
                                 f"{self.new_size}")
            if (list(self.removed) != sorted(set(self.removed)) or self.removed[0] < 1
                    or self.removed[-1] >= self.old_size):
                raise ValueError(f"removed ranks must be distinct, sorted and in "
                                 f"1..{self.old_size - 1}, got {list(self.removed)}")
        elif not 1 <= self.new_size < self.old_size:
            raise ValueError(f"a scale-down needs 1 <= new size < old size, got "
                             f"{self.old_size} -> {self.new_size}")
        if not 0 <= self.rank < self.old_size:
            raise ValueError(f"rank {self.rank} is outside the current size {self.old_size}")
        if self.timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {self.timeout_s}")
        self._tracker = PhaseTracker(self.role, self.started_at)

    @property
    def leaving(self) -> bool:
        return self.rank in self.leaving_ranks

    @property
    def role(self) -> Role:
        return Role.SCALE_DOWN_LEAVING if self.leaving else Role.SCALE_DOWN_STAYING

    @property
    def leaving_ranks(self) -> tuple[int, ...]:
        return self.removed or tuple(range(self.new_size, self.old_size))

    @property
    def agreed_target(self) -> int:
        """The ``target`` column of this rank's proposal: the new size, or for a removal the
        removed ranks as a bitmask (``agreement.ranks_bitmask``)."""
        return ranks_bitmask(self.removed) if self.removed else self.new_size

    @property
    def description(self) -> str:
        if self.removed:
            return f"removal of ranks {list(self.removed)}"
        return f"scale-down to {self.new_size}"

    def is_for(self, new_size: int, removed: tuple[int, ...] = ()) -> bool:
        """Whether a request for ``new_size`` (or to remove ``removed``) names this one."""
        return tuple(removed) == self.removed and new_size == self.new_size

    @property
    def draining(self) -> bool:
        return self.phase is Phase.DRAINING

    # --- while draining: one call per pass, none of them waits ----------------------------

    def confirm_drain(self) -> None:
        """The HTTP process's second message: nothing it routed to the tail is still running,
        so no request can still be on its way to a leaving rank."""
        if not self.draining:
            raise ValueError(f"no drain to confirm: the {self.description} is "
                             f"{self.phase.value}")
        self.drain_confirmed = True

    def readiness(self, *, holds_no_request: bool) -> int:
        """This rank's ``ready`` column for the pass: the agreed target when it can enter the
        release now, else 0. A staying rank is ready at once; a leaving rank once the drain is
        confirmed and it holds no request (``holds_no_request`` includes the batch this pass
        runs)."""
        if not self.draining:
            return 0
        if not self.leaving or (self.drain_confirmed and holds_no_request):
            return self.agreed_target
        return 0

    def abort_reason(self, now: float, *, failed_ranks: frozenset[int]) -> AbortReason:
        """Whether this rank calls the scale-down off on this pass (its ``abort`` column):
        the drain outlasted the timeout, or a staying rank failed (the release would hand its
        experts to a dead rank; its recovery runs once the scale-down is off). A leaving rank
        that failed is no reason: it leaves anyway."""
        if not self.draining:
            return AbortReason.NONE
        if any(r < self.old_size and r not in self.leaving_ranks for r in failed_ranks):
            return AbortReason.RANK_FAILED
        if self.timeout_s and now - self.started_at > self.timeout_s:
            return AbortReason.TIMED_OUT
        return AbortReason.NONE

    # --- the agreed pass -------------------------------------------------------------------

    def advance(self, phase: Phase, now: float) -> None:
        """The release entered its next step (every rank on the same agreed pass)."""
        if phase not in _RELEASE_STEPS:
            raise ValueError(f"{phase.value} is not a step of the release "
                             f"({', '.join(p.value for p in _RELEASE_STEPS)})")
        self._tracker.advance(phase, now)

    def committed(self, now: float) -> Phase:
        """The release is done: serving at the new size, or released (leaving)."""
        final = Phase.RELEASED if self.leaving else Phase.SERVING_CONTRACTED
        self._tracker.advance(final, now)
        return final

    def call_off(self, reason: AbortReason, detail: str, now: float) -> str:
        """The pass's verdict called the scale-down off: every rank serves on at the old size.
        The message to report."""
        whys = {
            AbortReason.TIMED_OUT: f"the drain did not end within {self.timeout_s:g} s "
                                   "(--elastic-ep-scale-timeout)",
            AbortReason.RANK_FAILED: "a staying rank failed during the drain",
        }
        if reason not in whys:
            raise ValueError(f"a scale-down is not called off for {reason.name}")
        why = whys[reason]
        self.error = (f"{self.description} called off: {why}"
                      + (f" ({detail})" if detail else ""))
        self._tracker.advance(Phase.FAILED, now)
        return self.error

    def answers_called_off_confirmation(self, operation_id: str | None) -> str | None:
        """The HTTP process's drain confirmation of a scale-down this rank has called off (a
        staying rank died mid-drain, and the drain ended before the HTTP process read the
        call-off): why it was called off, answered once, for the same operation only (a
        later request for the same change is a new one)."""
        if (self.phase is not Phase.FAILED or operation_id is None
                or operation_id != self.operation_id or self._call_off_answered):
            return None
        self._call_off_answered = True
        return self.error

    def answers_late_confirmation(self, new_size: int, removed: tuple[int, ...] = ()) -> bool:
        """The HTTP process's drain confirmation for this scale-down reached this process after
        the commit. Staying ranks are ready at once and leaving ones as soon as they read it, so
        the commit can run before a staying rank has read the same message from its socket;
        it is answered as done, not taken for a new request. A removal's is answered once: the
        same removal asked again later (after its ranks were relaunched) is a new one."""
        if self.phase is not Phase.SERVING_CONTRACTED or not self.is_for(new_size, removed):
            return False
        if self.removed:
            if self._late_answered:
                return False
            self._late_answered = True
        return True

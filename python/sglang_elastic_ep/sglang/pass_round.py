"""Each scheduler process's record of the per-pass agreement's rounds (``gather_agreement``
produces them; the membership step and EPLB read them). Kept apart from the gather so that
readers need none of its dependencies."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.core.agreement import GatheredRound, LockstepVerdict, Proposal
from sglang_elastic_ep.sglang.upstream import attached_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgreedRound:
    """One pass's verdict with this rank's own proposal (the step it enters on ENTER)."""

    outcome: GatheredRound
    proposal: Proposal

    @property
    def verdict(self) -> LockstepVerdict:
        return self.outcome.verdict


@dataclass
class GatherAgreement:
    """This scheduler process's side of the agreement (one per process: ``gather_agreement``).

    A gather produces a round (``fresh``); the first membership step after it takes it. The
    scheduler's iteration mark (after ``get_next_batch_to_run``, once per loop iteration) tells
    a later call in the same iteration (a draft model's forward) from a pass with no gather.
    """

    runner: Any = None  # this pass's model runner, while upstream prepares the gather
    batch_idle: bool = True  # this rank's batch for the pass holds no request
    outgoing: list[int] | None = None  # this rank's columns, while its row is built and gathered
    upstream_width: int = 0  # upstream's columns in this gather's rows
    fresh: AgreedRound | None = None  # decided by the last gather, not yet acted on
    last: AgreedRound | None = None  # the round acted on last
    iteration_gathered: bool = False  # the current loop iteration produced a round
    gathered_since_mark: bool = False
    reported: set[str] = field(default_factory=set)

    def finish(self, agreed: AgreedRound) -> None:
        self.fresh = agreed
        self.gathered_since_mark = True
        if agreed.outcome.problem is not None and agreed.verdict is not LockstepVerdict.ABORT:
            self.report_once(f"membership agreement: {agreed.outcome.problem}; waiting")

    def take(self) -> AgreedRound | None:
        """This pass's round, once; None if it was taken already or no gather produced one."""
        agreed, self.fresh = self.fresh, None
        if agreed is not None:
            self.last = agreed
        return agreed

    def mark_iteration(self) -> bool:
        """Called once per scheduler loop iteration, after its gathers: whether they produced a
        round. A round left over from an iteration without a gather is dropped."""
        gathered, self.gathered_since_mark = self.gathered_since_mark, False
        self.iteration_gathered = gathered
        if not gathered:
            self.fresh = None
        return gathered

    def pass_verdict(self) -> LockstepVerdict | None:
        """This pass's verdict, whether or not the membership step took its round yet (None:
        no gather this iteration). Equal on every rank: what ranks may decide together on."""
        if self.fresh is not None:
            return self.fresh.verdict
        return self.repeat_verdict()

    def repeat_verdict(self) -> LockstepVerdict | None:
        """For a second membership step in an iteration whose round was taken: that round's
        verdict (None: no round this iteration)."""
        if not self.iteration_gathered or self.last is None:
            return None
        return self.last.verdict

    def report_once(self, message: str) -> None:
        if message not in self.reported:
            self.reported.add(message)
            logger.error("[elastic-ep] %s", message)


AGREEMENT_ATTR = "_elastic_ep_gather_agreement"


def gather_agreement(state: Any) -> GatherAgreement:
    """The agreement kept on upstream's per-process ``ElasticEPState`` ``state``; built on first
    use."""
    return attached_state(state, AGREEMENT_ATTR, GatherAgreement)



"""EPLB rebalances decided together, and the EP size at each one that installed a layout.

Upstream's ``EPLBManager.rebalance`` runs on the same pass on every rank (its counter advances
in lockstep) and takes part in collectives. It returns early when rebalancing is disabled, but
each rank disables it when it reads a scale request, which ranks do on different passes: a
rank that had not read it yet rebalanced alone while the others entered the scale-up, and both
hung. So the pass's agreed verdict (the per-pass gather, equal on every rank) decides: while any
rank sees a membership change pending, every rank skips the rebalance.

Upstream installs a new layout with ``ExpertLocationMetadata.update``; counting those updates
across one rebalance tells an install from an early return. Rank 0's list reaches the status
through the expert report (``expert_health``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.core.agreement import LockstepVerdict
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.pass_round import gather_agreement
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_ep_enabled, elastic_state

logger = get_logger(__name__)

KEEP = 64  # rebalances remembered (oldest dropped)


@dataclass
class ExpertLayoutLog:
    """This scheduler process's layout updates (one per process: :func:`layout_log`)."""

    updates: int = 0  # ExpertLocationMetadata.update calls (EPLB, expert moves)
    rebalances: list[int] = field(default_factory=list)  # EP size at each EPLB install

    def rebalanced(self, ep_size: int) -> None:
        self.rebalances = [*self.rebalances, int(ep_size)][-KEEP:]


def layout_log(state: Any) -> ExpertLayoutLog:
    """The log kept on upstream's per-process ``ElasticEPState`` ``state``."""
    return attached_state(state, "_elastic_ep_layout_log", ExpertLayoutLog)


def rebalance_recorded(original: Any, manager: Any, *args: Any,
                       **kwargs: Any) -> Generator[Any, Any, Any]:
    """AROUND ``EPLBManager.rebalance`` (a generator): upstream's rebalance; when it installed
    a layout, the EP size it was installed at is recorded. Skipped on every rank while the
    pass's agreed verdict has a membership change pending (module docstring). After a
    scale-down upstream would skip every rebalance (it only knows its own settled phase): for
    the call, a settled scale-down shows upstream's settled phase."""
    state = elastic_state() if elastic_ep_enabled() else None
    if state is None:
        return (yield from original(manager, *args, **kwargs))
    verdict = gather_agreement(state).pass_verdict()
    if verdict is not None and verdict is not LockstepVerdict.NOTHING_PENDING:
        logger.info("[elastic-ep] EPLB rebalance skipped on every rank: a membership change is "
                    "pending (verdict %s)", verdict.value)
        return None
    log = layout_log(state)
    before = log.updates
    # Upstream rebalances after a scale only in its own settled phase (SERVING_EXPANDED); a
    # scale-down (this plugin's) settles in SERVING_CONTRACTED, which upstream does not know.
    settled_here = (state.scale_phase == Phase.SERVING_CONTRACTED.value
                    and state.pending_ep_size is None)
    if settled_here:
        state.scale_phase = Phase.SERVING_EXPANDED.value
    try:
        result = yield from original(manager, *args, **kwargs)
    finally:
        if settled_here and state.scale_phase == Phase.SERVING_EXPANDED.value:
            state.scale_phase = Phase.SERVING_CONTRACTED.value
    if log.updates != before:
        log.rebalanced(state.effective_ep_size)
    return result

"""The EP size at each EPLB rebalance that installed a layout, for the status.

Upstream's ``EPLBManager.rebalance`` returns early when rebalancing is disabled (a scale in
progress) or not needed, and otherwise installs a new layout with
``ExpertLocationMetadata.update``. Counting those updates across one rebalance tells the two
apart; rank 0's list reaches the status through the expert report (``expert_health``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_ep_enabled, elastic_state

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
    a layout, the EP size it was installed at is recorded. After a scale-down upstream would
    skip every rebalance (it only knows its own settled phase): for the call, a settled
    scale-down shows upstream's settled phase."""
    state = elastic_state() if elastic_ep_enabled() else None
    if state is None:
        return (yield from original(manager, *args, **kwargs))
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

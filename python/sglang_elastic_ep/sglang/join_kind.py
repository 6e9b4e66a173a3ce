"""Recovery or scale-up: what a join does to EPLB (the RFC's ``is_recovery_join``).

Each scheduler keeps a :class:`~sglang_elastic_ep.core.membership.SlotHistory` on upstream's
per-process ``ElasticEPState``: every membership event adds the active slots, and a slot cut
from the expert map (scale-down, letting go of a failed tail) is forgotten. A join of slots
that served before is a recovery: the replacement takes the failed rank's slots back (the
healthy ranks broadcast the layout), and EPLB's statistics predate the fault, so its
generator is reset. A join of new slots is a scale-up: the slots are appended to the map and
upstream re-arms EPLB on the new layout, which rebalances after its interval. Each join logs
which path it took.
"""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep.core.membership import JoinKind, SlotHistory
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state

logger = get_logger(__name__)

_HISTORY_ATTR = "_elastic_ep_slot_history"


def slot_history(state: Any) -> SlotHistory:
    """This process's slot history, kept on ``state`` (an ``ElasticEPState``)."""

    def launch() -> SlotHistory:
        cpu = getattr(state, "active_ranks_cpu", None)
        mask = cpu.tolist() if cpu is not None else []
        return SlotHistory(r for r, v in enumerate(mask) if v)

    return attached_state(state, _HISTORY_ATTR, launch)


def note_join(state: Any, ranks: list[int], kind: JoinKind, eplb_manager: Any) -> None:
    """After ``ranks`` joined as ``kind``: reset EPLB for a recovery; log the path taken."""
    if kind is JoinKind.RECOVERY:
        if eplb_manager is not None:
            eplb_manager.reset_generator()
        logger.info("[elastic-ep] ranks %s joined by recovery (slots active before): EPLB "
                    "generator reset, its statistics predate the fault", ranks)
    else:
        logger.info("[elastic-ep] ranks %s joined by scale-up (new slots): EPLB re-armed on "
                    "the new layout, it rebalances after its interval", ranks)
    slot_history(state).observe([1 if r in ranks else 0 for r in range(max(ranks) + 1)])

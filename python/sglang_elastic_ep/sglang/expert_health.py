"""Per-expert latency health on the scheduler side: gather, report, and block slow ranks.

- **Gather.** Each rank's expert timings (cpu/expert_timing.py) ride along with the per-pass
  membership agreement (gather_agreement): in its own row of the DP-attention gather upstream
  runs every pass (or, on a pass without one, in the fallback all-reduce, where every rank
  fills its own physical slots and MAX gives every rank all of them). No extra collective.
- **Report.** Rank 0 adds them, with the first MoE layer's expert map, to its answer to
  ``GetInternalStateReq``; the HTTP process polls that and feeds the control plane's health
  monitor (``GET /elastic_ep/health``, ``recovery_required``).
- **Block.** A rank the monitor hard-blocks for slow experts is sent back in a
  ``SetInternalStateReq`` (key ``elastic_ep_blocked_ranks_mask``); from then on the expert
  dispatch treats its slots like an inactive rank's (expert_dispatch.py): tokens go to replicas
  on other ranks. The HTTP process blocks a rank only if every expert keeps a replica elsewhere.
  Routing is per rank and needs no agreement: a rank that learns it a pass later still sends
  valid tokens to a live rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_elastic_ep.sglang.eplb_log import layout_log
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import (
    attached_state,
    elastic_state,
    expert_location_metadata,
)

logger = get_logger(__name__)

BLOCKED_RANKS_KEY = "elastic_ep_blocked_ranks_mask"
REPORT_KEY = "elastic_ep_experts"


@dataclass
class ExpertHealthState:
    """This scheduler process's expert timings and blocked ranks (one per process:
    ``expert_health_state``)."""

    gathered: tuple[int, list[int]] | None = None  # (local slots, ns per row + rows)
    blocked_mask: int = 0  # bit r set: rank r is blocked for slow experts
    keep: torch.Tensor | None = None  # 1 where a rank is not blocked (device copy of the mask)

    def take_gathered(self, values: list[int]) -> None:
        """Every rank's timings, as one vector: kept for rank 0's report."""
        metadata = expert_location_metadata()
        if metadata is not None and values:
            self.gathered = (int(metadata.num_local_physical_experts), values)

    def block(self, mask: int) -> bool:
        """Block the ranks set in ``mask`` (and only those); False when nothing changed."""
        if mask == self.blocked_mask:
            return False
        self.blocked_mask = mask
        self.keep = None
        return True

    def blocked_ranks(self) -> list[int]:
        return [r for r in range(64) if self.blocked_mask >> r & 1]

    def routable_ranks(self, active_ranks: torch.Tensor) -> torch.Tensor:
        """``active_ranks`` with blocked ranks cleared (``active_ranks`` itself when none is)."""
        if not self.blocked_mask:
            return active_ranks
        keep = self.keep
        if keep is None or keep.device != active_ranks.device \
                or keep.numel() != active_ranks.numel():
            mask = self.blocked_mask
            flags = [0 if mask >> r & 1 else 1 for r in range(active_ranks.numel())]
            keep = torch.tensor(flags, dtype=active_ranks.dtype, device=active_ranks.device)
            self.keep = keep
        return active_ranks * keep


_STATE_ATTR = "_elastic_ep_expert_health"


def expert_health_state(state: Any) -> ExpertHealthState:
    """The expert health kept on upstream's per-process ``ElasticEPState`` ``state``: the
    expert dispatch, which receives neither scheduler nor model runner, reaches it there as
    the scheduler hooks do; built on first use."""
    return attached_state(state, _STATE_ATTR, ExpertHealthState)


def own_timings(local_slots: int) -> list[int]:
    """This rank's timings for its ``local_slots`` physical slots: [ns per row..., rows...]
    (what its row of the gather carries)."""
    if not local_slots:
        return []
    from sglang_elastic_ep.sglang.expert_timing import expert_timer

    ns, rows = expert_timer().snapshot(local_slots)
    return ns + rows


def local_contribution(rank: int, max_ep_size: int) -> list[int]:
    """This rank's share of the fallback all-reduce's vector: [ns per row..., rows...] over
    every physical slot up to ``max_ep_size``, zeros outside this rank's own slots. Its length
    is the same on every rank (the layout keeps slots per rank fixed), as the all-reduce
    needs."""
    metadata = expert_location_metadata()
    local = int(metadata.num_local_physical_experts) if metadata is not None else 0
    total = max_ep_size * local
    ns = [0] * total
    rows = [0] * total
    if local:
        from sglang_elastic_ep.sglang.expert_timing import expert_timer

        mine_ns, mine_rows = expert_timer().snapshot(local)
        ns[rank * local:(rank + 1) * local] = mine_ns
        rows[rank * local:(rank + 1) * local] = mine_rows
    return ns + rows


def add_report(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_internal_state``: rank 0's answer carries the gathered timings."""
    state = elastic_state()
    if state is None or not isinstance(getattr(result, "internal_state", None), dict):
        return
    health = expert_health_state(state)
    if health.gathered is None:
        return
    local, values = health.gathered
    half = len(values) // 2
    metadata = expert_location_metadata()
    p2l = [] if metadata is None else metadata.physical_to_logical_map[0].tolist()
    result.internal_state[REPORT_KEY] = {
        "local_slots": local,
        "ns_per_row": values[:half],
        "rows": values[half:],
        "physical_to_logical": p2l,
        "blocked_ranks_mask": health.blocked_mask,
        "eplb_rebalances": list(layout_log(state).rebalances),
    }


def take_blocked_ranks(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.set_internal_state``: our key sets the blocked ranks; the rest (if
    any) is upstream's."""
    args = getattr(recv_req, "server_args", None)
    if not isinstance(args, dict) or BLOCKED_RANKS_KEY not in args:
        return original(scheduler, recv_req)
    mask = int(args.pop(BLOCKED_RANKS_KEY))
    state = elastic_state()
    # Without elastic EP state there is no dispatch to block in: only the key is taken.
    if state is not None:
        health = expert_health_state(state)
        if health.block(mask):
            logger.warning("[elastic-ep] experts of ranks %s blocked (slow): their tokens go "
                           "to replicas on other ranks", health.blocked_ranks())
    if args:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    return SetInternalStateReqOutput(updated=True)

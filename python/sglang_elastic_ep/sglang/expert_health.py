"""Per-expert latency health on the scheduler side: gather, report, and block slow ranks.

- **Gather.** Each rank's expert timings (cpu/expert_timing.py) ride along in the per-pass
  agreement all-reduce (scale_progress): every rank fills its own physical slots, MAX gives
  every rank all of them. No extra collective, the same on every pass.
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

import logging
from typing import Any

import torch

from sglang_elastic_ep.sglang.upstream import expert_location_metadata

logger = logging.getLogger(__name__)

BLOCKED_RANKS_KEY = "elastic_ep_blocked_ranks_mask"
REPORT_KEY = "elastic_ep_experts"

_gathered: tuple[int, list[int]] | None = None  # (local slots, ns per row + rows)
_blocked_mask = 0
_keep: torch.Tensor | None = None  # 1 where a rank is not blocked (device copy of the mask)


def local_contribution(rank: int, max_ep_size: int) -> list[int]:
    """This rank's share of the gathered vector: [ns per row..., rows...] over every physical
    slot up to ``max_ep_size``, zeros outside this rank's own slots. Its length is the same on
    every rank (the layout keeps slots per rank fixed), as the all-reduce needs."""
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


def take_gathered(values: list[int]) -> None:
    """The reduced vector (every rank's share): kept for rank 0's report."""
    global _gathered
    metadata = expert_location_metadata()
    if metadata is not None and values:
        _gathered = (int(metadata.num_local_physical_experts), values)


def add_report(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_internal_state``: rank 0's answer carries the gathered timings."""
    if _gathered is None or not isinstance(getattr(result, "internal_state", None), dict):
        return
    local, values = _gathered
    half = len(values) // 2
    metadata = expert_location_metadata()
    p2l = [] if metadata is None else metadata.physical_to_logical_map[0].tolist()
    result.internal_state[REPORT_KEY] = {
        "local_slots": local,
        "ns_per_row": values[:half],
        "rows": values[half:],
        "physical_to_logical": p2l,
        "blocked_ranks_mask": _blocked_mask,
    }


def take_blocked_ranks(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND ``Scheduler.set_internal_state``: our key sets the blocked ranks; the rest (if
    any) is upstream's."""
    global _blocked_mask, _keep
    args = getattr(recv_req, "server_args", None)
    if not isinstance(args, dict) or BLOCKED_RANKS_KEY not in args:
        return original(scheduler, recv_req)
    mask = int(args.pop(BLOCKED_RANKS_KEY))
    if mask != _blocked_mask:
        _blocked_mask = mask
        _keep = None
        logger.warning("[elastic-ep] experts of ranks %s blocked (slow): their tokens go to "
                       "replicas on other ranks", blocked_ranks())
    if args:
        return original(scheduler, recv_req)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    return SetInternalStateReqOutput(updated=True)


def blocked_ranks() -> list[int]:
    return [r for r in range(64) if _blocked_mask >> r & 1]


def routable_ranks(active_ranks: torch.Tensor) -> torch.Tensor:
    """``active_ranks`` with blocked ranks cleared (``active_ranks`` itself when none is)."""
    global _keep
    if not _blocked_mask:
        return active_ranks
    if _keep is None or _keep.device != active_ranks.device \
            or _keep.numel() != active_ranks.numel():
        keep = [0 if _blocked_mask >> r & 1 else 1 for r in range(active_ranks.numel())]
        _keep = torch.tensor(keep, dtype=active_ranks.dtype, device=active_ranks.device)
    return active_ranks * _keep

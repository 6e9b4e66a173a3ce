"""EPLB layouts that survive rank faults: each expert on at least ``--elastic-ep-expert-min-ranks``
ranks.

EPLB replicates hot experts and keeps one replica of a cold one, wherever the load balance
puts it; when that rank fails, the cold expert has no replica left and its tokens lose it (the
dispatch sends them to ``-1``) until a rebalance places it again. With the flag above 1, every
layout EPLB computes is adjusted (``core.placement.spread_replicas``) so that any
``min_ranks - 1`` failed ranks leave every expert served, and greedy outputs do not change.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_elastic_ep.core.placement import PlacementError, spread_replicas
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled

logger = get_logger(__name__)


def min_expert_ranks() -> int:
    from sglang.srt.runtime_context import get_server_args

    return int(getattr(get_server_args(), "elastic_ep_expert_min_ranks", 1) or 1)


def rebalance_experts_spread(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``eplb_algorithms.rebalance_experts``: upstream's layout, then every expert on
    at least ``--elastic-ep-expert-min-ranks`` ranks."""
    result = original(*args, **kwargs)
    if not elastic_ep_enabled():
        return result
    min_ranks = min_expert_ranks()
    if min_ranks <= 1:
        return result
    local = kwargs.get("num_local_physical_experts", args[2] if len(args) > 2 else None)
    phy2log, log2phy, _ = result
    num_logical = int(log2phy.shape[1])
    try:
        rows = [spread_replicas(row, int(local), min_ranks, num_logical)
                for row in phy2log.tolist()]
    except PlacementError as exc:
        logger.warning("[elastic-ep] EPLB layout kept as computed: %s", exc)
        return result
    spread = torch.tensor(rows, dtype=phy2log.dtype, device=phy2log.device)
    return (spread, *replica_lists(spread, num_logical, int(log2phy.shape[2])))


def replica_lists(phy2log: torch.Tensor, num_logical: int,
                  width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EPLB's ``logical_to_physical_map`` ([layers, logical, >= width], -1 padded) and
    ``expert_count`` for ``phy2log``."""
    layers = phy2log.shape[0]
    counts = torch.zeros(layers, num_logical, dtype=torch.int64)
    slots: list[list[list[int]]] = [[[] for _ in range(num_logical)] for _ in range(layers)]
    for layer, row in enumerate(phy2log.tolist()):
        for slot, logical in enumerate(row):
            slots[layer][logical].append(slot)
            counts[layer, logical] += 1
    width = max(width, int(counts.max()) if counts.numel() else 1)
    log2phy = torch.full((layers, num_logical, width), -1, dtype=phy2log.dtype)
    for layer in range(layers):
        for logical in range(num_logical):
            found = slots[layer][logical]
            log2phy[layer, logical, :len(found)] = torch.tensor(found, dtype=phy2log.dtype)
    return log2phy.to(phy2log.device), counts.to(phy2log.device)

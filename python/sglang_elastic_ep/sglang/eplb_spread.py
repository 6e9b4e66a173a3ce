"""EPLB layouts that survive rank faults: each expert on at least ``--elastic-ep-expert-min-ranks``
ranks.

EPLB replicates hot experts and keeps one replica of a cold one, wherever the load balance
puts it; when that rank fails, the cold expert has no replica left and its tokens lose it (the
dispatch sends them to ``-1``) until a rebalance places it again. With the flag above 1, every
layout EPLB computes is adjusted (``core.placement.spread_replicas``) so that any
``min_ranks - 1`` failed ranks leave every expert served, and greedy outputs do not change.
A layout computed while a rank is down (between its fault and the survivors letting go of it)
leaves that rank's slots as upstream filled them and spreads over the live ranks only.

Upstream's elasticity-aware algorithm inserts an empty rank into the layout for every inactive
entry of ``active_ranks``, which spans ``--max-ep-size``; past the layout's ranks those entries
are unused capacity, and the map came out wider than the layout (``init_by_mapping`` asserts
and the scheduler dies) at the first rebalance after a rank fault below ``--max-ep-size``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from sglang_elastic_ep.core.placement import PlacementError, spread_replicas
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, elastic_state

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
    local = int(kwargs.get("num_local_physical_experts", args[2] if len(args) > 2 else 0))
    phy2log, log2phy, _ = result
    num_logical = int(log2phy.shape[1])
    live = live_layout_ranks(int(phy2log.shape[1]) // local)
    try:
        rows = [spread_over_ranks(row, live, local, min_ranks, num_logical)
                for row in phy2log.tolist()]
    except PlacementError as exc:
        logger.warning("[elastic-ep] EPLB layout kept as computed: %s", exc)
        return result
    spread = torch.tensor(rows, dtype=phy2log.dtype, device=phy2log.device)
    return (spread, *replica_lists(spread, num_logical, int(log2phy.shape[2])))


def live_layout_ranks(num_ranks: int) -> list[int]:
    """The ranks of a ``num_ranks``-rank layout that are active now (all of them when elastic
    EP has no state yet). A host read of ``active_ranks``: EPLB runs off the hot path."""
    state = elastic_state()
    if state is None or state.active_ranks is None:
        return list(range(num_ranks))
    mask = state.active_ranks.tolist()
    return [r for r in range(num_ranks) if r >= len(mask) or mask[r]]


def spread_over_ranks(row: list[int], ranks: list[int], slots_per_rank: int, min_ranks: int,
                      num_logical: int) -> list[int]:
    """``spread_replicas`` over the slots of ``ranks`` only; the other ranks' slots stay."""
    slots = [r * slots_per_rank + i for r in ranks for i in range(slots_per_rank)]
    spread = spread_replicas([row[s] for s in slots], slots_per_rank, min_ranks, num_logical)
    out = list(row)
    for slot, expert in zip(slots, spread, strict=True):
        out[slot] = expert
    return out


def elasticity_aware_over_layout_ranks(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``eplb_algorithms.elasticity_aware.rebalance_experts``: ``active_ranks`` cut to
    the layout's ``num_gpus`` ranks (module docstring)."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    active, num_gpus = bound.arguments.get("active_ranks"), bound.arguments.get("num_gpus")
    if active is not None and num_gpus is not None and len(active) > int(num_gpus):
        bound.arguments["active_ranks"] = active[: int(num_gpus)]
    return original(*bound.args, **bound.kwargs)


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

"""Experts leave before ranks do: move the weights only the leaving ranks hold (scale-down).

On the agreed pass of a scale-down, before the tail is cut from the expert map, every active
rank (the leaving ones too: they are the sources) plans the same new map with
``core.placement.scale_down_map`` and runs upstream's EPLB weight update on it:
``eplb_manager.update_expert_location_with_recovery`` moves each expert P2P
(``batch_isend_irecv`` over WORLD, Mooncake on CPU) from a rank that holds it into a staying
rank's surplus slot, and loads from the checkpoint (or the DRAM backup) whatever no live rank
could send. Then a WORLD barrier, as upstream does after a post-scale rebalance: P2P waits
only synchronize the ranks that moved something, and every rank must have installed the new
map before the next dispatch. ``finalize_scale_down`` then cuts the leaving ranks' slots off a
map in which the staying ranks hold every expert.

The move runs inside the commit pass (serving pauses for it on every rank, as for an EPLB
rebalance). Each staying rank keeps its number of physical slots, so layouts stay valid.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.core.placement import PlacementError, scale_down_map, size_refusal
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import expert_location_metadata

logger = get_logger(__name__)


def planned_map(old_ep_size: int, new_ep_size: int) -> tuple[Any, list[list[int]]] | None:
    """(current metadata, map after the moves) or None without expert location metadata.
    Raises ``PlacementError`` when the staying ranks cannot hold every expert."""
    metadata = expert_location_metadata()
    if metadata is None:
        return None
    rows = metadata.physical_to_logical_map.tolist()
    return metadata, scale_down_map(rows, old_ep_size, new_ep_size, metadata.num_logical_experts)


def shrink_refusal(old_ep_size: int, new_ep_size: int) -> str | None:
    """Why the staying ranks cannot take every expert (a 422 for the request), else None."""
    metadata = expert_location_metadata()
    if metadata is not None:
        too_few = size_refusal(int(metadata.num_logical_experts),
                               int(metadata.num_local_physical_experts), new_ep_size)
        if too_few is not None:
            return f"cannot shrink from {old_ep_size} to {new_ep_size} ranks: {too_few}"
    try:
        planned_map(old_ep_size, new_ep_size)
    except PlacementError as exc:
        return (f"cannot shrink from {old_ep_size} to {new_ep_size} ranks: {exc}. Each rank "
                "keeps its number of expert slots; launch with more "
                "--ep-num-redundant-experts to shrink further")
    return None


def move_experts_off_leaving_ranks(runner: Any, old_ep_size: int, new_ep_size: int) -> int:
    """Every active rank, on the agreed pass: the number of physical slots whose expert
    changed (0: the staying ranks already held every expert, nothing moved)."""
    planned = planned_map(old_ep_size, new_ep_size)
    if planned is None:
        return 0
    metadata, new_rows = planned
    old_rows = metadata.physical_to_logical_map.tolist()
    changed = sum(a != b for old, new in zip(old_rows, new_rows, strict=True)
                  for a, b in zip(old, new, strict=True))
    if not changed:
        return 0
    from sglang.srt.eplb.eplb_manager import update_expert_location_with_recovery
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang.srt.runtime_context import get_exec

    started = time.monotonic()
    rank = runner._elastic_global_rank()
    target = ExpertLocationMetadata.init_by_mapping(
        runner.model_config,
        physical_to_logical_map=torch.tensor(new_rows,
                                             dtype=metadata.physical_to_logical_map.dtype),
        moe_ep_rank=rank,
    )
    layer_ids = sorted(runner.model.routed_experts_weights_of_layer.keys())
    update_expert_location_with_recovery(
        expert_location_updater=runner.expert_location_updater,
        model=runner.model,
        new_expert_location_metadata=target,
        update_layer_ids=layer_ids,
        tp_rank=rank,
        use_flat_topology=True,  # the expanded world has no launch-time node layout
        expert_backup_client=getattr(runner, "expert_backup_client", None),
        update_weights_from_disk_callable=runner.weight_updater.update_weights_from_disk,
        ep_dispatch_algorithm=get_exec().moe.ep_dispatch_algorithm,
        init_lplb_solvers_callable=lambda: _init_lplb_solvers(runner),
    )
    dist.barrier(group=dist.group.WORLD)
    logger.info("[elastic-ep] rank %d: moved experts into %d slots of ranks 0..%d before ranks "
                "%d..%d leave (%.3f s)", rank, changed, new_ep_size - 1, new_ep_size,
                old_ep_size - 1, time.monotonic() - started)
    return changed


def _init_lplb_solvers(runner: Any) -> None:
    from sglang.srt.model_executor.model_runner_components.moe_ep_setup import init_lplb_solvers

    init_lplb_solvers(model_config=runner.model_config)

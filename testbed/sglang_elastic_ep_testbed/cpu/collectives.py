"""Collectives SGLang's DP-attention path reaches that assume a CUDA communicator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reduce_scatterv(
    original: Callable,
    group: Any,
    input_: torch.Tensor,
    output: torch.Tensor | None = None,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    """AROUND ``GroupCoordinator.reduce_scatterv``: on CPU tensors, all-reduce then keep this
    rank's slice (upstream goes through pynccl, which does not exist on CPU)."""
    if input_.device.type != "cpu":
        return original(group, input_, output, sizes)
    world = group.world_size
    if sizes is None:
        if input_.shape[0] % world:
            raise ValueError(f"reduce_scatterv: {input_.shape[0]} rows do not split over {world}")
        sizes = [input_.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != input_.shape[0]:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not cover {input_.shape[0]} rows")
    reduced = group.all_reduce(input_.clone())
    start = sum(sizes[: group.rank_in_group])
    mine = reduced[start : start + sizes[group.rank_in_group]]
    if output is None:
        return mine.clone()
    output.copy_(mine)
    return output


def exchange_sync_rows(original: Callable, global_flat: torch.Tensor, local_row: torch.Tensor,
                       group: Any) -> None:
    """AROUND ``dp_attn.exchange_sync_rows``: on a Mooncake group, one all-gather, as on a GPU.

    Upstream exchanges CPU rows of more than two ranks as a gather to rank 0 and rank 0's
    broadcast (fewer serial hops than gloo's ring). On Mooncake that is two collectives per
    pass, and a peer's death can leave the survivors in different ones: a rank that has its
    broadcast moves on to the next gather while the root still waits in the broadcast, and the
    survivors then counted the pass's collectives differently (both waited in the next gather
    for good)."""
    import torch.distributed as dist
    from sglang.srt.distributed.utils import all_gather_single

    if local_row.device.type == "cpu" and str(dist.get_backend(group)).startswith("mooncake"):
        all_gather_single(global_flat, local_row, group=group)
        return None
    return original(global_flat, local_row, group)

"""Dispatch of :func:`select_physical_experts`: the Triton kernel on CUDA tensors, the torch
reference (``expert_select_reference``, which states the selection rule) elsewhere."""

from __future__ import annotations

import torch

from .expert_select_reference import select_physical_experts_reference


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def select_physical_experts(
    topk_ids: torch.Tensor,
    replica_table: torch.Tensor,
    replica_counts: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    flag_out: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick live physical replicas: the Triton kernel on CUDA, the torch reference elsewhere.

    Args:
        topk_ids: ``[T, K]`` int32/int64 logical expert ids, ``-1`` = no expert.
        replica_table: ``[L, R_max]`` physical slot ids per logical expert, padded with ``-1``.
        replica_counts: ``[L]`` valid entries per row of ``replica_table``.
        slot_to_rank: ``[P]`` EP rank of each physical slot.
        active_mask: ``[max_ranks]`` int32 or bool, nonzero = rank active. May change in place
            between CUDA-graph replays.
        out, flag_out: optional preallocated outputs (``[T, K]`` of ``topk_ids``' dtype and
            ``[T]`` bool), for CUDA graphs.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``.

    Returns:
        ``(physical_ids [T, K], flag [T] bool)``.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {backend!r}")
    use_triton = backend == "triton" or (
        backend == "auto" and topk_ids.is_cuda and triton_available()
    )
    if use_triton:
        from ._expert_select_triton import select_physical_experts_triton

        return select_physical_experts_triton(
            topk_ids,
            replica_table,
            replica_counts,
            slot_to_rank,
            active_mask,
            out=out,
            flag_out=flag_out,
        )
    phys, flag = select_physical_experts_reference(
        topk_ids, replica_table, replica_counts, slot_to_rank, active_mask
    )
    if out is not None:
        out.copy_(phys)
        phys = out
    if flag_out is not None:
        flag_out.copy_(flag)
        flag = flag_out
    return phys, flag


def build_replica_table(
    logical_to_physical: list[list[int]], *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[[slots of expert 0], [slots of expert 1], ...]`` -> ``(table [L, R_max], counts [L])``.

    A helper for tests and for converting EPLB metadata (``logical_to_all_physical_map`` is
    already in this padded form; its ``_num_valid`` is the counts).
    """
    r_max = max((len(s) for s in logical_to_physical), default=0)
    table = torch.full((len(logical_to_physical), r_max), -1, dtype=torch.int32)
    counts = torch.zeros(len(logical_to_physical), dtype=torch.int32)
    for i, slots in enumerate(logical_to_physical):
        counts[i] = len(slots)
        if slots:
            table[i, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return table.to(device), counts.to(device)

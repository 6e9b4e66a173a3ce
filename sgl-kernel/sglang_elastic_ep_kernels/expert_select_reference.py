"""Mask-aware logical -> physical expert selection.

Each logical expert has replicas (physical slots) spread over EP ranks. After a rank fails or is
being removed, its replicas must not receive tokens. For every ``(token, k)`` this picks one
replica that lives on an active rank, deterministically, and flags tokens for which some chosen
logical expert has no live replica at all.

Rule (the same in the Triton kernel and the torch reference, bit for bit):

* ``e = topk_ids[t, k]``; ``e < 0`` (no expert) or ``e >= L`` gives ``-1`` and no flag.
* The live replicas of ``e`` are the entries ``replica_table[e, j]`` with
  ``j < min(replica_counts[e], R_max)``, a slot in ``[0, P)``, whose rank
  ``slot_to_rank[slot]`` is in ``[0, max_ranks)`` with ``active_mask[rank] != 0``; taken in
  table order.
* With ``n`` live replicas, the pick is live replica number ``mix(t, k) % n``, where ``mix`` is a
  fixed 32-bit integer hash of the token index and the top-k position (so all ranks agree, and
  the load spreads evenly over the live replicas).
* ``n == 0`` gives ``-1`` and sets ``flag[t]``.

Everything stays on the device: no host sync, so the selection can be captured in a CUDA graph
and the mask changed in place between replays.
"""

from __future__ import annotations

import torch

# Constants of the token/position hash (shared with the Triton kernel).
HASH_T = 0x9E3779B1
HASH_K = 0x7FEB352D
HASH_SEED = 0x165667B1
HASH_M1 = 0x2C1B3C6D
HASH_M2 = 0x297A2D39
MASK32 = 0xFFFFFFFF


def token_hash(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The 32-bit mix of token index ``t`` and top-k position ``k`` (int64 tensors, broadcast).

    All intermediate products stay below 2**63 for ``t < 2**31``, so int64 arithmetic is exact
    on every backend.
    """
    h = (t * HASH_T + k * HASH_K + HASH_SEED) & MASK32
    h = h ^ (h >> 15)
    h = (h * HASH_M1) & MASK32
    h = h ^ (h >> 12)
    h = (h * HASH_M2) & MASK32
    h = h ^ (h >> 15)
    return h


def check_inputs(
    topk_ids: torch.Tensor,
    replica_table: torch.Tensor,
    replica_counts: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if replica_table.dim() != 2:
        raise ValueError(f"replica_table must be [L, R], got {tuple(replica_table.shape)}")
    if replica_counts.dim() != 1 or replica_counts.shape[0] != replica_table.shape[0]:
        raise ValueError(
            f"replica_counts must be [L={replica_table.shape[0]}], got "
            f"{tuple(replica_counts.shape)}"
        )
    if slot_to_rank.dim() != 1 or active_mask.dim() != 1:
        raise ValueError("slot_to_rank and active_mask must be 1-D")
    for name, t in (
        ("topk_ids", topk_ids),
        ("replica_table", replica_table),
        ("replica_counts", replica_counts),
        ("slot_to_rank", slot_to_rank),
    ):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    devices = {
        t.device for t in (topk_ids, replica_table, replica_counts, slot_to_rank, active_mask)
    }
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if topk_ids.shape[0] >= 2**31:
        raise ValueError("at most 2**31 - 1 tokens")


def select_physical_experts_reference(
    topk_ids: torch.Tensor,
    replica_table: torch.Tensor,
    replica_counts: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation (and the CPU path). Returns ``(physical_ids [T, K], flag [T] bool)``.

    ``physical_ids`` has ``topk_ids``' dtype. Runs on any device without host syncs.
    """
    check_inputs(topk_ids, replica_table, replica_counts, slot_to_rank, active_mask)
    device = topk_ids.device
    num_tokens, top_k = topk_ids.shape
    num_logical, r_max = replica_table.shape
    num_slots = slot_to_rank.shape[0]
    num_ranks = active_mask.shape[0]

    ids = topk_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < num_logical)
    if num_logical == 0 or r_max == 0 or num_slots == 0 or num_ranks == 0:
        phys = torch.full_like(topk_ids, -1)
        return phys, valid.any(dim=1)

    e = torch.where(valid, ids, torch.zeros_like(ids))
    rows = replica_table.to(torch.int64)[e]  # [T, K, R]
    cnt = replica_counts.to(torch.int64)[e].clamp(min=0, max=r_max)  # [T, K]
    j = torch.arange(r_max, device=device, dtype=torch.int64)
    in_count = j.view(1, 1, r_max) < cnt.unsqueeze(-1)
    slot_ok = (rows >= 0) & (rows < num_slots)
    slot = torch.where(slot_ok, rows, torch.zeros_like(rows))
    rank = slot_to_rank.to(torch.int64)[slot]
    rank_ok = slot_ok & (rank >= 0) & (rank < num_ranks)
    rank_safe = torch.where(rank_ok, rank, torch.zeros_like(rank))
    alive = active_mask[rank_safe] != 0
    live = in_count & rank_ok & alive & valid.unsqueeze(-1)

    n_live = live.sum(dim=-1)  # [T, K]
    t_idx = torch.arange(num_tokens, device=device, dtype=torch.int64).view(-1, 1)
    k_idx = torch.arange(top_k, device=device, dtype=torch.int64).view(1, -1)
    choice = token_hash(t_idx, k_idx) % n_live.clamp(min=1)
    seen = torch.cumsum(live.to(torch.int64), dim=-1) - live.to(torch.int64)
    take = live & (seen == choice.unsqueeze(-1))
    picked = torch.where(take, rows, torch.zeros_like(rows)).sum(dim=-1)
    has_live = n_live > 0
    phys = torch.where(valid & has_live, picked, torch.full_like(picked, -1))
    flag = (valid & ~has_live).any(dim=1)
    return phys.to(topk_ids.dtype), flag

"""Triton kernel for :func:`sglang_elastic_ep_kernels.select_physical_experts`.

One program handles ``BLOCK_T`` tokens x all ``K`` top-k positions (padded to a power of two), so
the per-token flag is a reduction inside the program. Programs are small (16-32 tokens): the
work per element is a chain of dependent gathers, so many programs in flight hide more latency.
The replica loop is unrolled over ``R_max`` (a compile-time constant; EPLB tables have a handful
of replicas per expert): a first pass counts the live replicas, a second takes live replica
number ``hash % count``. The small tables (replicas, slot -> rank, mask) stay in L1/L2; the
traffic is the top-k ids in and the physical ids and flags out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expert_select_reference import (
    HASH_K,
    HASH_M1,
    HASH_M2,
    HASH_SEED,
    HASH_T,
    check_inputs,
    select_physical_experts_reference,
)

_HASH_T = tl.constexpr(HASH_T)
_HASH_K = tl.constexpr(HASH_K)
_HASH_SEED = tl.constexpr(HASH_SEED)
_HASH_M1 = tl.constexpr(HASH_M1)
_HASH_M2 = tl.constexpr(HASH_M2)


@triton.jit
def _token_hash(t, k):
    # uint32 arithmetic wraps mod 2**32: the same low 32 bits as the reference's masked int64.
    h = t.to(tl.uint32) * _HASH_T + k.to(tl.uint32) * _HASH_K + _HASH_SEED
    h = h ^ (h >> 15)
    h = h * _HASH_M1
    h = h ^ (h >> 12)
    h = h * _HASH_M2
    h = h ^ (h >> 15)
    return h.to(tl.int64)


@triton.jit
def _live_slot(
    table_ptr,
    slot_rank_ptr,
    mask_ptr,
    e,
    valid,
    cnt,
    j,
    stride_tl,
    stride_tr,
    P,
    M,
):
    in_row = valid & (cnt > j)
    slot = tl.load(table_ptr + e * stride_tl + j * stride_tr, mask=in_row, other=-1).to(tl.int64)
    slot_ok = in_row & (slot >= 0) & (slot < P)
    rank = tl.load(slot_rank_ptr + tl.where(slot_ok, slot, 0), mask=slot_ok, other=-1)
    rank = rank.to(tl.int64)
    rank_ok = slot_ok & (rank >= 0) & (rank < M)
    alive = tl.load(mask_ptr + tl.where(rank_ok, rank, 0), mask=rank_ok, other=0)
    live = rank_ok & (alive != 0)
    return slot, live


@triton.jit
def _select_kernel(
    topk_ptr,
    table_ptr,
    counts_ptr,
    slot_rank_ptr,
    mask_ptr,
    out_ptr,
    flag_ptr,
    T,
    L,
    P,
    M,
    stride_tt,
    stride_tk,
    stride_tl,
    stride_tr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    kk = tl.arange(0, K_PAD).to(tl.int64)
    t_ok = t < T
    m2 = t_ok[:, None] & (kk < K)[None, :]

    e = tl.load(topk_ptr + t[:, None] * stride_tt + kk[None, :] * stride_tk, mask=m2, other=-1)
    e = e.to(tl.int64)
    valid = m2 & (e >= 0) & (e < L)
    e = tl.where(valid, e, 0)
    cnt = tl.load(counts_ptr + e, mask=valid, other=0).to(tl.int64)
    cnt = tl.minimum(cnt, R)

    n_live = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    for j in tl.static_range(R):
        _, live = _live_slot(
            table_ptr, slot_rank_ptr, mask_ptr, e, valid, cnt, j, stride_tl, stride_tr, P, M
        )
        n_live += live.to(tl.int64)

    choice = _token_hash(t[:, None], kk[None, :]) % tl.maximum(n_live, 1)
    seen = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int64)
    phys = tl.full([BLOCK_T, K_PAD], -1, dtype=tl.int64)
    for j in tl.static_range(R):
        slot, live = _live_slot(
            table_ptr, slot_rank_ptr, mask_ptr, e, valid, cnt, j, stride_tl, stride_tr, P, M
        )
        phys = tl.where(live & (seen == choice), slot, phys)
        seen += live.to(tl.int64)

    has_live = n_live > 0
    phys = tl.where(valid & has_live, phys, -1)
    tl.store(out_ptr + t[:, None] * K + kk[None, :], phys.to(out_ptr.dtype.element_ty), mask=m2)
    dead = (valid & (n_live == 0)).to(tl.int32)
    flag = tl.max(dead, axis=1)
    tl.store(flag_ptr + t, flag.to(tl.uint8), mask=t_ok)


def select_physical_experts_triton(
    topk_ids: torch.Tensor,
    replica_table: torch.Tensor,
    replica_counts: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    flag_out: torch.Tensor | None = None,
    block_t: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel. Host side reads only shapes, never values: graph-capturable.

    ``block_t`` (tokens per program, a power of two) and ``num_warps`` are tuning knobs for the
    benchmark's sweep; the defaults come from it.
    """
    check_inputs(topk_ids, replica_table, replica_counts, slot_to_rank, active_mask)
    num_tokens, top_k = topk_ids.shape
    num_logical, r_max = replica_table.shape
    if out is None:
        out = torch.empty((num_tokens, top_k), dtype=topk_ids.dtype, device=topk_ids.device)
    elif out.shape != topk_ids.shape or out.dtype != topk_ids.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor shaped and typed like topk_ids")
    if flag_out is None:
        flag_out = torch.empty((num_tokens,), dtype=torch.bool, device=topk_ids.device)
    elif flag_out.shape != (num_tokens,) or flag_out.dtype != torch.bool:
        raise ValueError("flag_out must be a bool tensor of shape [T]")
    if num_tokens == 0:
        return out, flag_out
    if top_k == 0 or r_max == 0 or num_logical == 0:
        phys, flag = select_physical_experts_reference(
            topk_ids, replica_table, replica_counts, slot_to_rank, active_mask
        )
        out.copy_(phys)
        flag_out.copy_(flag)
        return out, flag_out

    mask = active_mask.view(torch.uint8) if active_mask.dtype == torch.bool else active_mask
    k_pad = triton.next_power_of_2(top_k)
    if block_t is None:
        # From the sweep on an H100 (benchmark --sweep, K=8): small programs win because the
        # kernel is bound by its chain of dependent gathers (ids -> replicas -> ranks -> mask),
        # not by bandwidth: 16 tokens/program up to ~16k tokens, 32 beyond.
        block_t = max(1, (128 if num_tokens <= 16384 else 256) // k_pad)
    grid = (triton.cdiv(num_tokens, block_t),)
    _select_kernel[grid](
        topk_ids,
        replica_table,
        replica_counts,
        slot_to_rank,
        mask,
        out,
        flag_out.view(torch.uint8),
        num_tokens,
        num_logical,
        slot_to_rank.shape[0],
        active_mask.shape[0],
        topk_ids.stride(0),
        topk_ids.stride(1),
        replica_table.stride(0),
        replica_table.stride(1),
        K=top_k,
        K_PAD=k_pad,
        R=r_max,
        BLOCK_T=block_t,
        num_warps=num_warps,
    )
    return out, flag_out

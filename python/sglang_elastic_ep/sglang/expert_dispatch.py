"""Mask-aware expert-location dispatch for elastic EP (SGLang 0.5.23 adapter).

AROUND hook on ``sglang.srt.eplb.expert_location_dispatch.topk_ids_logical_to_physical``, which
maps every token's top-k *logical* experts to *physical* slots (``static``: this rank's table;
``dynamic``/``fake``: one replica per token; ``lp``: sampled). Upstream does not look at which
EP ranks are alive, so until EPLB has moved the experts away (a rebalance after the fault, a
drain before a scale-down) tokens keep going to a dead rank's slots. With elastic EP on:

1. upstream's pick is computed exactly as upstream computes it;
2. where that pick is a slot whose rank is inactive in ``ElasticEPState.active_ranks`` (the
   device mask that NIXL/Mooncake update in place after each combine), it is replaced by
   :func:`sglang_elastic_ep_kernels.select_physical_experts`'s pick among the logical expert's
   replicas on active ranks (same replica list upstream uses,
   ``partial_logical_to_all_physical_map``; an even, rank-independent spread);
3. where the logical expert has **no** replica on an active rank, the physical id is ``-1``:
   the same "no expert" value upstream writes into padded rows. The dispatchers (DeepEP, NIXL,
   Mooncake) and the native MoE skip ``-1``, so that expert contributes nothing to the token;
   the token's other experts still do, with their router weights as they were (no
   renormalisation). Such drops are counted on the device (:func:`dropped_expert_assignments`)
   and the plugin logs which (layer, expert) pairs lost every replica at each membership event
   (:func:`log_replica_coverage`). Never an out-of-range index.

Entries whose logical id is negative (padding) keep upstream's value, and where upstream's pick
is live it is kept: with every rank active the result equals upstream's bit for bit (static
keeps its locality, lp its sampling). The mask is read on the device when the kernels run: the
very next forward (even the next MoE layer) after a fault routes around it, no host sync, and a
captured CUDA graph follows mask changes without recapture.

Caveats: with no dispatch info (``--ep-dispatch-algorithm`` unset, trivial layout) upstream
returns the logical ids unchanged and so does this hook: one replica per expert, nothing to move
to, and the a2a backend's own mask drops the dead rank's share. SGLang collapses the replica
list to one "nearest" replica per rank for metadata built by ``init_by_mapping`` with an a2a
backend (the initial layout); on several nodes that may be a same-node replica, and if its rank
dies the expert counts as lost (``-1``) until the EPLB rebalance that the same fault triggers
installs full replica lists.

Without elastic EP (``--elastic-ep-backend`` unset) the hook returns upstream's result and
does nothing else. SGLang is imported lazily, so the tensor logic imports and runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_elastic_ep.sglang import expert_health
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import (
    attached_state,
    elastic_ep_enabled,
    elastic_state,
    expert_location_metadata,
)
from sglang_elastic_ep_kernels import select_physical_experts

try:  # Triton: the fused repair step on CUDA; the torch version runs everywhere else.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

logger = get_logger(__name__)


# ------------------------------------------------------------------------------- the hook


def topk_ids_logical_to_physical(original_fn: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """AROUND ``expert_location_dispatch.topk_ids_logical_to_physical``.

    Elastic EP off: exactly ``original_fn(*args, **kwargs)``. On: upstream's pick, with picks on
    inactive ranks moved to live replicas (``-1`` where none is left).
    """
    if not elastic_ep_enabled():
        return original_fn(*args, **kwargs)
    physical = original_fn(*args, **kwargs)
    topk_ids = args[0] if args else kwargs["topk_ids"]
    info = args[1] if len(args) > 1 else kwargs.get("info")
    if info is None:
        return physical
    return _route_live(topk_ids, physical, info)


@torch.compiler.disable
def _route_live(topk_ids: torch.Tensor, physical: torch.Tensor, info: Any) -> torch.Tensor:
    # Kept out of torch.compile (upstream calls the dispatch from a compiled function): a graph
    # break here, the kernels launch as they are. Host reads: shapes and Python ints only.
    state = elastic_state()
    if state is None or state.active_ranks is None or topk_ids.numel() == 0:
        return physical
    caches = dispatch_caches(state)
    metadata = expert_location_metadata()
    if metadata is None:
        caches.warn_once("no-metadata",
                         "elastic EP dispatch: no expert location metadata; unchanged")
        return physical
    device = topk_ids.device
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    table = info.partial_logical_to_all_physical_map
    counts = info.partial_logical_to_all_physical_map_num_valid
    full = caches.full_replicas(metadata, getattr(info, ELASTIC_LAYER_ATTR, None), device,
                                capturing)
    if full is not None:  # every replica, not only this rank's nearest one
        table, counts = full
    width = _replica_width(table, info.num_physical_experts)
    slot_to_rank = caches.slot_to_rank(
        info.num_physical_experts, metadata.num_local_physical_experts, device, capturing
    )
    health = expert_health.expert_health_state(state)
    routed = route_around_inactive_ranks(
        topk_ids,
        physical,
        table[:, :width],
        counts,
        slot_to_rank,
        health.routable_ranks(state.active_ranks),  # slow ranks blocked like dead ones
        dropped_counter=caches.dropped_counter(device, capturing),
    )
    if health.blocked_mask:
        # A blocked rank is slow, not dead: where its expert has no replica elsewhere, keep
        # the pick (slow beats dropped). Only while ranks are blocked; never on GPUs today.
        live = route_around_inactive_ranks(
            topk_ids, physical, table[:, :width], counts, slot_to_rank, state.active_ranks
        )
        routed = torch.where((routed < 0) & (live >= 0), live, routed)
    return routed


ELASTIC_LAYER_ATTR = "elastic_ep_layer_id"


def dispatch_info_with_layer(
    original_fn: Any, cls: Any, layer_id: int, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``ExpertLocationDispatchInfo.init_new``: remember the layer, so the repair step
    can use the layer's full replica list (upstream's list is collapsed to this rank's nearest
    replica with an a2a backend; a dead or blocked rank's replica then has no alternative)."""
    info = original_fn(cls, layer_id, *args, **kwargs)
    if info is not None and elastic_ep_enabled():
        setattr(info, ELASTIC_LAYER_ATTR, int(layer_id))
    return info


def full_replica_table(
    physical_to_logical: torch.Tensor, num_logical: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, logical, R]`` physical replicas of each logical expert (-1 padded, in slot
    order) and ``[layers, logical]`` counts, from the ``[layers, physical]`` map.

    With ``num_logical`` given, ``R`` is ``physical - logical + 1`` (the most replicas any
    layout can give one expert), so a rebalance of the same shape can be copied in place.
    """
    p2l = physical_to_logical.to("cpu", torch.int64)
    layers, num_physical = p2l.shape
    if num_logical is None:
        num_logical = int(p2l.max().item()) + 1 if p2l.numel() else 0
    replicas = [[[] for _ in range(num_logical)] for _ in range(layers)]
    for layer in range(layers):
        for slot, logical in enumerate(p2l[layer].tolist()):
            if 0 <= logical < num_logical:
                replicas[layer][logical].append(slot)
    width = max((len(r) for row in replicas for r in row), default=1)
    if num_logical:
        width = max(width, num_physical - num_logical + 1)
    table = torch.full((layers, num_logical, width), -1, dtype=torch.int64)
    counts = torch.zeros((layers, num_logical), dtype=torch.int64)
    for layer, row in enumerate(replicas):
        for logical, slots in enumerate(row):
            counts[layer, logical] = len(slots)
            if slots:
                table[layer, logical, : len(slots)] = torch.tensor(slots)
    return table, counts


def refresh_replica_tables(updated: Any) -> None:
    """After an EPLB rebalance rewrote the metadata ``updated`` in place: the replica tables
    built from it are rebuilt (:meth:`DispatchCaches.refresh`)."""
    state = elastic_state()
    if state is not None:
        dispatch_caches(state).refresh(updated)


# ------------------------------------------------------------------- tensor logic (no SGLang)


def route_around_inactive_ranks(
    topk_ids: torch.Tensor,
    physical: torch.Tensor,
    replica_table: torch.Tensor,
    replica_counts: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
    *,
    dropped_counter: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Keep ``physical[i]`` where its rank is active, else a live replica of ``topk_ids[i]``.

    ``topk_ids``/``physical``: logical ids and upstream's physical pick, same shape (``[..., K]``).
    ``replica_table [L, R]``/``replica_counts [L]``: replicas of each logical expert;
    ``slot_to_rank [P]``; ``active_mask [M]`` (nonzero = active, read on the device).
    Entries with ``topk_ids < 0`` or ``>= L`` keep ``physical``. A valid entry whose pick is dead
    and whose expert has no live replica becomes ``-1`` and adds one to ``dropped_counter``
    (int64 ``[1]``, on the device). No host sync; CUDA-graph capturable.
    """
    if topk_ids.numel() == 0:
        return physical
    k = topk_ids.shape[-1] if topk_ids.dim() >= 2 else 1
    ids = topk_ids.reshape(-1, k)
    if active_mask.device != ids.device:
        active_mask = active_mask.to(ids.device, non_blocking=True)
    live_pick, _ = select_physical_experts(
        ids, replica_table, replica_counts, slot_to_rank, active_mask, backend=backend
    )
    use_triton = backend != "torch" and ids.is_cuda and triton is not None
    repair = _repair_triton if use_triton else _repair_torch
    out = repair(
        ids, physical.reshape(-1, k), live_pick, slot_to_rank, active_mask,
        replica_table.shape[0], dropped_counter,
    )
    return out.view(physical.shape)


def _repair_torch(
    ids: torch.Tensor,
    phys: torch.Tensor,
    live_pick: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
    num_logical: int,
    dropped_counter: torch.Tensor | None,
) -> torch.Tensor:
    num_slots, num_ranks = slot_to_rank.shape[0], active_mask.shape[0]
    p = phys.to(torch.int64)
    valid = (ids >= 0) & (ids < num_logical)
    if num_slots == 0 or num_ranks == 0:
        alive = torch.zeros_like(valid)
    else:
        in_range = (p >= 0) & (p < num_slots)
        rank = slot_to_rank.to(torch.int64)[p.clamp(0, num_slots - 1)]
        rank_ok = in_range & (rank >= 0) & (rank < num_ranks)
        alive = rank_ok & (active_mask[rank.clamp(0, num_ranks - 1)] != 0)
    replace = valid & ~alive
    out = torch.where(replace, live_pick.to(phys.dtype), phys)
    if dropped_counter is not None:
        dropped_counter.add_((replace & (live_pick < 0)).sum())
    return out


if triton is not None:

    @triton.jit
    def _repair_kernel(
        ids_ptr,
        phys_ptr,
        live_ptr,
        slot_rank_ptr,
        mask_ptr,
        out_ptr,
        counter_ptr,
        N,
        K,
        stride_it,
        stride_ik,
        stride_pt,
        stride_pk,
        L,
        P,
        M,
        HAS_COUNTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        ok = offs < N
        t = offs // K
        kk = offs % K
        e = tl.load(ids_ptr + t * stride_it + kk * stride_ik, mask=ok, other=-1).to(tl.int64)
        p = tl.load(phys_ptr + t * stride_pt + kk * stride_pk, mask=ok, other=-1).to(tl.int64)
        live = tl.load(live_ptr + offs, mask=ok, other=-1).to(tl.int64)
        in_range = ok & (p >= 0) & (p < P)
        rank = tl.load(slot_rank_ptr + tl.where(in_range, p, 0), mask=in_range, other=-1)
        rank = rank.to(tl.int64)
        rank_ok = in_range & (rank >= 0) & (rank < M)
        flag = tl.load(mask_ptr + tl.where(rank_ok, rank, 0), mask=rank_ok, other=0)
        alive = rank_ok & (flag != 0)
        replace = ok & (e >= 0) & (e < L) & (alive == 0)
        out = tl.where(replace, live, p)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=ok)
        if HAS_COUNTER:
            dropped = tl.sum((replace & (live < 0)).to(tl.int64), axis=0)
            tl.atomic_add(counter_ptr, dropped)


def _repair_triton(
    ids: torch.Tensor,
    phys: torch.Tensor,
    live_pick: torch.Tensor,
    slot_to_rank: torch.Tensor,
    active_mask: torch.Tensor,
    num_logical: int,
    dropped_counter: torch.Tensor | None,
) -> torch.Tensor:
    """One launch: alive check of upstream's pick, the choice, and the drop count."""
    num_tokens, k = ids.shape
    out = torch.empty((num_tokens, k), dtype=phys.dtype, device=phys.device)
    n = num_tokens * k
    mask = active_mask.view(torch.uint8) if active_mask.dtype == torch.bool else active_mask
    block = 1024
    _repair_kernel[(triton.cdiv(n, block),)](
        ids,
        phys,
        live_pick.contiguous(),
        slot_to_rank,
        mask,
        out,
        dropped_counter if dropped_counter is not None else out,
        n,
        k,
        ids.stride(0),
        ids.stride(1),
        phys.stride(0),
        phys.stride(1),
        num_logical,
        slot_to_rank.shape[0],
        active_mask.shape[0],
        HAS_COUNTER=dropped_counter is not None,
        BLOCK=block,
    )
    return out


# -------------------------------------------------------------------- per-process caches


@dataclass
class DispatchCaches:
    """The hook's tables and drop counters, one set per process, kept on upstream's elastic
    state. Tensors made outside a CUDA-graph capture and reused by every later call, so a
    captured graph reads the same memory the eager passes update."""

    # (physical slots, slots per rank, device) -> EP rank of each slot
    slot_to_rank_tables: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)
    # device -> (the metadata it was built from, table, counts); the reference keeps the
    # metadata alive, so a new metadata can never reuse the old one's id. EPLB rewrites a
    # metadata in place (``ExpertLocationMetadata.update``): :meth:`refresh` follows it.
    replica_tables: dict[str, tuple[Any, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)
    dropped_counters: dict[str, torch.Tensor] = field(default_factory=dict)  # device -> [1]
    warned: set[str] = field(default_factory=set)

    def slot_to_rank(self, num_physical: int, num_local: int, device: torch.device,
                     capturing: bool) -> torch.Tensor:
        """EP rank of each physical slot in SGLang's layout: ``slot // num_local``."""
        key = (num_physical, num_local, str(device))
        cached = self.slot_to_rank_tables.get(key)
        if cached is not None:
            return cached
        table = torch.div(
            torch.arange(num_physical, dtype=torch.int32, device=device),
            max(num_local, 1),
            rounding_mode="floor",
        )
        if not capturing:  # made inside a capture it would only be filled by the replays
            self.slot_to_rank_tables[key] = table
        return table

    def full_replicas(self, metadata: Any, layer: int | None, device: torch.device,
                      capturing: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s full replica table and counts (:func:`full_replica_table`) on
        ``device``; None without a layer, inside a capture before the first eager pass, or for
        a layer past the metadata's."""
        if layer is None:
            return None
        key = str(device)
        cached = self.replica_tables.get(key)
        if cached is None or cached[0] is not metadata:
            if capturing:
                return None  # built outside capture on the first eager pass
            table, counts = full_replica_table(
                metadata.physical_to_logical_map, int(metadata.num_logical_experts)
            )
            cached = (metadata, table.to(device), counts.to(device))
            self.replica_tables[key] = cached
        _, table, counts = cached
        if layer >= table.shape[0]:
            return None
        return table[layer], counts[layer]

    def refresh(self, updated: Any) -> None:
        """The tables built from ``updated`` (rewritten in place by EPLB) are rebuilt, copied
        into the same tensors when the shapes match, so a captured CUDA graph reads the new
        layout without recapture."""
        for key, (metadata, table, counts) in list(self.replica_tables.items()):
            if metadata is not updated:
                continue
            new_table, new_counts = full_replica_table(
                updated.physical_to_logical_map, int(updated.num_logical_experts)
            )
            if new_table.shape == table.shape and new_counts.shape == counts.shape:
                table.copy_(new_table)
                counts.copy_(new_counts)
            else:
                self.replica_tables[key] = (updated, new_table.to(table.device),
                                            new_counts.to(counts.device))

    def dropped_counter(self, device: torch.device, capturing: bool) -> torch.Tensor | None:
        key = str(device)
        counter = self.dropped_counters.get(key)
        if counter is None and not capturing:
            counter = torch.zeros(1, dtype=torch.int64, device=device)
            self.dropped_counters[key] = counter
        return counter

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message)


_CACHES_ATTR = "_elastic_ep_dispatch_caches"


def dispatch_caches(state: Any) -> DispatchCaches:
    """This process's :class:`DispatchCaches`, kept on upstream's elastic state."""
    return attached_state(state, _CACHES_ATTR, DispatchCaches)


def _replica_width(table: torch.Tensor, num_physical: int) -> int:
    """How many columns of SGLang's replica table (``[L, P]``, ``-1``-padded) the kernel reads.

    ``P - L + 1``: the most replicas any layout can give one expert, since every logical expert
    keeps a slot. It depends on shapes only, so it is the same in eager warm-up and in CUDA-graph
    capture (no Triton compile inside a capture) and stays valid after any EPLB update of a
    captured graph's tables. Columns past an expert's count are masked, not read.
    """
    num_logical, x = table.shape
    return max(1, min(x, num_physical - num_logical + 1))


def dropped_expert_assignments() -> int:
    """(token, expert, layer) assignments sent to ``-1`` because the expert had no live replica.

    Reads the device counters: a host sync. For metrics and tests, not for the forward path.
    Counts padded rows of CUDA-graph batches too (upstream masks them after the dispatch).
    """
    state = elastic_state()
    if state is None:
        return 0
    return sum(int(c.item()) for c in dispatch_caches(state).dropped_counters.values())


def reset_caches() -> None:
    """Forget the cached tables and counters (tests; a new engine in the same process)."""
    state = elastic_state()
    if state is not None:
        setattr(state, _CACHES_ATTR, DispatchCaches())


# ------------------------------------------------------------------ membership-event log


def orphaned_experts(metadata: Any, active_ranks: Any) -> list[tuple[int, int]]:
    """(layer, logical expert) pairs with no physical slot on an active rank. Host only.

    Uses SGLang's host copy of the full ``physical_to_logical_map`` (not the per-rank
    collapsed replica list), i.e. what an EPLB rebalance has to fix.
    """
    p2l = metadata.physical_to_logical_map_cpu.to(torch.int64)
    num_layers, num_physical = p2l.shape
    mask = torch.as_tensor(active_ranks).to(device="cpu", dtype=torch.int64).flatten()
    rank = torch.arange(num_physical) // max(metadata.num_local_physical_experts, 1)
    alive = (rank < mask.numel()) & (mask[rank.clamp(max=max(mask.numel() - 1, 0))] != 0)
    num_logical = int(metadata.num_logical_experts)
    ok = (p2l >= 0) & (p2l < num_logical)
    live = torch.zeros(num_layers, num_logical + 1, dtype=torch.int64)
    live.scatter_add_(
        1, torch.where(ok, p2l, num_logical), (ok & alive.view(1, -1)).to(torch.int64)
    )
    return [(int(a), int(b)) for a, b in (live[:, :num_logical] == 0).nonzero().tolist()]


def log_replica_coverage(active_ranks_cpu: Any) -> list[tuple[int, int]] | None:
    """At a membership event: warn when some expert lost every replica (its tokens get ``-1``)."""
    if active_ranks_cpu is None:
        return None
    try:
        metadata = expert_location_metadata()
    except (ImportError, ValueError, AttributeError):
        return None
    if metadata is None:
        return None
    lost = orphaned_experts(metadata, active_ranks_cpu)
    if lost:
        logger.warning(
            "[elastic-ep] %d (layer, expert) pairs have no replica on an active rank, e.g. %s: "
            "their tokens are dispatched to -1 (the expert contributes nothing) until EPLB "
            "places them again",
            len(lost),
            lost[:8],
        )
    return lost

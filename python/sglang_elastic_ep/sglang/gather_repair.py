"""Rows of the pass's DP gather that hold values no live scheduler sends.

Mooncake completes a collective whose peer died before its fault handling marks the peer
inactive, so the masking upstream applies right after the gather (inactive ranks' rows become
the idle fallback row) can still take the dead peer for alive, and its row can hold partial
values. A negative token count or a forward mode that is none kills the scheduler that builds
its batch from them ("negative dimension", "0 is not a valid ForwardMode").

After upstream's gather, each rank checks the host copy upstream already made
(``tp0_info_cpu``; no device access): a row with a negative count or length, a forward mode
that is not one, or a flag other than 0/1 becomes the idle fallback row for this pass (the
rank that died sends nothing anyway), and the fields upstream derives from the rows are
derived again. This check judges a row on its own values only: a live rank's plausible row
never changes by it. On every other pass it reads one small host tensor.

The gather over the expanded WORLD is an all-reduce: each rank writes its row into a zeroed
tensor of every row and the ranks sum them. A peer that dies during it leaves, in each
survivor that did not receive its whole tensor, whatever an earlier collective left in that
peer's part of the receive buffer, and the sum adds it to every row, the survivor's own
included (a scheduler then died padding its batch to its own count minus one). A survivor that
missed a peer's tensor also missed its completion flag, so Mooncake reports the all-reduce as
not locally successful and names the failed peers (``get_local_success``,
``get_failed_ranks_hint``). On such a pass the survivor takes its own row back from what it
sent and the failed peers' rows as they were in the last gather that completed with them
(``repair_after_failed_gather``; idle when there is none). A survivor that did receive the
peer's tensor has correct rows and reports success. The last row rather than an idle one:
another survivor may have received the dying peer's current row, and decides from it whether
the pass runs a forward; a peer that died while serving most likely still had work, and one
that died idle most likely had none, so the last row makes both survivors decide alike
more often (with an idle row there, the one that missed it skips a forward the other runs,
and each takes the other for failed).

The other live peers' rows on such a survivor hold stale bytes only when they came from a
collective of another shape on the same buffer slot. During the agreement's gather each row
ends with a check value over the row (``row_check``), so the survivor can tell those rows too
and takes them as idle for the pass rather than act on counts nobody sent.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)

# Upstream's row (``MLPSyncBatchInfo._get_local_tensor``): the columns and what they may hold.
FORWARD_MODE = 5
COUNT_COLUMNS = (0, 1, 7, 10)  # token counts, prefix length, attention pairs: >= 0
FLAG_COLUMNS = (2, 3, 4, 6, 8, 9)  # booleans sent as 0/1
UPSTREAM_COLUMNS = 11


def row_check(values: Sequence[int]) -> int:
    """The check value a gather row carries in its last column: CRC-32 of the other columns'
    int64 bytes. Not linear in the values, so neither a row with stale bytes added nor the sum
    of two rows passes it."""
    return zlib.crc32(struct.pack(f"<{len(values)}q", *values))


def garbage_rows(rows: Sequence[Sequence[int]], forward_modes: frozenset[int]) -> list[int]:
    """Indices of ``rows`` (upstream's columns of each gathered row) holding values no
    scheduler sends."""
    bad = []
    for index, row in enumerate(rows):
        head = list(row[:UPSTREAM_COLUMNS])
        if (len(head) < UPSTREAM_COLUMNS or any(head[c] < 0 for c in COUNT_COLUMNS)
                or any(head[c] not in (0, 1) for c in FLAG_COLUMNS)
                or head[FORWARD_MODE] not in forward_modes):
            bad.append(index)
    return bad


@functools.cache
def _forward_modes() -> frozenset[int]:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return frozenset(int(m.value) for m in ForwardMode)


@functools.cache
def _decode_mode() -> int:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return int(ForwardMode.DECODE.value)


def repair_after_gather(info: Any) -> list[int]:
    """Check the rows upstream's ``all_gather`` just left on ``info`` and repair them in place
    (see the module docstring); the repaired row indices (usually none)."""
    view = getattr(info, "tp0_info_cpu", None)
    if view is None or view.device.type != "cpu" or view.dim() != 2:
        return []
    bad = garbage_rows(view[:, :UPSTREAM_COLUMNS].tolist(), _forward_modes())
    if not bad:
        return []
    fallback = info._get_fallback_tensor(device="cpu")[:UPSTREAM_COLUMNS]
    for index in bad:
        view[index, :UPSTREAM_COLUMNS] = fallback
    _derive_again(info, view)
    logger.warning("[elastic-ep] gathered DP rows %s held values no scheduler sends (a peer "
                   "failed during the gather): taken as idle rows for this pass", bad)
    return bad


def _derive_again(info: Any, view: Any) -> None:
    """The fields upstream's ``MLPSyncBatchInfo.all_gather`` derives from ``tp0_info_cpu``."""
    info.global_num_tokens = view[:, 0].tolist()
    info.global_num_tokens_for_logprob = view[:, 1].tolist()
    info.can_run_decode_cuda_graph = bool(view[:, 2].min())
    info.is_extend_in_batch = bool(view[:, 3].max())
    info.can_run_prefill_cuda_graph = bool(view[:, 6].min())
    info.prefill_cuda_graph_max_prefix_len = int(view[:, 7].max())
    info.can_run_draft_cuda_graph = bool(view[:, 8].min())
    info.any_health_check = bool(view[:, 9].max())
    info.global_attention_pairs = view[:, 10].tolist()


@dataclass
class LastGatheredRows:
    """The host rows of this rank's last gather that completed with every peer (one per
    process, on upstream's elastic state): a failed peer's row on the next pass."""

    rows: Any = None  # a host tensor [rows, width]

    def keep(self, info: Any) -> None:
        full = full_rows(info)
        self.rows = None if full is None else full.clone()

    def row(self, rank: int, width: int) -> Any:
        rows = self.rows
        if rows is None or rank >= rows.shape[0] or rows.shape[1] != width:
            return None
        return rows[rank]


def full_rows(info: Any) -> Any:
    """Every gathered row on the host (upstream keeps them behind ``tp0_info_cpu``), or None."""
    view = getattr(info, "tp0_info_cpu", None)
    if view is None or view.device.type != "cpu" or view.dim() != 2:
        return None
    width = int(view.shape[1])
    rows = int(info.num_dp_ranks) * int(info.tp_size) * int(info.cp_size)
    if view.untyped_storage().nbytes() < (view.storage_offset() + rows * width) \
            * view.element_size():
        return None
    return view.as_strided((rows, width), (width, 1), view.storage_offset())


@dataclass
class AllReduceSeen:
    """This rank's all-reduce of the pass's rows: its work handle and a device copy of the row
    it sent (taken before the collective, so no host access on a healthy pass)."""

    work: Any = None
    own_index: int = -1
    own_row: Any = None


@contextlib.contextmanager
def seeing_the_all_reduce(group: Any) -> Iterator[AllReduceSeen]:
    """Within upstream's gather, run its one all-reduce over ``group`` through a handle this
    rank can ask afterwards whether it completed with every peer. Upstream calls
    ``torch.distributed.all_reduce`` synchronously and drops the handle; only the call made on
    this thread over ``group`` is taken, and the function is restored on leaving."""
    import torch.distributed as dist

    seen = AllReduceSeen()
    original = dist.all_reduce
    thread = threading.get_ident()

    def all_reduce(tensor: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        if (group is not outer_group or async_op or seen.work is not None
                or threading.get_ident() != thread):
            return original(tensor, op=op, group=group, async_op=async_op)
        seen.own_index = dist.get_rank(group)
        seen.own_row = tensor.view(-1, tensor.shape[-1])[seen.own_index].clone()
        seen.work = original(tensor, op=op, group=group, async_op=True)
        seen.work.wait()
        return None

    outer_group = group
    dist.all_reduce = all_reduce
    try:
        yield seen
    finally:
        dist.all_reduce = original


def failed_peers(work: Any) -> list[int] | None:
    """The peers a Mooncake collective marked failed on this rank, or None when it completed
    with every peer it tried (or the group is not Mooncake's: nothing to ask)."""
    try:
        from mooncake.pg import get_failed_ranks_hint, get_local_success
    except ImportError:
        return None
    if get_local_success(work):
        return None
    hint = get_failed_ranks_hint(work)
    return [] if hint is None else [rank for rank, failed in enumerate(hint.tolist()) if failed]


def repair_after_failed_gather(info: Any, seen: AllReduceSeen, group: Any,
                               checked: bool = False,
                               last: LastGatheredRows | None = None) -> list[int]:
    """After the all-reduce of the pass's rows reported a failed peer on this rank (module
    docstring): this rank's own row is what it sent, each failed peer's row is its row in
    ``last`` (idle without one), and with ``checked`` (rows end with ``row_check``) other rows
    whose check fails are idle. The failed peers (none on a pass that completed with every
    peer; ``last`` then keeps this pass's rows)."""
    import torch.distributed as dist

    if seen.work is None or not str(dist.get_backend(group)).startswith("mooncake"):
        return []
    failed = failed_peers(seen.work)
    if failed is None:
        if last is not None:
            last.keep(info)
        return []
    view = getattr(info, "tp0_info_cpu", None)
    full = full_rows(info)
    if full is None:
        return failed
    rows, width = int(full.shape[0]), int(full.shape[1])
    as_gathered = list(getattr(info, "global_num_tokens", None) or [])
    fallback = info._get_fallback_tensor(device="cpu")
    for rank in failed:
        if rank < rows and rank != seen.own_index and fallback.numel() == width:
            known = last.row(rank, width) if last is not None else None
            full[rank] = fallback if known is None else known
    if 0 <= seen.own_index < rows:
        full[seen.own_index] = seen.own_row.to("cpu")
    stale = _rows_failing_their_check(full, fallback, skip={seen.own_index, *failed}) \
        if checked and fallback.numel() == width else []
    for index in stale:
        full[index] = fallback
    _derive_again(info, view)
    logger.warning("[elastic-ep] the DP gather completed without peers %s (they failed during "
                   "it): this rank's row is what it sent, theirs are their last gathered rows "
                   "for this pass%s; token counts as gathered %s, as taken %s", failed,
                   f"; rows {stale} failed their check and are idle" if stale else "",
                   as_gathered, info.global_num_tokens)
    return failed


def run_a_forward_for(info: Any, failed: Sequence[int]) -> bool:
    """Make this pass run its (idle) forward on this rank: the first failed peer's row becomes
    a one-token decode. For a survivor whose repaired rows hold no work while a live peer that
    received every row runs this pass's forward and waits for this rank's dispatch
    (``tail_recovery.follow_a_forwarding_peer``). False when there is no row to change."""
    full = full_rows(info)
    target = None if full is None else next((r for r in failed if r < full.shape[0]), None)
    if target is None:
        return False
    full[target, 0] = 1  # num_tokens
    full[target, 1] = 1  # num_tokens_for_logprob
    full[target, 3] = 0  # is_extend_in_batch
    full[target, FORWARD_MODE] = _decode_mode()
    _derive_again(info, info.tp0_info_cpu)
    return True


def _rows_failing_their_check(full: Any, fallback: Any, skip: set[int]) -> list[int]:
    """Rows of ``full`` that some rank wrote (not the fallback row) whose last column is not
    ``row_check`` of the others."""
    idle = fallback.tolist()
    bad = []
    for index, values in enumerate(full.tolist()):
        if index in skip or values == idle or len(values) < 2:
            continue
        if row_check(values[:-1]) != values[-1]:
            bad.append(index)
    return bad

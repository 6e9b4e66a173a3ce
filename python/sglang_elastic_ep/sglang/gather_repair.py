"""Rows of the pass's DP gather that a peer dying mid-collective left as garbage.

Mooncake completes a collective whose peer died before its fault handling marks the peer
inactive, so the masking upstream applies right after the gather (inactive ranks' rows become
the idle fallback row) can still see the dead peer as active. Its row, and with a summing
all-reduce even this rank's own row, then holds partial values. Seen on the CPU cluster: a
staying rank killed during a scale-down's drain left a scale joiner with its own token count
one below its batch, and its scheduler died padding the batch to it ("negative dimension -1").

After upstream's gather, each rank checks the host copy upstream already made
(``tp0_info_cpu``; no device access): its own row must equal what it sent, and every row must
hold values a scheduler can send (no negative count, a real forward mode, 0/1 flags).
Garbage rows become the idle fallback row (that rank's tokens are not counted this pass),
this rank's row becomes what it sent, and the fields upstream derives from the rows are
derived again. On every other pass the check reads one small host tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)

# Upstream's row (``MLPSyncBatchInfo._get_local_tensor``): the columns and what they may hold.
NUM_TOKENS, NUM_TOKENS_FOR_LOGPROB, FORWARD_MODE = 0, 1, 5
COUNT_COLUMNS = (NUM_TOKENS, NUM_TOKENS_FOR_LOGPROB, 7, 10)  # counts and lengths: >= 0
FLAG_COLUMNS = (2, 3, 4, 6, 8, 9)  # booleans sent as 0/1
UPSTREAM_COLUMNS = 11


def garbage_rows(rows: Sequence[Sequence[int]], forward_modes: frozenset[int],
                 own_index: int | None, own_row: Sequence[int] | None,
                 fallback_row: Sequence[int]) -> list[int]:
    """Indices of ``rows`` (upstream's columns of each gathered row) that no live scheduler
    sent: out-of-range values anywhere, or this rank's own row (``own_index``) differing from
    ``own_row``, what it sent (unless upstream's mask made it the idle ``fallback_row``)."""
    bad = []
    for index, row in enumerate(rows):
        head = list(row[:UPSTREAM_COLUMNS])
        if len(head) < UPSTREAM_COLUMNS:
            bad.append(index)
            continue
        if (any(head[c] < 0 for c in COUNT_COLUMNS) or any(head[c] not in (0, 1)
                                                           for c in FLAG_COLUMNS)
                or head[FORWARD_MODE] not in forward_modes):
            bad.append(index)
        elif index == own_index and own_row is not None \
                and head != list(own_row[:UPSTREAM_COLUMNS]) \
                and head != list(fallback_row[:UPSTREAM_COLUMNS]):
            bad.append(index)
    return bad


def _forward_modes() -> frozenset[int]:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return frozenset(int(m.value) for m in ForwardMode)


def repair_after_gather(info: Any, group: Any) -> list[int]:
    """Check the rows upstream's ``all_gather`` over ``group`` just left on ``info`` and repair
    them in place (see the module docstring); the repaired row indices (usually none)."""
    view = getattr(info, "tp0_info_cpu", None)
    if view is None or view.device.type != "cpu" or view.dim() != 2:
        return []
    import torch.distributed as dist

    # Each rank's row sits at its rank in the gather's group; the host copy keeps the rows of
    # attention-TP rank 0 of each DP rank.
    per_dp = int(info.tp_size) * int(info.cp_size)
    flat = dist.get_rank(group)
    own_index: int | None = None
    own_row: list[int] | None = None
    if flat >= 0 and flat % per_dp == 0:
        own_index = flat // per_dp
        own_row = info._get_local_tensor(device="cpu").tolist()
    rows = view[:, :UPSTREAM_COLUMNS].tolist()
    fallback = info._get_fallback_tensor(device="cpu")[:UPSTREAM_COLUMNS]
    bad = garbage_rows(rows, _forward_modes(), own_index, own_row, fallback.tolist())
    if not bad:
        return []
    for index in bad:
        view[index, :UPSTREAM_COLUMNS] = fallback
    if own_index is not None and own_row is not None and own_index in bad:
        view[own_index, :UPSTREAM_COLUMNS] = view.new_tensor(own_row[:UPSTREAM_COLUMNS])
    _derive_again(info, view)
    logger.warning("[elastic-ep] gathered DP rows %s were garbage (a peer failed during the "
                   "gather): taken as idle rows for this pass, this rank's own row as sent",
                   bad)
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

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
derived again. A row is judged on its own values only: a live rank's row never changes here.
On every other pass the check reads one small host tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)

# Upstream's row (``MLPSyncBatchInfo._get_local_tensor``): the columns and what they may hold.
FORWARD_MODE = 5
COUNT_COLUMNS = (0, 1, 7, 10)  # token counts, prefix length, attention pairs: >= 0
FLAG_COLUMNS = (2, 3, 4, 6, 8, 9)  # booleans sent as 0/1
UPSTREAM_COLUMNS = 11


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

"""How a removal of named ranks below the tail travels from the HTTP process to the schedulers.

Upstream's ``ScaleElasticEPReqInput`` is a msgspec struct with one field, ``new_ep_size``, and
the IPC decodes only the structs SGLang registered, so no field can be added to it. A removal
travels as a negative size instead: no EP size is below 1, and 0 already means "cancel"
(``scale_up.CANCEL_EP_SIZE``). ``-1 - bitmask`` keeps every removal below -2 (rank 0 is never
removed, so the bitmask is at least 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from sglang_elastic_ep.core.agreement import bitmask_ranks, ranks_bitmask

_REMOVAL_BASE = -1


def removal_size(ranks: Sequence[int]) -> int:
    """The ``new_ep_size`` that asks the schedulers to remove ``ranks`` where they are."""
    if 0 in ranks:
        raise ValueError("rank 0 hosts the HTTP server and is never removed")
    return _REMOVAL_BASE - ranks_bitmask(sorted(ranks))


def removed_ranks(new_ep_size: int) -> tuple[int, ...]:
    """The ranks a request's ``new_ep_size`` asks to remove; () for any other request."""
    if new_ep_size >= _REMOVAL_BASE - 1:
        return ()
    return bitmask_ranks(_REMOVAL_BASE - new_ep_size)

"""Expert weight moves (EPLB rebalances, scale-down moves) without point-to-point transfers
to or from ranks that joined by scale-up, where the installed Mooncake cannot do them.

Mooncake PG before its "Fix elastic P2P after max_world_size recovery" change (PR 2623)
builds each original rank's P2P proxy for the launch-time world only: a send to a rank added
later reads a credit slot that was never set up and aborts the process ("P2P send got
invalid chunk_len in credit slot"; seen on the CPU cluster at the first EPLB rebalance that
moved weights to a scale-joined rank). Collectives are not affected.

Upstream's weight updater already skips transfers with inactive peers: the sender drops
them and the receiver loads those experts from the checkpoint (or the DRAM backup). For the
duration of one update, each rank shows it the mask of ``core.membership.p2p_peers_mask``,
so transfers stay between launch-time ranks and every expert a joiner takes part in comes
from the checkpoint. Both ends of a transfer agree, so no send waits for a missing receive.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch

from sglang_elastic_ep.core.membership import p2p_peers_mask
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, elastic_state

logger = get_logger(__name__)

# The newest Mooncake release without the fix (the version this plugin pins).
LAST_AFFECTED_MOONCAKE = (0, 3, 13)


def mooncake_p2p_reaches_joiners() -> bool:
    """Whether the installed Mooncake builds P2P lanes for ranks added after launch."""
    try:
        version = metadata.version("mooncake-transfer-engine")
    except metadata.PackageNotFoundError:
        return False  # another build (e.g. from source): assume the pinned behaviour
    release = tuple(int(part) for part in version.split(".post")[0].split(".")[:3]
                    if part.isdigit())
    return release > LAST_AFFECTED_MOONCAKE


def update_without_joiner_p2p(original: Any, updater: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ExpertLocationUpdater.update``: upstream's update, shown the mask above."""
    state = elastic_state() if elastic_ep_enabled() else None
    if state is None or state.active_ranks_cpu is None or not state.has_scaled \
            or mooncake_p2p_reaches_joiners():
        return original(updater, *args, **kwargs)
    rank = int(kwargs.get("rank", args[4] if len(args) > 4 else 0))
    shown = p2p_peers_mask(state.active_ranks_cpu.tolist(), rank, int(state.original_ep_size))
    if rank >= state.original_ep_size or any(
            shown[r] != v for r, v in enumerate(state.active_ranks_cpu.tolist())):
        logger.info("[elastic-ep] rank %d: expert weights with ranks that joined by scale-up "
                    "come from the checkpoint (Mooncake P2P cannot reach them)", rank)
    saved = state.active_ranks_cpu
    state.active_ranks_cpu = torch.tensor(shown, dtype=saved.dtype)
    try:
        return original(updater, *args, **kwargs)
    finally:
        state.active_ranks_cpu = saved

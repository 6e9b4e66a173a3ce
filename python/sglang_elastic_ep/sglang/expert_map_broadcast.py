"""The expert map's broadcast at a membership change, checked against what Mooncake reports.

At every admission and recovery upstream broadcasts one rank's physical-to-logical expert map
over WORLD and builds the new expert-location metadata from the tensor right after
(``broadcast_global_expert_location_metadata``). Mooncake completes a broadcast whose peer
stopped answering: a joiner hung on the pass that admits it keeps its connections open, the
transfer engine drops the session after 30 s without progress, and the collective's timeout
ends the wait. The source's tensor can then hold what its receive buffer held, not the map it
sent, and metadata built from it would index past the experts and end the scheduler.

So the broadcast is checked before the metadata is built:

- the source keeps the map it sent (a copy taken before the broadcast), whatever the
  collective left in its tensor;
- a rank that Mooncake reports failed on the source did not receive the map: it stops with an
  error naming the source rather than serve on a map nobody sent;
- any other rank received the map from the source, and its tensor stands.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.sglang.gather_repair import failed_peers
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, expert_location_module

logger = get_logger(__name__)


class ExpertMapNotReceived(RuntimeError):
    """The expert map's broadcast failed on its source: this rank has no map to serve on."""


def settle_map_broadcast(received: torch.Tensor, sent: torch.Tensor | None, src_rank: int,
                         failed: Sequence[int] | None) -> bool:
    """Make ``received`` (this rank's tensor after the broadcast) the map the source sent.

    ``sent`` is the source's own copy from before the broadcast (None on every other rank);
    ``failed`` the peers Mooncake reports the broadcast failed with on this rank (None when it
    completed with every peer, or the group is not Mooncake's). True when the source took its
    map back; raises :class:`ExpertMapNotReceived` on a rank that failed on the source."""
    if sent is not None:
        if torch.equal(received, sent):
            return False
        received.copy_(sent)
        return True
    if failed is not None and src_rank in failed:
        raise ExpertMapNotReceived(
            f"the expert map's broadcast from rank {src_rank} failed on this rank (Mooncake "
            f"reports peers {list(failed)} failed): this rank has no map to serve on. Relaunch "
            "it with --ep-join-mode recover once the cluster serves again")
    return False


def checked_expert_map_broadcast(original: Callable[..., Any], model_config: Any,
                                 moe_ep_rank: int, src_rank: int = 0,
                                 group: Any = None) -> Any:
    """AROUND ``broadcast_global_expert_location_metadata`` (as model_runner and elastic_ep
    import it): upstream's steps, with the broadcast settled by :func:`settle_map_broadcast`
    before the metadata is built from it (module docstring)."""
    if not elastic_ep_enabled():
        return original(model_config=model_config, moe_ep_rank=moe_ep_rank, src_rank=src_rank,
                        group=group)
    el = expert_location_module()
    metadata = el.get_global_expert_location_metadata()
    assert metadata is not None
    mapping = metadata.physical_to_logical_map.contiguous()
    metadata.physical_to_logical_map = mapping
    sent = mapping.clone() if dist.get_rank() == src_rank else None
    work = dist.broadcast(mapping, src=src_rank, group=group, async_op=True)
    work.wait()
    mooncake = str(dist.get_backend(group)).startswith("mooncake")
    failed = failed_peers(work) if mooncake else None
    if settle_map_broadcast(mapping, sent, src_rank, failed):
        logger.warning("[elastic-ep] rank %d: the expert map's broadcast completed without peers "
                       "%s and left this source rank's tensor changed: it keeps the map it sent",
                       src_rank, failed)
    metadata = el.ExpertLocationMetadata.init_by_mapping(model_config, mapping,
                                                         moe_ep_rank=moe_ep_rank)
    el.set_global_expert_location_metadata(metadata, allow_overwrite=True)
    return metadata

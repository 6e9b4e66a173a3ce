"""Every replica of an expert on this rank gets its weights at load time.

With an a2a backend SGLang collapses each logical expert's replica list to the one nearest to
this rank (``_compute_logical_to_all_physical_map``), and ``FusedMoE.weight_loader`` loads a
checkpoint expert into that list only. A placement that puts two replicas of one expert on the
same rank (``--init-expert-location``, a hand-made or recorded layout) leaves the second slot
unloaded, while the static dispatch table may send another rank's tokens to it. Outputs then
depend on which replica a token meets, and change when a scale-up or a rebalance changes the
tables. This hook loads the checkpoint expert into every local slot the full map gives it.

A rank that loaded its experts for one map and then serves with another loads them again
before it serves (``reload_moved_experts``): a replacement loaded them for the launch layout,
a scale joiner for its own start-up layout (the launch placement, when
``--init-expert-location`` covers its slots), and the map the serving ranks broadcast may put
other experts there.
"""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, expert_location_metadata

logger = get_logger(__name__)


def local_replica_slots(
    physical_to_logical_row: list[int], logical: int, first_slot: int, num_local: int
) -> list[int]:
    """Global slot ids in ``[first_slot, first_slot + num_local)`` that hold ``logical``."""
    end = min(first_slot + num_local, len(physical_to_logical_row))
    return [s for s in range(first_slot, end) if physical_to_logical_row[s] == logical]


def weight_loader_every_replica(
    original: Any,
    self: Any,
    param: Any,
    loaded_weight: Any,
    weight_name: str,
    shard_id: str,
    expert_id: int | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """AROUND ``FusedMoE.weight_loader``: upstream's load, then the local replicas it skipped."""
    result = original(self, param, loaded_weight, weight_name, shard_id, expert_id,
                      *args, **kwargs)
    if expert_id is None or not elastic_ep_enabled() or not getattr(
        self, "uses_expert_location", False
    ) or getattr(param, "_sglang_require_global_experts", False):
        return result
    metadata = expert_location_metadata()
    if metadata is None or not 0 <= expert_id < metadata.num_logical_experts:
        return result  # no layout, or a fused shared expert (loaded by upstream's path)
    p2l = metadata.physical_to_logical_map_cpu
    if self.layer_id >= p2l.shape[0]:
        return result
    num_local = self._num_local_routed
    first = self._expert_storage_rank * num_local
    done = set(metadata.logical_to_all_physical(self.layer_id, expert_id))
    for slot in local_replica_slots(p2l[self.layer_id].tolist(), expert_id, first, num_local):
        if slot not in done:
            self._weight_loader_physical(param=param, loaded_weight=loaded_weight,
                                         weight_name=weight_name, shard_id=shard_id,
                                         expert_id=slot)
    return result


def own_slots(rank: int) -> list[list[int]] | None:
    """The logical expert of each of ``rank``'s physical slots, per layer (None: no map)."""
    metadata = expert_location_metadata()
    if metadata is None:
        return None
    slots = int(metadata.num_local_physical_experts)
    p2l = metadata.physical_to_logical_map
    return p2l[:, rank * slots:(rank + 1) * slots].tolist()


def reload_moved_experts(runner: Any, rank: int, loaded: list[list[int]] | None) -> None:
    """This rank loaded its experts for the map ``loaded`` describes; when the map now in place
    (the one the serving ranks broadcast) puts other experts in its slots, load its experts
    again from the checkpoint (a local load, before it serves)."""
    now = own_slots(rank)
    if loaded is None or now is None or now == loaded:
        return
    changed = sum(a != b for old, new in zip(loaded, now, strict=True)
                  for a, b in zip(old, new, strict=True))
    config = runner.model_config
    ok, message = runner.weight_updater.update_weights_from_disk(
        config.model_path, runner.load_config.load_format,
        weight_name_filter=lambda name: ".experts." in name)
    if not ok:
        raise RuntimeError(f"reloading the experts of {changed} moved slots failed: {message}")
    logger.info("[elastic-ep] rank %d: %d of its expert slots hold other experts than it "
                "loaded: reloaded its experts from the checkpoint", rank, changed)

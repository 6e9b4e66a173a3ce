"""A clear startup error for an expert count that does not split over the launch ranks."""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep.core.placement import PlacementError, launch_slots_per_rank


def elastic_expert_layout(original: Any, base_num_physical_experts: int, initial_ep_size: int,
                          effective_ep_size: int) -> Any:
    """AROUND ``expert_location._compute_elastic_expert_layout``: upstream asserts that the
    physical experts split over the launch ranks, with no message; say which
    ``--ep-num-redundant-experts`` would."""
    if base_num_physical_experts % initial_ep_size:
        from sglang.srt.runtime_context import get_exec

        redundant = int(get_exec().moe.ep_num_redundant_experts or 0)
        try:
            launch_slots_per_rank(base_num_physical_experts - redundant, redundant,
                                  initial_ep_size)
        except PlacementError as exc:
            raise ValueError(f"elastic EP: {exc}") from None
    return original(base_num_physical_experts, initial_ep_size, effective_ep_size)

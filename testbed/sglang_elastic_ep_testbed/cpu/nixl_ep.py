"""SGLang's NIXL EP path (``--moe-a2a-backend nixl``) on the CPU engine.

Upstream's ``NixlEPDispatcher`` imports ``nixl_ep.Buffer`` (GPU only) and keeps its mask buffer
on ``"cuda"``; its MoE runners for the packed low-latency layout are GPU kernels. With these
hooks the same dispatcher, scale-up path and mask-based fault detection run on CPU over
:class:`sglang_elastic_ep_testbed.nixl_cpu.buffer.Buffer` (real NIXL transfers of host memory).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def load_nixl_ep() -> tuple[type, torch.dtype]:
    """REPLACE ``token_dispatcher.nixl._load_nixl_ep``: the CPU buffer as a scheduler uses it,
    int64 top-k ids."""
    from sglang_elastic_ep_testbed.cpu.scheduler_buffer import SchedulerBuffer

    return SchedulerBuffer, torch.int64


def dispatcher_impl_init(original: Callable, impl: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ``_NixlEPDispatcherImplBase.__init__``: upstream allocates the mask buffer on
    ``"cuda"`` when elastic EP is on. Run it with the elastic state hidden (so it skips that),
    then give the dispatcher the same mask buffer on CPU."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.runtime_context import get_parallel

    state = ElasticEPStateManager._instance
    ElasticEPStateManager._instance = None
    try:
        original(impl, *args, **kwargs)
    finally:
        ElasticEPStateManager._instance = state
    if state is not None:
        impl.active_ranks = state.active_ranks
        max_ep = get_parallel().max_ep_size or impl._active_world_size
        impl._mask_buffer = torch.zeros(max_ep, dtype=torch.int32)


def run_moe_core(original: Callable, layer: Any, dispatch_output: Any) -> Any:
    """AROUND ``DeepEPMoE.run_moe_core``: experts compute on the packed per-expert rows the
    buffer delivered (same math as the native MoE, fp8 rows dequantized with their scales);
    other formats go to upstream."""
    if not dispatch_output.format.is_deepep_ll():
        return original(layer, dispatch_output)
    from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput

    from sglang_elastic_ep.sglang.expert_timing import expert_timer
    from sglang_elastic_ep_testbed.nixl_cpu.moe_runner import run_deepep_ll

    out = run_deepep_ll(
        dispatch_output,
        layer.w13_weight,
        layer.w2_weight,
        activation=layer.moe_runner_config.activation,
        w13_bias=getattr(layer, "w13_weight_bias", None),
        w2_bias=getattr(layer, "w2_weight_bias", None),
        on_expert_done=expert_timer().record,  # per-expert latency for the health monitor
    )
    return DeepEPLLCombineInput(
        hidden_states=out.hidden_states, topk_ids=out.topk_ids, topk_weights=out.topk_weights
    )

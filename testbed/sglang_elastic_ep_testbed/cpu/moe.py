"""Expert-parallel-safe replacement for SGLang's ``moe_forward_native`` (CPU engine).

Upstream scatters every top-k id into a per-expert count; under EP, experts that live on another
rank arrive as id ``-1`` and crash the scatter, and a rank with no tokens (a joiner's first,
empty batch) crashes on ``torch.cat([])``. Here ``-1`` contributes nothing and 0 tokens return an
empty result. The per-expert math is upstream's: linear, activation, linear, weighted sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def _activation(moe_runner_config: Any):
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul, SituAndMul

    act = moe_runner_config.activation
    if act == "silu":
        return SiluAndMul()
    if act == "gelu":
        return GeluAndMul()
    if act == "situ":
        beta = moe_runner_config.gemm1_alpha if moe_runner_config.gemm1_alpha is not None else 4.0
        return SituAndMul(beta=beta, linear_beta=moe_runner_config.gemm1_clamp_limit)
    raise ValueError(f"Unsupported activation: {act=}")


def expert_mlp(
    tokens: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: Any,
    moe_runner_config: Any,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert's MLP on its tokens, as in upstream's ``moe_forward_native``."""
    dtype = tokens.dtype
    gate_up = F.linear(tokens, w13)
    if w13_bias is not None:
        gate_up = (gate_up.float() + w13_bias).to(dtype)
    if moe_runner_config.activation == "silu" and moe_runner_config.gemm1_alpha is not None:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
            swiglu_gpt_oss_sigmoid_alpha,
        )

        gate_up = swiglu_gpt_oss_sigmoid_alpha(
            gate_up, moe_runner_config.gemm1_alpha, moe_runner_config.gemm1_clamp_limit
        )
    else:
        gate_up = act(gate_up)
    out = F.linear(gate_up, w2)
    if w2_bias is not None:
        out = (out.float() + w2_bias).to(dtype)
    return out


def moe_forward_native(
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_output: Any,
    moe_runner_config: Any,
) -> torch.Tensor:
    if moe_runner_config.apply_router_weight_on_input:
        raise NotImplementedError("apply_router_weight_on_input is not supported on CPU")
    topk_weights, topk_ids, _ = topk_output
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros((num_tokens, x.shape[-1]), dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    act = _activation(moe_runner_config)
    w13_bias = getattr(layer, "w13_weight_bias", None)
    w2_bias = getattr(layer, "w2_weight_bias", None)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    flat_weights = topk_weights.reshape(-1).to(torch.float32)
    for expert in torch.unique(flat_ids[flat_ids >= 0]).tolist():
        slots = (flat_ids == expert).nonzero().squeeze(1)
        token_idx = slots // top_k
        expert_out = expert_mlp(
            x[token_idx],
            layer.w13_weight[expert],
            layer.w2_weight[expert],
            act,
            moe_runner_config,
            w13_bias[expert] if w13_bias is not None else None,
            w2_bias[expert] if w2_bias is not None else None,
        )
        out.index_add_(0, token_idx, expert_out.float() * flat_weights[slots].unsqueeze(1))
    return out.to(x.dtype)


"""CPU MoE experts on the packed per-expert (DeepEP / NIXL EP low-latency) layout.

The dispatch hands each rank ``hidden [local experts, ranks * max tokens, hidden]`` and
``masked_m [local experts]``: only the first ``masked_m[e]`` rows of expert ``e`` are tokens.
:func:`run_packed_experts` runs SGLang's native MoE math (``moe_forward_native``: w13 linear,
SiLU-and-mul (or GELU-and-mul), w2 linear, optional biases) on exactly those rows and returns
the same layout for ``combine``; padding rows are zero and never computed.

:func:`dense_moe_reference` is the single-process result the dispatch + experts + combine
round trip must equal: ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``, -1 ids skipped.
Pure torch; no SGLang import.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from . import fp8 as fp8_mod

ExpertDone = Callable[[int, int, float], None]  # (local expert, rows, seconds)


def _act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    d = gate_up.shape[-1] // 2
    if activation == "silu":
        return F.silu(gate_up[..., :d]) * gate_up[..., d:]
    if activation == "gelu":
        return F.gelu(gate_up[..., :d], approximate="tanh") * gate_up[..., d:]
    raise ValueError(f"unsupported activation {activation!r} (silu, gelu)")


def expert_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert on ``x [n, hidden]`` exactly as ``moe_forward_native`` computes it."""
    dtype = x.dtype
    gate_up = F.linear(x, w13)
    if w13_bias is not None:
        gate_up = (gate_up.float() + w13_bias).to(dtype)
    out = F.linear(_act_and_mul(gate_up, activation), w2)
    if w2_bias is not None:
        out = (out.float() + w2_bias).to(dtype)
    return out


def run_packed_experts(
    hidden_states: torch.Tensor,
    masked_m: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    hidden_states_scale: torch.Tensor | None = None,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    on_expert_done: ExpertDone | None = None,
) -> torch.Tensor:
    """Experts on the packed layout.

    Args:
        hidden_states: ``[E, M, hidden]`` (float8_e4m3fn when ``hidden_states_scale`` is given).
        masked_m: ``[E]`` valid rows per local expert.
        w13: ``[E, 2 * intermediate, hidden]`` (gate rows first, then up), local experts only.
        w2: ``[E, hidden, intermediate]``.
        hidden_states_scale: ``[E, M, hidden / 128]`` fp8 scales (nixl_ep fp8 dispatch).
        out_dtype: dtype of the result (default: the weights' dtype for fp8 input, else the
            input's).
        on_expert_done: called after each local expert that had rows, with (local expert, rows,
            seconds it took): per-expert latency for the health monitor.

    Returns ``[E, M, hidden]``: expert outputs in the first ``masked_m[e]`` rows, zeros after.
    """
    num_e, m, hidden = hidden_states.shape
    if w13.shape[0] != num_e or w2.shape[0] != num_e:
        raise ValueError(
            f"{num_e} local experts in the layout, weights for {w13.shape[0]}/{w2.shape[0]}"
        )
    if masked_m.numel() != num_e:
        raise ValueError(f"masked_m has {masked_m.numel()} entries for {num_e} experts")
    fp8 = hidden_states_scale is not None
    compute_dtype = w13.dtype if fp8 else hidden_states.dtype
    out = torch.zeros(num_e, m, hidden, dtype=out_dtype or compute_dtype)
    counts = masked_m.tolist()
    for e, n in enumerate(counts):
        n = int(n)
        if n <= 0:
            continue
        if n > m:
            raise ValueError(f"masked_m[{e}]={n} exceeds the layout's {m} rows")
        started = time.perf_counter() if on_expert_done is not None else 0.0
        x = hidden_states[e, :n]
        if fp8:
            assert hidden_states_scale is not None
            x = fp8_mod.dequantize(x, hidden_states_scale[e, :n], compute_dtype)
        y = expert_forward(
            x,
            w13[e],
            w2[e],
            activation=activation,
            w13_bias=None if w13_bias is None else w13_bias[e],
            w2_bias=None if w2_bias is None else w2_bias[e],
        )
        out[e, :n] = y.to(out.dtype)
        if on_expert_done is not None:
            on_expert_done(e, n, time.perf_counter() - started)
    return out


class PackedCombineInput(NamedTuple):
    """Same fields as SGLang's ``DeepEPLLCombineInput``."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def run_deepep_ll(
    dispatch_output: Any,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    on_expert_done: ExpertDone | None = None,
) -> PackedCombineInput:
    """Experts on a ``DeepEPLLDispatchOutput`` (what SGLang's nixl dispatcher returns:
    ``hidden_states, hidden_states_scale, topk_ids, topk_weights, masked_m, expected_m``);
    returns the fields of a ``DeepEPLLCombineInput``."""
    hidden_states, scale, topk_ids, topk_weights, masked_m, _expected_m = dispatch_output
    out = run_packed_experts(
        hidden_states,
        masked_m,
        w13,
        w2,
        hidden_states_scale=scale,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        on_expert_done=on_expert_done,
    )
    return PackedCombineInput(out, topk_ids, topk_weights)


def dense_moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: str = "silu",
    dropped_experts: Sequence[int] = (),
) -> torch.Tensor:
    """Single-process MoE over ALL experts (``w13 [num_experts, 2I, H]``): the result EP
    dispatch + experts + combine must reproduce. Experts in ``dropped_experts`` (on a masked
    rank) contribute nothing, like ids of -1. Accumulates in float32, returns ``x.dtype``."""
    n, k = topk_ids.shape
    acc = torch.zeros(n, x.shape[1], dtype=torch.float32)
    dropped = set(int(e) for e in dropped_experts)
    ids = topk_ids.tolist()
    for e in sorted({int(v) for row in ids for v in row if v >= 0} - dropped):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        y = expert_forward(x[tok], w13[e], w2[e], activation=activation)
        acc.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(1))
    return acc.to(x.dtype)

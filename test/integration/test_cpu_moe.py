"""The EP-safe native MoE on CPU equals a dense reference, with -1 ids and 0 tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sglang")

from sglang_elastic_ep_testbed.cpu.moe import moe_forward_native  # noqa: E402


def _layer(num_experts: int, hidden: int, inter: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1)
    return SimpleNamespace(
        num_experts=num_experts,
        w13_weight=torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3,
        w2_weight=torch.randn(num_experts, hidden, inter, generator=g) * 0.3,
    )


def _config() -> SimpleNamespace:
    return SimpleNamespace(
        apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None,
        gemm1_clamp_limit=None,
    )


def _dense(layer: SimpleNamespace, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            gate, up = F.linear(x[t], layer.w13_weight[e]).chunk(2)
            out[t] += w[t, k] * F.linear(F.silu(gate) * up, layer.w2_weight[e])
    return out


def test_matches_dense_reference_and_skips_nonlocal_experts() -> None:
    layer = _layer(8, 16, 12)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 16, generator=g)
    ids = torch.randint(0, 8, (10, 2), generator=g)
    ids[::3, 1] = -1  # experts owned by another rank
    weights = torch.rand(10, 2, generator=g)
    got = moe_forward_native(layer, x, (weights, ids, None), _config())
    torch.testing.assert_close(got, _dense(layer, x, ids, weights), rtol=1e-5, atol=1e-5)


def test_split_over_two_ranks_sums_to_single_rank() -> None:
    """EP: each rank computes its own experts (-1 for the rest); the sum equals one rank."""
    layer = _layer(8, 16, 12)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=g)
    ids = torch.randint(0, 8, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g)
    full = moe_forward_native(layer, x, (weights, ids, None), _config())
    rank0 = torch.where(ids < 4, ids, torch.full_like(ids, -1))
    rank1 = torch.where(ids >= 4, ids, torch.full_like(ids, -1))
    parts = [moe_forward_native(layer, x, (weights, r, None), _config()) for r in (rank0, rank1)]
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)


def test_zero_tokens_returns_empty() -> None:
    layer = _layer(4, 8, 4)
    x = torch.zeros(0, 8)
    ids = torch.zeros(0, 2, dtype=torch.int64)
    out = moe_forward_native(layer, x, (torch.zeros(0, 2), ids, None), _config())
    assert out.shape == (0, 8)

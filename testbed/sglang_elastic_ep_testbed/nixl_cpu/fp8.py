"""Per-token, per-128-channel FP8 (e4m3) casting, as DeepEP / nixl_ep low-latency dispatch does it.

``x[t, g*128:(g+1)*128] ~= q[t, g*128:(g+1)*128] * scale[t, g]`` with
``scale = amax / 448`` (rounded up to a power of two with ``round_scale``).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128


def check_fp8_hidden(hidden: int) -> None:
    if hidden % GROUP:
        raise ValueError(
            f"fp8 dispatch needs hidden % {GROUP} == 0 (per-{GROUP}-channel scales), got "
            f"hidden={hidden}; dispatch in the model dtype instead (SGLang: set "
            "SGLANG_NIXL_EP_BF16_DISPATCH=1)"
        )


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, H]`` -> ``(q [N, H] float8_e4m3fn, scales [N, H/128] float32)``."""
    n, h = x.shape
    check_fp8_hidden(h)
    xg = x.float().reshape(n, h // GROUP, GROUP)
    amax = xg.abs().amax(dim=-1).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(n, h)
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``q [..., H]`` and ``scales [..., H/128]``."""
    h = q.shape[-1]
    lead = q.shape[:-1]
    xg = q.float().reshape(*lead, h // GROUP, GROUP) * scales.float().unsqueeze(-1)
    return xg.reshape(*lead, h).to(dtype)

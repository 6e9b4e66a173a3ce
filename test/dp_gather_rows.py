"""Upstream's DP-gather rows (``MLPSyncBatchInfo`` in SGLang 0.5.23) as the plugin's row hooks
see them, without SGLang: shared by the unit tests of the agreement and its GPU check."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from sglang_elastic_ep.sglang import gather_agreement

UPSTREAM_WIDTH = 11  # MLPSyncBatchInfo's own columns in SGLang 0.5.23
IDLE_MODE = 9  # stands in for ForwardMode.IDLE (never 0 in upstream's rows)


def upstream_row(info: Any, device: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Shaped like ``MLPSyncBatchInfo._get_local_tensor`` (one device copy of host values)."""
    return torch.tensor([info.num_tokens, info.num_tokens, 1, 0, 1, IDLE_MODE, 0, 0, 1, 0, 0],
                        device=device, dtype=dtype)


def upstream_fallback(info: Any, device: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([0, 0, 1, 0, 1, IDLE_MODE, 0, 0, 1, 0, 0], device=device, dtype=dtype)


class Info(SimpleNamespace):
    """An ``MLPSyncBatchInfo`` whose row builders go through our hooks, as HookRegistry's
    AROUND wrappers do."""

    def _get_local_tensor(self, device: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return gather_agreement.append_agreement_columns(upstream_row, self, device=device,
                                                         dtype=dtype)

    def _get_fallback_tensor(self, device: Any, dtype: torch.dtype = torch.int64
                             ) -> torch.Tensor:
        return gather_agreement.append_blank_columns(upstream_fallback, self, device=device,
                                                     dtype=dtype)

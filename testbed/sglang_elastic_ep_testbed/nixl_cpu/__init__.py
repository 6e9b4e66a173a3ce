"""CPU EP data plane: a ``nixl_ep.Buffer`` look-alike on real NIXL transfers, and CPU experts
for its packed per-expert layout. Importable without SGLang (and without NIXL until a
:class:`Buffer` is constructed).

* :class:`Buffer` — what SGLang 0.5.23's ``token_dispatcher/nixl.py`` uses from
  ``nixl_ep.Buffer`` (``dispatch``/``combine``, ``connect_ranks``/``disconnect_ranks``, the mask
  buffer, ...), moving host memory between processes with NIXL agents (UCX, registered DRAM).
* :func:`load_nixl_ep` — the ``(Buffer, topk_idx_t)`` pair SGLang's ``_load_nixl_ep()`` returns,
  for a hook that selects this buffer on ``--device cpu --moe-a2a-backend nixl``.
* :mod:`.moe_runner` — experts on the packed layout (``run_packed_experts``) and the dense
  single-process reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._env import UCX_DEFAULTS, configure_ucx_env
from .layout import RegionLayout, rdma_size_hint

if TYPE_CHECKING:
    from .buffer import Buffer, DispatchHandle, EventOverlap, RecvHook

topk_idx_t = torch.int64

__all__ = [
    "Buffer",
    "DispatchHandle",
    "EventOverlap",
    "RecvHook",
    "RegionLayout",
    "UCX_DEFAULTS",
    "configure_ucx_env",
    "load_nixl_ep",
    "rdma_size_hint",
    "topk_idx_t",
]


def load_nixl_ep() -> tuple[type, torch.dtype]:
    """Drop-in for SGLang's ``token_dispatcher.nixl._load_nixl_ep``: ``(Buffer, int64)``."""
    from .buffer import Buffer

    return Buffer, topk_idx_t


def __getattr__(name: str) -> Any:
    if name in ("Buffer", "DispatchHandle", "EventOverlap", "RecvHook"):
        from . import buffer

        return getattr(buffer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

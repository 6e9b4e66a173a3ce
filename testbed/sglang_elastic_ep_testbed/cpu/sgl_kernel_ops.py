"""Torch versions of the CPU ``sgl_kernel`` ops that SGLang's CPU engine calls.

The CPU build of ``sgl_kernel`` is not published on PyPI. Installed as the module ``sgl_kernel``
(only with the CPU engine, and only when no real ``sgl_kernel`` can be imported); an op SGLang
asks for that is not here fails with a message naming it, never silently.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV slots into its row of ``req_to_token``.

    Request ``i`` owns ``out_cache_loc[sum(len[:i]) : sum(len[:i+1])]`` and stores it at
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``.
    """
    del pool_len  # rows are addressed through the 2-D tensor
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _missing_op(name: str):
    def missing(*args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided by sglang-elastic-ep's CPU engine support; "
            "use a model and backends the CPU engine covers (torch_native attention, native MoE)"
        )

    missing.__name__ = name
    return missing


class _CpuKernelModule(types.ModuleType):
    # SGLang does `from sgl_kernel import op` at import time for many ops it calls only on
    # paths we do not take: importing succeeds, calling one that is missing raises.
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing_op(name)


def install() -> None:
    if "sgl_kernel" in sys.modules:
        return
    if importlib.util.find_spec("sgl_kernel") is not None:
        return  # a real build is installed: it wins
    module = _CpuKernelModule("sgl_kernel")
    module.__path__ = []
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    sys.modules["sgl_kernel"] = module

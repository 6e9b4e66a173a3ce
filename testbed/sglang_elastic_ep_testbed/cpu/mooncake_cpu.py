"""Mooncake process groups on the CPU device (``--device cpu --elastic-ep-backend mooncake``).

Upstream switches groups to Mooncake only for CUDA: ``_resolve_backend`` picks ``mooncake`` on
``cuda`` alone, ``init_distributed_environment`` builds its options with a CUDA tensor, and
``GroupCoordinator`` asks ``new_group`` for ``mooncake`` (the CUDA backend) for device groups.
On CPU every group uses ``mooncake-cpu`` instead, with the same options, so membership calls
(activate, deactivate, recover, join) work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LOOPBACK = "127.0.0.1"


def _mooncake_on_cpu() -> bool:
    from sglang.srt.runtime_context import get_exec

    return get_exec().moe.elastic_ep_backend == "mooncake"


def resolve_backend(result: str, *args: Any, device: str, **kwargs: Any) -> str:
    """AFTER ``bootstrap._resolve_backend``: ``mooncake-cpu`` for the CPU device."""
    if device == "cpu" and _mooncake_on_cpu():
        return "mooncake-cpu"
    return result


def apply_process_settings() -> None:
    """Mooncake's loopback address, set before groups exist (otherwise its transfer engine and
    coordinator listen on, and peers connect to, the machine's first LAN address: the CPU
    cluster stays on 127.0.0.1). The product sets the timeouts, as on a GPU."""
    from mooncake import pg

    pg.set_host_ip(LOOPBACK)


def world_options(world_size: int) -> Any:
    """Mooncake options for WORLD: an active-rank mask sized for the largest world."""
    import torch
    from mooncake.pg import MooncakeBackendOptions
    from sglang.srt.runtime_context import get_exec, get_parallel

    # What bootstrap hands init_distributed_environment (which builds these only for CUDA).
    max_world = get_parallel().max_ep_size
    recovered = bool(get_exec().moe.is_ep_joiner)
    use_max = bool(max_world and max_world > world_size)
    active = torch.zeros(max_world if use_max else world_size, dtype=torch.int32)
    active[:world_size] = 1
    if use_max:
        return MooncakeBackendOptions(active, recovered, max_world)
    return MooncakeBackendOptions(active, recovered)


def init_process_group(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``torch.distributed.init_process_group``: options for ``mooncake-cpu`` WORLD
    (a scale joiner's size is already raised to the largest WORLD so far by the product's
    ``world_registration`` hook)."""
    if kwargs.get("backend") != "mooncake-cpu":
        return original(*args, **kwargs)
    apply_process_settings()
    if kwargs.get("pg_options") is None:
        kwargs["pg_options"] = world_options(int(kwargs["world_size"]))
    return original(*args, **kwargs)


def new_group(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``torch.distributed.new_group``: the CUDA ``mooncake`` backend becomes
    ``mooncake-cpu`` (GroupCoordinator hard-codes it for device groups)."""
    if kwargs.get("backend") == "mooncake":
        kwargs["backend"] = "mooncake-cpu"
    return original(*args, **kwargs)

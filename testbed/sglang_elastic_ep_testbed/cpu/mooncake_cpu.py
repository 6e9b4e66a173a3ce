"""Mooncake process groups on the CPU device (``--device cpu --elastic-ep-backend mooncake``).

Upstream switches groups to Mooncake only for CUDA: ``_resolve_backend`` picks ``mooncake`` on
``cuda`` alone, ``init_distributed_environment`` builds its options with a CUDA tensor, and
``GroupCoordinator`` asks ``new_group`` for ``mooncake`` (the CUDA backend) for device groups.
On CPU every group uses ``mooncake-cpu`` instead, with the same options, so membership calls
(activate, deactivate, recover, join) work. Mooncake's collective timeout and fault window come
from our flags (propagated to child processes through the environment).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from sglang_elastic_ep.sglang.args import ENV_COLLECTIVE_TIMEOUT, ENV_FAULT_WINDOW

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


# init_distributed_environment's arguments that init_process_group needs but is not given.
_world_options: dict[str, Any] = {}


def _mooncake_on_cpu() -> bool:
    from sglang.srt.runtime_context import get_exec

    return get_exec().moe.elastic_ep_backend == "mooncake"


def resolve_backend(result: str, *args: Any, device: str, **kwargs: Any) -> str:
    """AFTER ``bootstrap._resolve_backend``: ``mooncake-cpu`` for the CPU device."""
    if device == "cpu" and _mooncake_on_cpu():
        return "mooncake-cpu"
    return result


def init_distributed_environment(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``init_distributed_environment``: remember the elastic sizing for WORLD."""
    _world_options["recovered_rank"] = bool(kwargs.get("recovered_rank", False))
    _world_options["max_world_size"] = kwargs.get("max_world_size")
    _world_options["world_size"] = kwargs.get("world_size", args[0] if args else -1)
    return original(*args, **kwargs)


def apply_process_settings() -> None:
    """Mooncake's process-wide settings, applied before groups exist: our timeouts, and the
    loopback address (otherwise its transfer engine and coordinator listen on, and peers
    connect to, the machine's first LAN address: the CPU cluster stays on 127.0.0.1)."""
    from mooncake import pg

    pg.set_host_ip(LOOPBACK)
    timeout = os.environ.get(ENV_COLLECTIVE_TIMEOUT)
    window = os.environ.get(ENV_FAULT_WINDOW)
    if timeout:
        pg.set_collective_timeout_us(int(float(timeout) * 1e6))
    if window:
        pg.set_fault_reconciliation_window_us(int(float(window) * 1e6))


def world_options(world_size: int) -> Any:
    """Mooncake options for WORLD: an active-rank mask sized for the largest world."""
    import torch
    from mooncake.pg import MooncakeBackendOptions

    max_world = _world_options.get("max_world_size")
    recovered = _world_options.get("recovered_rank", False)
    use_max = bool(max_world and max_world > world_size)
    active = torch.zeros(max_world if use_max else world_size, dtype=torch.int32)
    active[:world_size] = 1
    if use_max:
        return MooncakeBackendOptions(active, recovered, max_world)
    return MooncakeBackendOptions(active, recovered)


def init_process_group(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``torch.distributed.init_process_group``: options for ``mooncake-cpu`` WORLD;
    a scale joiner asks for the largest WORLD reached so far (``world_high_water``)."""
    if kwargs.get("backend") != "mooncake-cpu":
        return original(*args, **kwargs)
    apply_process_settings()
    store = _joiner_store(kwargs.get("init_method"))
    if store is not None:
        asked = int(kwargs["world_size"])
        kwargs["world_size"] = joiner_world_size(asked, read_world_high_water(store))
        if kwargs["world_size"] != asked:
            logger.info("[elastic-ep] WORLD reached %d ranks before: this joiner registers for "
                        "%d, not %d (Mooncake only attaches to the same rank order)",
                        kwargs["world_size"], kwargs["world_size"], asked)
    if kwargs.get("pg_options") is None:
        kwargs["pg_options"] = world_options(int(kwargs["world_size"]))
    result = original(*args, **kwargs)
    if store is not None:
        raise_world_high_water(store, int(kwargs["world_size"]))
    return result


# TCPStore key (the cluster's global store, on rank 0) holding the largest WORLD size reached.
WORLD_HIGH_WATER_KEY = "sglang_eep/world_high_water"
_STORE_TIMEOUT_S = 10.0


def joiner_world_size(asked: int, high_water: int | None) -> int:
    """Mooncake's WORLD grows append-only and keeps its largest rank order: a scale-down
    deactivates ranks but never shortens it. A registration attaches when its rank order equals
    the group's, or extends it when the group's is a proper prefix; a shorter one (a joiner for
    slot 2 after 4 -> 2, asking for 3) is refused with "no append-compatible extension target".
    So a joiner asks for the larger of its own need and the largest WORLD so far."""
    return max(asked, high_water or 0)


def read_world_high_water(store: Any) -> int | None:
    if not store.check([WORLD_HIGH_WATER_KEY]):
        return None
    return int(store.get(WORLD_HIGH_WATER_KEY).decode())


def raise_world_high_water(store: Any, size: int) -> None:
    """Set the key to ``max(key, size)`` atomically (several joiners may register together)."""
    desired = str(size).encode()
    while True:
        current = read_world_high_water(store)
        if current is not None and current >= size:
            return
        expected = b"" if current is None else str(current).encode()
        if store.compare_set(WORLD_HIGH_WATER_KEY, expected, desired) == desired:
            return


def _joiner_store(init_method: str | None) -> Any:
    """A client of the cluster's global TCPStore for a scale joiner (None for launch ranks, or
    when the store cannot be reached: the joiner then asks for its own size, as upstream)."""
    from sglang.srt.runtime_context import get_exec

    if not get_exec().moe.is_ep_scale_joiner or not init_method:
        return None
    from datetime import timedelta

    from sglang.srt.environ import envs
    from torch.distributed import TCPStore

    host = init_method.removeprefix("tcp://").rsplit(":", 1)[0]
    port = envs.SGLANG_TCP_STORE_PORT.get()
    try:
        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - fall back to upstream's size
        logger.warning("[elastic-ep] global TCPStore %s:%d unreachable (%s): this joiner asks "
                       "for its own WORLD size", host, port, exc)
        return None


def new_group(original: Callable, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``torch.distributed.new_group``: the CUDA ``mooncake`` backend becomes
    ``mooncake-cpu`` (GroupCoordinator hard-codes it for device groups)."""
    if kwargs.get("backend") == "mooncake":
        kwargs["backend"] = "mooncake-cpu"
    return original(*args, **kwargs)

"""A scale joiner registers for the largest WORLD Mooncake reached, on any device.

Mooncake's WORLD grows append-only and keeps its longest rank order: a scale-down deactivates
ranks but never shortens it. A registration attaches when its rank order equals the group's, or
extends it when the group's is a proper prefix; a shorter one is refused ("no
append-compatible extension target") and the joiner's scheduler dies at start-up. Upstream's
joiner asks for a WORLD of its top slot + 1, so after 4 -> 2 a joiner for slot 2 asks for 3.
Here it asks for the larger of that and the largest WORLD so far, kept under one key in the
rendezvous store every rank of the deployment already uses (rank 0 hosts it), and raises that
key once registered. The same code runs for the CUDA ``mooncake`` backend and the CPU
testbed's ``mooncake-cpu``.

The same store records how many ranks, from 0, are still in the launch-time groups. A
scale-down below the launch size releases launch-time ranks for good: a joiner that refills
one of their slots lives in WORLD alone, like any scale joiner. Every rank reads
``state.original_ep_size`` as that boundary (upstream: whether ranks outside the launch-time
groups serve; here: which failed ranks rejoin in place, which P2P lanes exist), so the staying
ranks lower it at the release and each later joiner or replacement reads it from the store.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

from sglang_elastic_ep.sglang.mooncake_timeouts import apply_timeouts
from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)

WORLD_HIGH_WATER_KEY = "sglang_eep/world_high_water"
# The number of ranks from 0 still in the launch-time groups (set when a scale-down releases
# launch-time ranks; read by every later joiner and replacement).
LAUNCH_GROUP_KEY = "sglang_eep/launch_group_size"
STORE_TIMEOUT_S = 10.0


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` this module uses."""

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...

    def set(self, key: str, value: bytes | str) -> None: ...

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes: ...


def joiner_world_size(asked: int, high_water: int | None) -> int:
    """The WORLD size a scale joiner registers for: its own need, or the largest WORLD so far
    when that is larger (a registration shorter than WORLD's rank order is refused)."""
    return max(asked, high_water or 0)


def read_world_high_water(store: KeyValueStore) -> int | None:
    return _read_int(store, WORLD_HIGH_WATER_KEY)


def raise_world_high_water(store: KeyValueStore, size: int) -> None:
    """Set the key to ``max(key, size)`` atomically (several joiners may register together)."""
    _move_int(store, WORLD_HIGH_WATER_KEY, size, lambda current: current >= size)


def read_launch_group_size(store: KeyValueStore) -> int | None:
    return _read_int(store, LAUNCH_GROUP_KEY)


def lower_launch_group_size(store: KeyValueStore, size: int) -> None:
    """Set the key to ``min(key, size)`` atomically."""
    _move_int(store, LAUNCH_GROUP_KEY, size, lambda current: current <= size)


def launch_group_size(launch_size: int, recorded: int | None) -> int:
    """How many ranks, from 0, are still in the launch-time groups: the launch size, or fewer
    once a scale-down released launch-time ranks (they come back only as scale joiners, which
    live in WORLD alone)."""
    return launch_size if recorded is None else min(launch_size, recorded)


def _read_int(store: KeyValueStore, key: str) -> int | None:
    if not store.check([key]):
        return None
    return int(store.get(key).decode())


def _move_int(store: KeyValueStore, key: str, value: int,
              holds: Callable[[int], bool]) -> None:
    """Set ``key`` to ``value`` unless its current value already ``holds`` (compare-and-set)."""
    desired = str(value).encode()
    while True:
        current = _read_int(store, key)
        if current is not None and holds(current):
            return
        expected = b"" if current is None else str(current).encode()
        if store.compare_set(key, expected, desired) == desired:
            return


def rendezvous_store(init_method: str, timeout_s: float = STORE_TIMEOUT_S
                     ) -> KeyValueStore | None:
    """A client of the TCPStore behind ``tcp://host:port`` (the deployment's rendezvous, hosted
    by rank 0), or None when it cannot be reached."""
    from torch.distributed import TCPStore

    if not init_method.startswith("tcp://"):
        return None
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    try:
        return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:  # the callers each have a way on without it
        logger.debug("[elastic-ep] rendezvous store %s unreachable", init_method, exc_info=True)
        return None


def _mooncake_world(backend: str) -> tuple[bool, bool]:
    """(WORLD is a Mooncake group, this process is a joiner)."""
    from sglang.srt.runtime_context import get_exec

    moe = get_exec().moe
    mooncake = moe.elastic_ep_backend == "mooncake" and backend.startswith("mooncake")
    return mooncake, bool(mooncake and moe.is_ep_joiner)


def init_distributed_environment(original: Callable[..., Any], *args: Any, **kwargs: Any
                                 ) -> Any:
    """AROUND ``parallel_state.init_distributed_environment``: Mooncake gets our timeouts, and
    a Mooncake joiner's WORLD size (a scale joiner's, or a launch-time rank's replacement after
    a scale) becomes ``max(its own, the largest so far)``, before WORLD registers."""
    backend = str(kwargs.get("backend", ""))
    init_method = kwargs.get("distributed_init_method")
    mooncake, joiner = _mooncake_world(backend)
    if mooncake:
        apply_timeouts()
    if args or not init_method or not joiner:
        return original(*args, **kwargs)
    store = rendezvous_store(str(init_method))
    if store is None:  # registering at upstream's size still works while WORLD never shrank
        logger.warning("[elastic-ep] rendezvous store %s unreachable: this joiner asks for its "
                       "own WORLD size", init_method)
        return original(*args, **kwargs)
    asked = int(kwargs["world_size"])
    high_water = read_world_high_water(store)
    kwargs["world_size"] = joiner_world_size(asked, high_water)
    # One line per joiner: which size it registered for, and why when not its own.
    logger.info("[elastic-ep] WORLD registration: this joiner needs %d ranks, the largest WORLD "
                "so far is %s: registers for %d%s", asked, high_water or "none yet",
                kwargs["world_size"],
                "" if kwargs["world_size"] == asked
                else " (Mooncake only attaches to the same rank order)")
    result = original(*args, **kwargs)
    if high_water is None or kwargs["world_size"] > high_water:
        # Only a WORLD larger than any before moves the key: a registration at the high water
        # (every replacement after a scale) makes no store call that could fail it.
        raise_world_high_water(store, int(kwargs["world_size"]))
    return result


def adopt_launch_group_size(state: Any) -> None:
    """A joiner or a replacement: lower ``state.original_ep_size`` to the launch-time group's
    size the deployment recorded (no record: no launch-time rank was released)."""
    store = _deployment_store()
    if store is not None:
        state.original_ep_size = launch_group_size(int(state.original_ep_size),
                                                   read_launch_group_size(store))


def release_launch_ranks(state: Any, target: int, rank: int) -> None:
    """Every staying rank on the commit of a scale-down to ``target``: launch-time ranks at or
    above it leave the launch-time groups for good; rank 0 records it for later joiners."""
    if target >= int(state.original_ep_size):
        return
    state.original_ep_size = target
    store = _deployment_store() if rank == 0 else None
    if store is not None:
        lower_launch_group_size(store, target)


def _deployment_store() -> KeyValueStore | None:
    """Upstream's client of the deployment's rendezvous store (None before it is set up)."""
    from sglang.srt.distributed.utils import get_global_tcp_store

    return get_global_tcp_store()

"""What the survivors tell a replacement through the rendezvous store before it commits.

Each notice is one key in the deployment's rendezvous TCPStore (rank 0 hosts it), set by the
survivors and withdrawn once the replacement is in:

- ``sglang_eep/awaited_tail/{size}`` -> the old size: the survivors re-admit the lowest slots
  of a let-go tail up to ``size`` and still await the rest. The replacement reads it before
  its commit barrier and waits for the rest with them.
- ``sglang_eep/rejoin_in_place/{rank}`` -> the size the survivors serve on: they await
  ``rank``'s replacement where it is (a scale-joined rank below a live one). The replacement,
  a scale joiner by its arguments, reads it at start-up and rejoins through upstream's
  recovery instead of registering a scale cohort.
- ``sglang_eep/counted_out/{rank}`` -> how many times a serving rank counted ``rank``'s joiner
  out of Mooncake's WORLD at a commit (its admission not acknowledged in time) and let its
  slot go. A joiner that does not serve yet reads a count above the one it found at its
  registration and exits, instead of waiting in ``join_group`` or in a collective the serving
  ranks left. Never withdrawn: only its change counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

AWAITED_TAIL_KEY_PREFIX = "sglang_eep/awaited_tail"
IN_PLACE_KEY_PREFIX = "sglang_eep/rejoin_in_place"
COUNTED_OUT_KEY_PREFIX = "sglang_eep/counted_out"


def _rendezvous_store() -> Any:
    from sglang.srt.distributed.utils import get_global_tcp_store

    return get_global_tcp_store()


def _read(key: str) -> int:
    store = _rendezvous_store()
    if store is None or not store.check([key]):
        return 0
    return int(store.get(key).decode())


def _set(keys_values: Iterable[tuple[str, int]]) -> None:
    store = _rendezvous_store()
    if store is not None:
        for key, value in keys_values:
            store.set(key, str(value))


def _delete(keys: Iterable[str]) -> None:
    store = _rendezvous_store()
    if store is not None:
        for key in keys:
            store.delete_key(key)


def announce_partial_return(target: int, return_to: int) -> None:
    if target < return_to:
        _set([(f"{AWAITED_TAIL_KEY_PREFIX}/{target}", return_to)])


def withdraw_partial_return(target: int) -> None:
    _delete([f"{AWAITED_TAIL_KEY_PREFIX}/{target}"])


def tail_awaited_above(size: int) -> int:
    """The old size the survivors still await once a replacement has brought them to ``size``
    (0: none; read by a scale joiner before its commit barrier)."""
    return _read(f"{AWAITED_TAIL_KEY_PREFIX}/{size}")


def announce_in_place(ranks: Iterable[int], serving: int) -> None:
    _set((f"{IN_PLACE_KEY_PREFIX}/{rank}", serving) for rank in ranks)


def withdraw_in_place(ranks: Iterable[int]) -> None:
    _delete(f"{IN_PLACE_KEY_PREFIX}/{rank}" for rank in ranks)


def in_place_size(rank: int) -> int:
    """The size the survivors serve on while they await ``rank``'s replacement in place, else
    0 (read by a scale joiner at start-up)."""
    return _read(f"{IN_PLACE_KEY_PREFIX}/{rank}")


def announce_counted_out(ranks: Iterable[int]) -> None:
    store = _rendezvous_store()
    if store is not None:
        for rank in ranks:
            store.add(f"{COUNTED_OUT_KEY_PREFIX}/{rank}", 1)


def times_counted_out(rank: int) -> int:
    """How many times the serving ranks counted ``rank``'s joiner out at a commit (read by a
    scale joiner as it registers, and until it serves)."""
    return _read(f"{COUNTED_OUT_KEY_PREFIX}/{rank}")

"""Byte layout of the CPU EP buffer's registered region and of the messages written into it.

One DRAM region per rank, sized once for the maximum number of ranks (``--max-ep-size``) and
registered with NIXL. Every rank computes the same offsets from the same three numbers
(``num_ranks``, ``num_experts_per_rank``, ``num_rdma_bytes``), so a sender can write straight into
the slot a receiver reserved for it::

    [ ctrl recv: 64 B per source rank | ctrl send: 64 B ]
    [ dispatch recv slot, per source rank  x num_ranks ]
    [ combine  recv slot, per source rank  x num_ranks ]
    [ dispatch send staging, per dest rank x num_ranks ]
    [ combine  send staging, per dest rank x num_ranks ]

A message (one per (source, destination) pair and operation) is contiguous, so it moves in one
NIXL WRITE::

    header    int64[8]   magic, seq, kind, src rank, rows, dtype code, row bytes, local experts
    counts    int32[E]   rows per local expert of the destination, expert-major order
    src_idx   int32[n]   (dispatch only) token index at the source, per row
    payload   n rows of ``row_bytes`` each, 64-byte aligned

Nothing here imports NIXL; the functions are pure and unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 64
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
CTRL_BYTES = 64
MAGIC = 0x3155504C58494E  # "NIXLPU1" little-endian, fits in int64

# Message kinds (header word 2).
KIND_DISPATCH = 1
KIND_COMBINE = 2
KIND_HANDSHAKE = 3

# The size hint assumes float32 rows (the CPU engine may serve in float32); bf16/fp16/fp8 rows
# are smaller and fit the same slots.
HINT_ELEMENT_BYTES = 4
FP8_GROUP = 128


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def counts_offset() -> int:
    return HEADER_BYTES


def src_idx_offset(num_local_experts: int) -> int:
    return align_up(HEADER_BYTES + 4 * num_local_experts, 8)


def payload_offset(num_rows: int, num_local_experts: int, with_src_idx: bool) -> int:
    src = src_idx_offset(num_local_experts)
    return align_up(src + (4 * num_rows if with_src_idx else 0))


def message_bytes(
    num_rows: int, row_bytes: int, num_local_experts: int, with_src_idx: bool
) -> int:
    """Bytes of one message carrying ``num_rows`` rows."""
    return payload_offset(num_rows, num_local_experts, with_src_idx) + num_rows * row_bytes


def row_bytes_for(hidden: int, element_bytes: int, fp8: bool) -> int:
    """Bytes of one dispatched row: the hidden vector, plus per-128-channel scales for fp8."""
    if fp8:
        return hidden + (hidden // FP8_GROUP) * 4
    return hidden * element_bytes


def max_rows_per_message(num_max_dispatch_tokens_per_rank: int, num_local_experts: int) -> int:
    """Worst case rows from one source to one destination: every token on every local expert.

    (A token picks at most ``min(topk, local experts)`` experts of one rank; the top-k is not
    known when the buffer is sized, so the bound uses the local expert count, as DeepEP does.)
    """
    return num_max_dispatch_tokens_per_rank * num_local_experts


def slot_bytes_needed(
    num_max_dispatch_tokens_per_rank: int,
    hidden: int,
    num_local_experts: int,
    element_bytes: int = HINT_ELEMENT_BYTES,
) -> int:
    rows = max_rows_per_message(num_max_dispatch_tokens_per_rank, num_local_experts)
    return align_up(
        message_bytes(rows, hidden * element_bytes, num_local_experts, with_src_idx=True)
    )


def ctrl_area_bytes(num_ranks: int) -> int:
    return align_up((num_ranks + 1) * CTRL_BYTES)


def rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Registered bytes for ``num_ranks`` ranks holding ``num_experts`` experts in all."""
    if min(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts) <= 0:
        raise ValueError(
            "sizes must be positive: "
            f"{num_max_dispatch_tokens_per_rank=} {hidden=} {num_ranks=} {num_experts=}"
        )
    local = -(-num_experts // num_ranks)
    slot = slot_bytes_needed(num_max_dispatch_tokens_per_rank, hidden, local)
    return ctrl_area_bytes(num_ranks) + 4 * num_ranks * slot


@dataclass(frozen=True)
class RegionLayout:
    """Offsets inside one rank's registered region (identical on every rank)."""

    num_ranks: int
    num_experts_per_rank: int
    num_bytes: int

    def __post_init__(self) -> None:
        if self.num_ranks <= 0 or self.num_experts_per_rank <= 0:
            raise ValueError(f"bad layout sizes: {self}")
        if self.slot_bytes < ALIGN * 4:
            raise ValueError(
                f"num_rdma_bytes={self.num_bytes} is too small for {self.num_ranks} ranks; "
                "size it with Buffer.get_rdma_size_hint"
            )

    @property
    def ctrl_bytes(self) -> int:
        return ctrl_area_bytes(self.num_ranks)

    @property
    def slot_bytes(self) -> int:
        usable = self.num_bytes - ctrl_area_bytes(self.num_ranks)
        return max(0, usable // (4 * self.num_ranks)) // ALIGN * ALIGN

    def fingerprint(self) -> tuple[int, int, int]:
        return (self.num_ranks, self.num_experts_per_rank, self.num_bytes)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} outside [0, {self.num_ranks})")

    def ctrl_recv(self, src_rank: int) -> int:
        self._check(src_rank)
        return src_rank * CTRL_BYTES

    def ctrl_send(self) -> int:
        return self.num_ranks * CTRL_BYTES

    def _area(self, index: int, rank: int) -> int:
        self._check(rank)
        return self.ctrl_bytes + (index * self.num_ranks + rank) * self.slot_bytes

    def dispatch_recv(self, src_rank: int) -> int:
        return self._area(0, src_rank)

    def combine_recv(self, src_rank: int) -> int:
        return self._area(1, src_rank)

    def dispatch_send(self, dst_rank: int) -> int:
        return self._area(2, dst_rank)

    def combine_send(self, dst_rank: int) -> int:
        return self._area(3, dst_rank)

    def check_fits(self, nbytes: int, what: str) -> None:
        if nbytes > self.slot_bytes:
            raise RuntimeError(
                f"{what} needs {nbytes} bytes but a slot holds {self.slot_bytes} "
                f"(num_rdma_bytes={self.num_bytes}, num_ranks={self.num_ranks}); size the "
                "buffer with Buffer.get_rdma_size_hint for these tokens/hidden/experts"
            )

"""When the NIXL EP buffer connects and disconnects ranks.

``nixl_ep.Buffer.connect_ranks`` is a two-sided handshake through the TCPStore: it publishes this
rank's metadata and blocks, for up to 300 s, until every named peer has published theirs. A
peer can only publish once it has joined (Mooncake ``activate_ranks`` has returned on the
existing ranks), so asking for a connection any earlier is a circular wait (RFC "MoE buffer
connection ordering"). Disconnecting a rank that still has tokens in flight loses them, so a
disconnect must follow the drain. This module owns that ordering:

* :meth:`NixlMembership.on_scale` only records the target size. The plugin calls it after
  ``activate_ranks`` on scale-up and after the drain on scale-down, never from the HTTP handler.
* :meth:`NixlMembership.ensure_connected` is what the dispatch path calls before each dispatch.
  When nothing changed it is one integer comparison; otherwise it applies the recorded steps in
  order: ``connect_ranks(new ranks)`` when growing, ``disconnect_ranks(tail ranks)`` when
  shrinking.

The buffer is duck-typed (``connect_ranks(list)``, ``disconnect_ranks(list)``, and for sizing
``update_memory_buffers(...)`` plus a ``get_rdma_size_hint`` static method), so the same code
drives the real ``nixl_ep.Buffer`` and any buffer with its interface (a CPU one, a recording
stand-in in tests). Nothing here imports SGLang, NIXL or torch.

A peer that dies before it reaches its own ``connect_ranks`` (a joiner killed on the pass that
admits it, a replacement killed as it is taken back) never publishes, and the survivors would
wait out those 300 s inside the buffer, serving nothing. So before each connect every rank marks
its arrival in the TCPStore and waits until each peer has marked its own, dropping a peer that
Mooncake's WORLD no longer counts as a live member (:meth:`NixlMembership._await_peers`). A
peer that arrived is at most a few instructions away from publishing its metadata.

Threading: SGLang runs the per-forward poll (which calls ``on_scale``) and the MoE dispatch on the
same scheduler thread, so there is no locking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# Upstream asserts this (NIXL EP's low-latency kernels count tokens per peer below
# FINISHED_SUM_TAG = 1024).
NIXL_MAX_DISPATCH_TOKENS_PER_RANK = 1024

# nixl_ep's own elastic test sleeps this long between disconnecting a rank and connecting a
# (new) rank with the same id, to avoid racing the invalidation of the old metadata.
DEFAULT_RECONNECT_GRACE_S = 5.0

# How long a rank waits for its peers to reach the connect (nixl_ep's own metadata wait): past
# it the connect goes ahead and the buffer's wait applies.
DEFAULT_ARRIVAL_TIMEOUT_S = 300.0
ARRIVAL_POLL_S = 0.05
ARRIVAL_KEY_PREFIX = "elastic-ep/nixl-arrival"

SizeHint = Callable[[int, int, int, int], int]


class EPBufferLike(Protocol):
    """What the membership needs from a buffer (``nixl_ep.Buffer`` has it)."""

    def connect_ranks(self, remote_ranks: list[int]) -> None: ...

    def disconnect_ranks(self, remote_ranks: list[int]) -> None: ...


class MembershipOrderError(RuntimeError):
    """A connect or disconnect was asked for before the step it must follow.

    Connecting to a rank that was not activated would block forever inside ``connect_ranks``;
    disconnecting a rank that was not drained drops its in-flight tokens.
    """


class RankRemovedError(RuntimeError):
    """This rank was scaled away: it must not dispatch any more, only release its buffer."""


# --------------------------------------------------------------------------- pre-sizing helpers


def local_experts_per_rank(
    num_logical_experts: int, num_redundant_experts: int, initial_ep_size: int
) -> int:
    """Experts each rank holds, fixed at launch: ``(logical + redundant) / initial EP size``.

    Upstream fixes this number when the server starts and keeps it through every scale, so the
    buffer and the expert weights never change shape.
    """
    if initial_ep_size <= 0:
        raise ValueError(f"initial_ep_size must be positive, got {initial_ep_size}")
    if num_logical_experts <= 0 or num_redundant_experts < 0:
        raise ValueError(
            f"bad expert counts: logical={num_logical_experts} redundant={num_redundant_experts}"
        )
    total = num_logical_experts + num_redundant_experts
    if total % initial_ep_size:
        raise ValueError(
            f"{num_logical_experts} logical + {num_redundant_experts} redundant experts do not "
            f"divide over {initial_ep_size} ranks; pick --ep-num-redundant-experts so they do"
        )
    return total // initial_ep_size


def max_physical_experts(num_local_experts: int, max_ep_size: int) -> int:
    """Physical expert slots at the largest EP size: what the buffer must be sized for."""
    if num_local_experts <= 0 or max_ep_size <= 0:
        raise ValueError(f"need positive sizes, got {num_local_experts=} {max_ep_size=}")
    return num_local_experts * max_ep_size


@dataclass(frozen=True)
class BufferSizing:
    """Sizes a NIXL EP buffer once, for ``--max-ep-size`` ranks and all their expert slots.

    Buffers sized this way never need reallocation on a scale: scaling only changes which
    connections exist (RFC "Pre-allocation with max_ep_size").
    """

    max_ep_size: int
    num_local_experts: int
    num_max_dispatch_tokens_per_rank: int
    hidden_size: int

    def __post_init__(self) -> None:
        if self.max_ep_size <= 0 or self.num_local_experts <= 0 or self.hidden_size <= 0:
            raise ValueError(f"sizes must be positive: {self}")
        if not 0 < self.num_max_dispatch_tokens_per_rank <= NIXL_MAX_DISPATCH_TOKENS_PER_RANK:
            raise ValueError(
                "num_max_dispatch_tokens_per_rank must be in "
                f"[1, {NIXL_MAX_DISPATCH_TOKENS_PER_RANK}], got "
                f"{self.num_max_dispatch_tokens_per_rank}"
            )
        if (self.max_ep_size * self.num_max_dispatch_tokens_per_rank) % 4:
            raise ValueError(
                "max_ep_size * num_max_dispatch_tokens_per_rank must be a multiple of 4 "
                "(NIXL EP low-latency layout alignment)"
            )

    @property
    def max_num_experts(self) -> int:
        """Physical expert slots over ``max_ep_size`` ranks."""
        return max_physical_experts(self.num_local_experts, self.max_ep_size)

    def num_rdma_bytes(self, size_hint: SizeHint) -> int:
        """Bytes to register, from the buffer class's ``get_rdma_size_hint``."""
        return int(
            size_hint(
                self.num_max_dispatch_tokens_per_rank,
                self.hidden_size,
                self.max_ep_size,
                self.max_num_experts,
            )
        )

    def allocate(self, buffer: Any, size_hint: SizeHint | None = None) -> int:
        """Call ``buffer.update_memory_buffers`` for the maximum size; returns the RDMA bytes."""
        hint = size_hint if size_hint is not None else type(buffer).get_rdma_size_hint
        num_rdma_bytes = self.num_rdma_bytes(hint)
        buffer.update_memory_buffers(
            num_ranks=self.max_ep_size,
            num_experts_per_rank=self.num_local_experts,
            num_rdma_bytes=num_rdma_bytes,
        )
        return num_rdma_bytes

    def dispatch_num_experts(self, ep_size: int, *, fixed_layout: bool = False) -> int:
        """``num_experts`` to pass to ``dispatch``.

        Upstream passes the experts of the connected ranks (``fixed_layout=False``). With
        ``fixed_layout=True`` it is the maximum, so the dispatch layout (and a captured CUDA
        graph) does not depend on the current size.
        """
        if not 0 < ep_size <= self.max_ep_size:
            raise ValueError(f"ep_size {ep_size} outside [1, {self.max_ep_size}]")
        size = self.max_ep_size if fixed_layout else ep_size
        return self.num_local_experts * size


# --------------------------------------------------------------------------------- membership


@dataclass
class _Step:
    kind: str  # "connect", "disconnect" or "leave"
    ranks: list[int] = field(default_factory=list)


class NixlMembership:
    """Which ranks this rank's EP buffer is connected to, and when that changes.

    Life cycle on one rank::

        m = NixlMembership()
        m.attach(buffer, rank=r, max_ep_size=M, initial_ep_size=N)   # at buffer creation
        ...
        m.ensure_connected()        # first line of every dispatch (cheap when idle)
        ...
        m.mark_activated([N])       # Mooncake activate_ranks returned for rank N
        m.on_scale(N + 1)           # records the target; the next dispatch connects rank N
        ...
        m.mark_drained([N])         # rank N has no tokens in flight any more
        m.on_scale(N)               # the next dispatch disconnects rank N

    Args:
        check_order: refuse (``MembershipOrderError``) an ``on_scale`` that would connect a rank
            not marked activated, or disconnect one not marked drained. Checked where
            ``on_scale`` is called (the control path), not later in the dispatch path.
        reconnect_grace_s: least time between disconnecting a rank id and connecting it again.
        before_connect: called with the buffer before each ``connect_ranks`` (upstream refreshes
            the buffer's TCPStore there).
        on_applied: called after every applied change (e.g. to mirror sizes into upstream state).
        members_alive: which of the given ranks the cluster's membership (Mooncake's WORLD
            view) still counts as live members. With it, and a buffer whose
            ``tcp_store_group`` is set, each connect first waits for its peers to arrive and
            drops the dead ones.
        arrival_timeout_s: how long that wait lasts at most.
    """

    def __init__(
        self,
        *,
        check_order: bool = True,
        reconnect_grace_s: float = DEFAULT_RECONNECT_GRACE_S,
        before_connect: Callable[[Any], None] | None = None,
        on_applied: Callable[[NixlMembership], None] | None = None,
        members_alive: Callable[[list[int]], list[bool]] | None = None,
        arrival_timeout_s: float = DEFAULT_ARRIVAL_TIMEOUT_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.check_order = check_order
        self.reconnect_grace_s = reconnect_grace_s
        self._before_connect = before_connect
        self._on_applied = on_applied
        self._members_alive = members_alive
        self.arrival_timeout_s = arrival_timeout_s
        self._sleep = sleep
        self._clock = clock

        self._buffer: Any = None
        self._rank: int | None = None
        self._max_ep_size: int | None = None
        # Target size and applied size. The dispatch path compares two integers, sequence
        # numbers of the recorded and the applied membership: sizes alone cannot tell "shrank and
        # grew back before any dispatch" (the rank id now belongs to a new process and must be
        # reconnected) from "nothing happened".
        self._scale_to = 0
        self._connected_ep_size = 0
        self._connected: set[int] = set()  # ranks whose connect was applied, not disconnected
        self._target_seq = 0
        self._applied_seq = 0
        self._planned_size = 0
        self._steps: list[_Step] = []
        self._activated: set[int] = set()
        self._drained: set[int] = set()
        self._disconnected_at: dict[int, float] = {}
        self._leaving = False
        self.applied: list[tuple[str, tuple[int, ...]]] = []
        self.dropped: list[int] = []  # peers a connect skipped: gone before they arrived

    # ----------------------------------------------------------------------------- properties

    @property
    def buffer(self) -> Any:
        return self._buffer

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def max_ep_size(self) -> int | None:
        return self._max_ep_size

    @property
    def scale_to(self) -> int:
        """The EP size the data plane is asked to reach."""
        return self._scale_to

    @property
    def connected_ep_size(self) -> int:
        """The EP size the buffer is connected at (what dispatch uses)."""
        return self._connected_ep_size

    @property
    def is_leaving(self) -> bool:
        """This rank was scaled away (it lies beyond the target size)."""
        return self._leaving

    @property
    def pending(self) -> bool:
        return self._target_seq != self._applied_seq

    # ----------------------------------------------------------------------------- events

    def mark_activated(self, ranks: Iterable[int]) -> None:
        """Mooncake ``activate_ranks`` returned for these ranks: they may be connected now."""
        for r in ranks:
            self._activated.add(int(r))
            self._drained.discard(int(r))

    def replace(self, ranks: Iterable[int]) -> None:
        """Ranks inside the connected size now belong to new processes (recovery): the next
        dispatch drops the dead peers' agents and handshakes with the replacements. Call after
        Mooncake's ``recover_ranks`` returned for them (they are activated again)."""
        ranks = sorted({int(r) for r in ranks} - {self._rank})
        if not ranks:
            return
        outside = [r for r in ranks if r >= self._planned_size]
        if outside:
            raise ValueError(f"ranks {outside} are outside the EP size {self._planned_size}")
        self.mark_activated(ranks)
        if self._buffer is None:
            return  # attach() connects everything up to the target anyway
        self._steps.append(_Step("disconnect", ranks))
        self._steps.append(_Step("connect", ranks))
        self._target_seq += 1
        logger.info("[elastic-ep][nixl] rank %s: replacing %s (applied on next dispatch)",
                    self._rank, ranks)

    def mark_drained(self, ranks: Iterable[int]) -> None:
        """These ranks have no tokens in flight: they may be disconnected now."""
        for r in ranks:
            self._drained.add(int(r))
            self._activated.discard(int(r))

    def attach(self, buffer: Any, *, rank: int, max_ep_size: int, initial_ep_size: int) -> None:
        """Adopt a freshly allocated (pre-sized) buffer; the first dispatch connects.

        ``initial_ep_size`` is the world this rank starts in: the launch size on a founder,
        ``join offset + world size`` on a joiner (the ranks it joined are active by definition).
        A target recorded by an earlier ``on_scale`` wins if it is larger, as upstream does.
        """
        if self._buffer is not None:
            raise RuntimeError("a buffer is already attached")
        if not 0 < initial_ep_size <= max_ep_size:
            raise ValueError(f"initial_ep_size {initial_ep_size} outside [1, {max_ep_size}]")
        if not 0 <= rank < max_ep_size:
            raise ValueError(f"rank {rank} outside [0, {max_ep_size})")
        target = max(initial_ep_size, self._scale_to)
        self.mark_activated(range(initial_ep_size))
        self._check_activated(range(initial_ep_size, target), rank)
        self._buffer = buffer
        self._rank = rank
        self._max_ep_size = max_ep_size
        self._steps = [_Step("connect", list(range(target)))]
        self._planned_size = target
        self._scale_to = target
        self._target_seq += 1

    def on_scale(self, new_ep_size: int) -> None:
        """Record a new target size; the next :meth:`ensure_connected` applies it.

        Call only after ``activate_ranks`` (growing) or after the drain (shrinking): with
        ``check_order`` the call raises ``MembershipOrderError`` otherwise. Never blocks.
        """
        new_ep_size = int(new_ep_size)
        if new_ep_size <= 0 or (self._max_ep_size is not None and new_ep_size > self._max_ep_size):
            raise ValueError(f"new EP size {new_ep_size} outside [1, {self._max_ep_size}]")
        if self._buffer is None:
            # No buffer yet: remember the target; attach() connects up to it.
            self._scale_to = new_ep_size
            return
        current = self._planned_size
        if new_ep_size > current:
            grow = list(range(current, new_ep_size))
            self._check_activated(grow, self._rank)
            self._steps.append(_Step("connect", grow))
        elif new_ep_size < current:
            shrink = list(range(new_ep_size, current))
            self._check_drained(shrink, self._rank)
            self._plan_shrink(shrink)
        else:
            return
        self._planned_size = new_ep_size
        self._scale_to = new_ep_size
        self._target_seq += 1
        logger.info(
            "[elastic-ep][nixl] rank %s: EP size %d -> %d recorded (applied on next dispatch)",
            self._rank,
            self._connected_ep_size,
            new_ep_size,
        )

    # ----------------------------------------------------------------------------- hot path

    def ensure_connected(self) -> None:
        """Dispatch-path check. Raises ``RankRemovedError`` on a rank that was scaled away."""
        if self._target_seq != self._applied_seq:
            self._apply()

    # ----------------------------------------------------------------------------- teardown

    def release(self) -> None:
        """On a rank leaving for good: give the buffer's resources back and forget it."""
        buf, self._buffer = self._buffer, None
        self._steps = []
        self._applied_seq = self._target_seq
        if buf is not None and getattr(buf, "explicitly_destroy", False):
            buf.destroy()

    # ----------------------------------------------------------------------------- internals

    def _check_activated(self, ranks: Iterable[int], own_rank: int | None) -> None:
        if not self.check_order:
            return
        missing = [r for r in ranks if r != own_rank and r not in self._activated]
        if missing:
            raise MembershipOrderError(
                f"connect to ranks {missing} requested before they were activated "
                "(call on_scale after activate_ranks, never from the HTTP handler: "
                "connect_ranks would wait forever for their metadata)"
            )

    def _check_drained(self, ranks: Iterable[int], own_rank: int | None) -> None:
        if not self.check_order:
            return
        missing = [r for r in ranks if r != own_rank and r not in self._drained]
        if missing:
            raise MembershipOrderError(
                f"disconnect of ranks {missing} requested before they were drained "
                "(call on_scale for a scale-down only after the drain)"
            )

    def _plan_shrink(self, ranks: list[int]) -> None:
        remaining = set(ranks)
        # Cancel connects that were recorded but never applied, newest first: connecting a rank
        # that is already leaving would wait for it forever.
        for step in reversed(self._steps):
            if step.kind == "connect" and remaining:
                cancelled = remaining.intersection(step.ranks)
                if cancelled and self._rank not in cancelled:
                    step.ranks = [r for r in step.ranks if r not in cancelled]
                    remaining -= cancelled
        self._steps = [s for s in self._steps if s.ranks or s.kind == "leave"]
        if self._rank is not None and self._rank in remaining:
            self._leaving = True
            self._steps.append(_Step("leave", [self._rank]))
            return
        if remaining:
            self._steps.append(_Step("disconnect", sorted(remaining)))

    def _apply(self) -> None:
        buf = self._buffer
        if buf is None:
            if self._leaving:
                raise RankRemovedError(f"rank {self._rank} left the EP group")
            raise RuntimeError("ensure_connected() before attach(): no buffer to connect")
        while self._steps:
            step = self._steps[0]
            if step.kind == "leave":
                raise RankRemovedError(
                    f"rank {self._rank} was scaled away (EP size {self._scale_to}); it must not "
                    "dispatch any more"
                )
            if step.kind == "connect":
                self._wait_reconnect_grace(step.ranks)
                if self._before_connect is not None:
                    self._before_connect(buf)
                ranks = self._connect(buf, step.ranks)
                self._connected.update(ranks)
            else:
                # Only what is connected: a peer dropped at its connect never was.
                ranks = [r for r in step.ranks if r in self._connected]
                if ranks:
                    buf.disconnect_ranks(ranks)
                now = self._clock()
                for r in step.ranks:
                    self._disconnected_at[r] = now
                self._connected.difference_update(step.ranks)
            # Dispatch spans every rank up to the highest connected one: replacing a rank in
            # the middle (disconnect, then connect) must not cut the ranks above it off.
            self._connected_ep_size = max(self._connected, default=-1) + 1
            self.applied.append((step.kind, tuple(step.ranks)))
            self._steps.pop(0)
            logger.info(
                "[elastic-ep][nixl] rank %s: %s %s -> connected EP size %d",
                self._rank,
                step.kind,
                ranks,
                self._connected_ep_size,
            )
        self._applied_seq = self._target_seq
        if self._on_applied is not None:
            self._on_applied(self)

    def _connect(self, buf: Any, ranks: list[int]) -> list[int]:
        """``connect_ranks`` with the peers that arrived; returns the ranks connected."""
        store = getattr(buf, "tcp_store_group", None)
        if self._members_alive is None or store is None or self._rank is None:
            buf.connect_ranks(list(ranks))
            return list(ranks)
        mine = f"{ARRIVAL_KEY_PREFIX}/{self._rank}"
        store.set(mine, b"1")
        try:
            gone = self._await_peers(store, [r for r in ranks if r != self._rank])
            ranks = [r for r in ranks if r not in gone]
            if gone:
                self.dropped.extend(gone)
                logger.warning(
                    "[elastic-ep][nixl] rank %s: not connecting ranks %s: Mooncake's WORLD no "
                    "longer counts them as live members and they never reached the connect "
                    "(their process died); the failure path lets their slots go",
                    self._rank,
                    gone,
                )
            if any(r != self._rank for r in ranks) or not gone:
                buf.connect_ranks(list(ranks))
        finally:
            try:
                store.delete_key(mine)
            except Exception as exc:  # noqa: BLE001 - the store may be going away
                logger.debug("withdraw %s: %s", mine, exc)
        return ranks

    def _await_peers(self, store: Any, peers: list[int]) -> list[int]:
        """Wait until each peer marked its arrival or Mooncake counts it out; returns the ones
        counted out. A dead peer is dropped even if its mark is there (a process killed
        inside its connect leaves one)."""
        waiting = sorted(set(peers))
        gone: list[int] = []
        deadline = self._clock() + self.arrival_timeout_s
        while waiting:
            alive = self._members_alive(waiting)  # type: ignore[misc]
            gone.extend(r for r, up in zip(waiting, alive, strict=True) if not up)
            waiting = [
                r for r, up in zip(waiting, alive, strict=True)
                if up and not store.check([f"{ARRIVAL_KEY_PREFIX}/{r}"])
            ]
            if not waiting:
                break
            if self._clock() >= deadline:
                logger.warning(
                    "[elastic-ep][nixl] rank %s: ranks %s did not reach the connect within "
                    "%.0f s; connecting anyway",
                    self._rank,
                    waiting,
                    self.arrival_timeout_s,
                )
                break
            self._sleep(ARRIVAL_POLL_S)
        return gone

    def _wait_reconnect_grace(self, ranks: Iterable[int]) -> None:
        # A buffer that gives every process a fresh agent (the CPU buffer) needs no grace.
        grace = getattr(self._buffer, "reconnect_grace_s", self.reconnect_grace_s)
        now = self._clock()
        wait = 0.0
        for r in ranks:
            t = self._disconnected_at.get(r)
            if t is not None:
                wait = max(wait, grace - (now - t))
        if wait > 0:
            logger.info(
                "[elastic-ep][nixl] rank %s: waiting %.1f s before reconnecting %s",
                self._rank,
                wait,
                list(ranks),
            )
            self._sleep(wait)

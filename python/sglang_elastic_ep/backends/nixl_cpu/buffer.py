"""A ``nixl_ep.Buffer`` for CPU: low-latency EP dispatch/combine over real NIXL transfers.

``nixl_ep`` needs a GPU. This class has the interface and semantics SGLang 0.5.23's
``token_dispatcher/nixl.py`` uses from ``nixl_ep.Buffer`` (and nixl_ep's own names as aliases),
and moves host memory between processes with NIXL agents (UCX backend, registered DRAM) — the
same library calls a GPU-less NIXL deployment would make. See ``docs/cpu-data-plane.md``.

* Each rank registers one DRAM region, sized for the maximum number of ranks (layout in
  :mod:`.layout`): one receive slot per source rank for dispatch and for combine, and one send
  staging slot per destination. Membership changes never reallocate.
* ``connect_ranks`` is a two-sided handshake: agent metadata goes through the TCPStore
  (``NIXL_EP_CPU/<rank>``), then each side WRITEs a handshake record to the other with a NIXL
  notification naming the agent it loaded; a pair is connected when both notifications arrived
  and both writes completed.
* ``dispatch`` WRITEs, to every connected unmasked rank, one message with the tokens whose top-k
  experts live there (expert-major, -1 entries skipped, possibly zero rows) and a notification
  carrying a per-pair sequence number; then waits for one message from each of those ranks and
  packs the rows per local expert. ``combine`` sends each source its rows back in the order it
  sent them, and the source reduces them with its top-k weights.
* A peer that fails a transfer (``NIXL_ERR_REMOTE_DISCONNECT`` when its process died) or does
  not answer within ``timeout_ms`` is MASKED: the call returns without its tokens, the mask
  buffer shows it, and nothing is sent to or awaited from it until it is unmasked or
  reconnected.
* Every wait loop polls the agent, and each operation returns only once its own writes
  completed. NIXL's progress thread stays on by default: a UCX-over-TCP write also needs the
  target to progress, and a rank blocked outside the buffer would otherwise stall its peers.

Single-threaded, like the scheduler thread that drives it.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fp8 as fp8_mod
from ._env import configure_ucx_env
from .layout import (
    HEADER_WORDS,
    KIND_COMBINE,
    KIND_DISPATCH,
    MAGIC,
    RegionLayout,
    counts_offset,
    message_bytes,
    payload_offset,
    rdma_size_hint,
    row_bytes_for,
    src_idx_offset,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 30_000
DEFAULT_CONNECT_TIMEOUT_S = 300.0
STORE_KEY_PREFIX = "NIXL_EP_CPU"
# Probe a silent peer (a tiny WRITE) after this long, then this often, so a dead process is
# seen through NIXL's error long before the timeout.
PROBE_AFTER_S = 0.02
PROBE_EVERY_S = 0.05
# Re-read a peer's store key this often while its handshake is missing (a replacement process
# may have published newer metadata than the one loaded).
HANDSHAKE_REFRESH_S = 0.1
# A peer whose published agent refused every handshake write for this long, with no newer key
# in the store, died (a live NIXL agent accepts writes even while its process is busy).
PEER_GONE_S = float(os.environ.get("SGLANG_EEP_NIXL_CPU_PEER_GONE_S", "10"))
KEY_POLL_S = 0.005  # while a peer's key has not appeared yet
MAX_INBOX_PER_AGENT = 64
_TRACE = os.environ.get("SGLANG_EEP_NIXL_CPU_TRACE") == "1"  # print every write and notification


def _trace(fmt: str, *args: Any) -> None:
    if _TRACE:
        print(f"[trace {time.monotonic():.4f} pid {os.getpid()}] " + fmt % args, flush=True)


topk_idx_t = torch.int64

_DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_FP8_CODE = 4

_NOTIF_DISPATCH = b"D"
_NOTIF_COMBINE = b"C"
_NOTIF_BARRIER = b"B"


# --------------------------------------------------------------------------- events and hooks


class _Done:
    """An already-completed event (CPU work is synchronous once the call returned)."""

    def current_stream_wait(self) -> None:
        return None


class EventOverlap:
    """``nixl_ep.utils.EventOverlap`` look-alike: ``current_stream_wait()`` and ``with``."""

    def __init__(self, event: Any = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event if event is not None else _Done()
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        self.event.current_stream_wait()

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        self.event.current_stream_wait()


class RecvHook:
    """The receive hook returned with ``return_recv_hook=True``: calling it completes the
    receive (idempotent). Without the flag a completed no-op hook is returned."""

    def __init__(self, fn: Callable[[], None] | None = None) -> None:
        self._fn = fn

    @property
    def done(self) -> bool:
        return self._fn is None

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


# --------------------------------------------------------------------------- state


@dataclass
class _Peer:
    rank: int
    agent: str
    base_addr: int
    masked: bool = False
    reason: str = ""
    send_seq: dict[bytes, int] = field(default_factory=dict)
    recv_seq: dict[bytes, int] = field(default_factory=dict)
    xfers: list[Any] = field(default_factory=list)
    last_probe: float = 0.0


@dataclass
class DispatchHandle:
    """What ``combine`` needs from ``dispatch`` (opaque to callers, like nixl_ep's handle)."""

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks_layout: int
    num_tokens: int
    x_dtype: torch.dtype
    # Source side: rows sent to each rank, as (token index, top-k slot) in message order.
    send_pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sent_to: list[int] = field(default_factory=list)
    # Expert side: for each source rank, its rows' flat positions in the packed layout
    # ([local experts * ranks * max tokens]), in the source's message order.
    recv_from: dict[int, torch.Tensor] = field(default_factory=dict)
    # nixl_ep-compatible views: token index at the source per packed row, and per
    # (local expert, source rank) ``begin << 32 | count``.
    src_info: torch.Tensor | None = None
    layout_range: torch.Tensor | None = None
    received: bool = False


@dataclass
class _Message:
    counts: torch.Tensor  # int64 [local experts]
    src_idx: torch.Tensor | None  # int64 [rows]
    payload: torch.Tensor  # uint8 [rows, row_bytes] (a view into registered memory or local)


def _nixl_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


WITHDRAWN = b""  # a rank's handshake key once its handshake is over


class _Backoff:
    """Spin briefly, then yield, then sleep up to 1 ms (2 cores are shared by all ranks); a
    wait that has lasted long sleeps longer still. A peer that late is starved or starting up
    (a joiner's first passes after a scale-up take tens of seconds on a loaded 2-core
    machine), and every millisecond this rank polls is taken from it: with the waiting ranks
    polling every 1 ms, a joiner was evicted by Mooncake's heartbeat timeout."""

    LONG_WAIT_S = 0.05
    VERY_LONG_WAIT_S = 1.0

    def __init__(self) -> None:
        self.n = 0
        self.start = time.monotonic()

    def __call__(self) -> None:
        self.n += 1
        if self.n < 8:
            return
        if self.n < 32:
            time.sleep(0)
            return
        waited = time.monotonic() - self.start
        if waited >= self.VERY_LONG_WAIT_S:
            time.sleep(10e-3)
        elif waited >= self.LONG_WAIT_S:
            time.sleep(2e-3)
        else:
            time.sleep(min(1e-3, 2e-5 * (self.n - 31)))


# --------------------------------------------------------------------------- the buffer


def _first_message_grace_s() -> float:
    """Extra wait for a peer's *first* message of a kind after a handshake. A rank admitted by
    scale-up commits during its start-up and enters its first forward only once its scheduler
    runs (tens of seconds on a loaded CPU); it is alive (a dead process is caught at once by the
    probe write), so masking it at the steady-state timeout would drop a healthy new rank."""
    return float(os.environ.get("SGLANG_EEP_NIXL_CPU_FIRST_MESSAGE_GRACE_S", "300"))


def _progress_thread_enabled() -> bool:
    """UCX over TCP needs the *target* to progress for a WRITE to complete. A rank blocked
    outside this buffer (a Mooncake collective, a joiner still finishing its start-up after
    admission) then stalls every peer writing to it until the timeout masks it: seen on the CPU
    cluster right after a scale-up under load. NIXL's progress thread keeps the worker moving in
    the background, sleeping on UCX's event descriptors (``make_nixl_agent``);
    ``SGLANG_EEP_NIXL_CPU_PROGRESS_THREAD=0`` turns it off for single-purpose benchmarks."""
    return os.environ.get("SGLANG_EEP_NIXL_CPU_PROGRESS_THREAD", "1") != "0"


PROGRESS_THREAD_DELAY_US = 1000
_NIXL_CONFIG_LOCK = threading.Lock()


def make_nixl_agent(name: str, progress_thread: bool) -> Any:
    """A UCX NIXL agent whose progress thread sleeps in ``poll`` on UCX's event descriptors
    (waking on traffic, at most ``PROGRESS_THREAD_DELAY_US`` apart) instead of spinning.

    ``nixl._api.nixl_agent`` hard-codes ``pthrDelay = 0``, a busy loop of one core per
    process; measured: 96 % of a core at 0, 1.5 % at 1000 us. The config class is swapped for
    one that keeps our delay for the duration of the constructor.
    """
    from nixl import _api

    base = _api.nixlBind.nixlAgentConfig

    class DelayedProgressConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's field name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _ignored: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, PROGRESS_THREAD_DELAY_US)

    config = _api.nixl_agent_config(
        enable_prog_thread=progress_thread, enable_listen_thread=False, backends=["UCX"]
    )
    with _NIXL_CONFIG_LOCK:
        _api.nixlBind.nixlAgentConfig = DelayedProgressConfig
        try:
            return _api.nixl_agent(name, config)
        finally:
            _api.nixlBind.nixlAgentConfig = base


class Buffer:
    """CPU stand-in for ``nixl_ep.Buffer`` (low-latency mode only).

    Args mirror ``nixl_ep.Buffer``; ``disable_ll_nvlink``, ``group`` and ``comm`` are accepted
    and ignored (there is no NVLink, and metadata always goes through ``tcp_store_group``).

    Args:
        rank: this rank's global EP rank.
        tcp_store_group: the TCPStore used to exchange agent metadata (may be set later with
            :meth:`set_tcp_store_group`).
        timeout_ms: how long dispatch/combine/barrier wait for a peer before masking it.
        connect_timeout_s: how long ``connect_ranks`` waits for a peer (nixl_ep waits 300 s for
            the store key, then raises).
        agent_name: NIXL agent name (default: unique per process incarnation).
    """

    num_sms: int = 20
    # Every process incarnation has its own agent name, so a rank id can be reconnected at once
    # (nixl_ep needs a few seconds between disconnect and reconnect of the same id).
    reconnect_grace_s: float = 0.0

    def __init__(
        self,
        disable_ll_nvlink: bool = False,
        explicitly_destroy: bool = False,
        rank: int = 0,
        low_latency_mode: bool = True,
        group: Any = None,
        comm: Any = None,
        tcp_store_group: Any = None,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        *,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        agent_name: str | None = None,
    ) -> None:
        if not low_latency_mode:
            raise NotImplementedError(
                "the CPU EP buffer implements the low-latency mode only (as SGLang uses it)"
            )
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        configure_ucx_env()

        self.rank = int(rank)
        self.group_size = 0  # set by update_memory_buffers
        self.low_latency_mode = True
        self.timeout_ms = int(timeout_ms)
        self.connect_timeout_s = float(connect_timeout_s)
        self.explicitly_destroy = explicitly_destroy
        self.group = group
        self.comm = comm
        self.tcp_store_group = tcp_store_group
        self.num_rdma_bytes = 0
        self.num_nvl_bytes = 0

        self.agent_name = agent_name or f"nixl-ep-cpu-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent: Any = make_nixl_agent(self.agent_name, _progress_thread_enabled())
        self._mem: torch.Tensor | None = None
        self._reg: Any = None
        self._base = 0
        self._layout: RegionLayout | None = None
        self._peers: dict[int, _Peer] = {}
        self._inbox: dict[str, list[bytes]] = {}
        self._pending_hook: RecvHook | None = None

    # ------------------------------------------------------------------ sizing and memory

    @staticmethod
    def get_low_latency_buffer_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Registered bytes for ``num_ranks`` ranks and ``num_experts`` experts in all."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Alias of :meth:`get_low_latency_buffer_size_hint` (the name SGLang calls)."""
        return rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    def update_memory_buffers(
        self,
        num_ranks: int,
        num_experts_per_rank: int,
        num_rdma_bytes: int,
        num_nvl_bytes: int = 0,
    ) -> None:
        """Allocate and register the region for ``num_ranks`` (the MAXIMUM EP size).

        Calling it again with the same sizes does nothing; other sizes are refused once ranks
        are connected (scaling never reallocates).
        """
        layout = RegionLayout(int(num_ranks), int(num_experts_per_rank), int(num_rdma_bytes))
        if self.rank >= layout.num_ranks:
            raise ValueError(f"rank {self.rank} outside the buffer's {num_ranks} ranks")
        if self._layout is not None:
            if layout == self._layout:
                return
            if self._peers:
                raise RuntimeError(
                    "update_memory_buffers with new sizes while ranks are connected; the buffer "
                    "is sized once for the maximum EP size"
                )
            self._release_memory()
        mem = torch.zeros(layout.num_bytes, dtype=torch.uint8)
        self._reg = self._agent.register_memory(mem)
        self._mem = mem
        self._base = mem.data_ptr()
        self._layout = layout
        self.group_size = layout.num_ranks
        self.num_rdma_bytes = layout.num_bytes
        self.num_nvl_bytes = int(num_nvl_bytes)

    def set_tcp_store_group(self, tcp_store_group: Any) -> None:
        self.tcp_store_group = tcp_store_group

    def _release_memory(self) -> None:
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                logger.debug("deregister_memory failed: %s", exc)
        self._reg = None
        self._mem = None
        self._layout = None

    def destroy(self) -> None:
        """Disconnect every peer, deregister memory and drop the agent (also without
        ``explicitly_destroy``, unlike nixl_ep which asserts it)."""
        if self._agent is None:
            return
        self.disconnect_ranks(list(self._peers))
        self._release_memory()
        self._agent = None

    # ------------------------------------------------------------------ introspection

    @property
    def layout(self) -> RegionLayout:
        if self._layout is None:
            raise RuntimeError("call update_memory_buffers(...) first")
        return self._layout

    @property
    def connected_ranks(self) -> list[int]:
        """Remote ranks currently connected (masked or not)."""
        return sorted(self._peers)

    def peer_agent_name(self, rank: int) -> str | None:
        peer = self._peers.get(rank)
        return peer.agent if peer is not None else None

    def mask_reasons(self) -> dict[int, str]:
        """Why each masked connected rank is masked (a NIXL error, a timeout, the caller)."""
        return {r: p.reason for r, p in self._peers.items() if p.masked}

    def mask_status(self) -> torch.Tensor:
        """``[group_size]`` int32: 1 for masked or unconnected ranks, 0 for live ones and self."""
        status = torch.ones(self.group_size, dtype=torch.int32)
        if self.rank < self.group_size:
            status[self.rank] = 0
        for r, p in self._peers.items():
            if not p.masked:
                status[r] = 0
        return status

    # ------------------------------------------------------------------ mask buffer

    def update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank. The local rank cannot be masked; unmasking
        needs a connected rank."""
        rank_to_mask = int(rank_to_mask)
        if rank_to_mask == self.rank:
            if mask:
                raise ValueError("the local rank cannot be masked")
            return
        peer = self._peers.get(rank_to_mask)
        if peer is None:
            if not mask:
                raise ValueError(f"rank {rank_to_mask} is not connected; it cannot be unmasked")
            return
        if mask:
            self._mask(peer, "masked by update_mask_buffer")
        else:
            peer.masked = False
            peer.reason = ""

    def query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask (1 = masked or unconnected) into ``mask_status`` (any length/dtype)."""
        status = self.mask_status()
        n = min(int(mask_status.numel()), int(status.numel()))
        mask_status.view(-1)[:n].copy_(status[:n])

    def clean_mask_buffer(self) -> None:
        """Unmask connected ranks (and the local rank); unconnected ranks stay masked."""
        for peer in self._peers.values():
            peer.masked = False
            peer.reason = ""

    def clean_buffer(self, *args: Any, **kwargs: Any) -> None:
        """SGLang's ``NixlEPBuffer.clean_buffer`` calls this; nothing stale can be read (every
        message carries a checked sequence number), so only pending receives are finished."""
        self._finish_pending()

    def clean_low_latency_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._finish_pending()

    # ------------------------------------------------------------------ connections

    def _store_key(self, rank: int) -> str:
        return f"{STORE_KEY_PREFIX}/{rank}"

    def _local_info(self) -> bytes:
        return pickle.dumps(
            {
                "rank": self.rank,
                "agent": self.agent_name,
                "md": self._agent.get_agent_metadata(),
                "base": self._base,
                "fingerprint": self.layout.fingerprint(),
            }
        )

    def _load_peer(self, rank: int, info: dict[str, Any]) -> _Peer:
        if tuple(info["fingerprint"]) != self.layout.fingerprint():
            raise RuntimeError(
                f"rank {rank} sized its buffer as {tuple(info['fingerprint'])}, this rank as "
                f"{self.layout.fingerprint()} (num_ranks, experts per rank, bytes): every rank "
                "must call update_memory_buffers with the same sizes"
            )
        old = self._peers.pop(rank, None)
        if old is not None:
            if old.agent != info["agent"]:
                self._forget_agent(old)
            else:
                self._release_xfers(old)
        if old is None or old.agent != info["agent"]:
            name = self._agent.add_remote_agent(info["md"])
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != info["agent"]:
                raise RuntimeError(f"rank {rank}: metadata names agent {name}, key {info['agent']}")
        peer = _Peer(rank=rank, agent=info["agent"], base_addr=int(info["base"]))
        self._peers[rank] = peer
        return peer

    def _forget_agent(self, peer: _Peer) -> None:
        self._release_xfers(peer)
        try:
            self._agent.remove_remote_agent(peer.agent)
        except Exception as exc:  # noqa: BLE001 - the agent may already be gone
            logger.debug("remove_remote_agent(%s): %s", peer.agent, exc)
        self._inbox.pop(peer.agent, None)

    def connect_ranks(self, remote_ranks: Iterable[int], activate: bool = True) -> None:
        """Connect to ``remote_ranks`` (this rank is filtered out): a two-sided handshake, so
        every named rank must call ``connect_ranks`` naming this rank at about the same time.

        A rank already connected is reconnected (a new process in its slot is picked up).
        With ``activate=False`` the new ranks stay masked until ``update_mask_buffer(r, False)``.
        Raises ``TimeoutError`` after ``connect_timeout_s`` without a handshake.
        """
        layout = self.layout
        ranks = sorted({int(r) for r in remote_ranks} - {self.rank})
        for r in ranks:
            if not 0 <= r < layout.num_ranks:
                raise ValueError(f"rank {r} outside the buffer's {layout.num_ranks} ranks")
        store = self.tcp_store_group
        if store is None:
            raise RuntimeError("TCPStore group is not set (set_tcp_store_group)")
        self._finish_pending()
        my_key = self._store_key(self.rank)
        store.set(my_key, self._local_info())
        try:
            gone = self._handshake(store, ranks, time.monotonic() + self.connect_timeout_s)
        finally:
            # Withdrawn with an empty value, never deleted: a peer that saw the key in
            # ``check`` and then calls ``get`` would block forever on a deleted key
            # (TCPStore.get waits for missing keys). Seen: a joiner hung in its first
            # dispatch right after the others finished their handshake with it.
            try:
                store.set(my_key, WITHDRAWN)
            except Exception as exc:  # noqa: BLE001 - the store may be going away
                logger.debug("withdraw %s: %s", my_key, exc)
        for r in ranks:
            if r in gone:
                continue
            peer = self._peers[r]
            peer.masked = not activate
            peer.reason = "" if activate else "connected with activate=False"
        logger.debug("rank %d connected %s (agent %s)", self.rank, ranks, self.agent_name)

    def _handshake(self, store: Any, ranks: list[int], deadline: float) -> set[int]:
        """Handshake with ``ranks``; returns those found dead meanwhile (masked, not waited
        for: a joiner killed during its first handshake must not hang the others, who learn
        of the death from Mooncake at their next collective)."""
        layout = self.layout
        loaded: dict[int, str] = {}  # rank -> agent whose metadata is loaded
        sent: dict[int, str] = {}  # rank -> agent our handshake write went to
        failed_at: dict[int, float] = {}  # rank -> when our handshake write last failed
        failing_since: dict[int, float] = {}  # rank -> first failed write to its current agent
        gone: set[int] = set()
        acked: set[int] = set()  # the peer's handshake naming our agent arrived
        last_read: dict[int, float] = {}
        waiting = set(ranks)
        backoff = _Backoff()
        me = self.agent_name.encode()
        while True:
            now = time.monotonic()
            for r in sorted(waiting):
                # (Re)read the peer's key: at first, and while its handshake is missing (a
                # replacement process may have published newer metadata).
                every = HANDSHAKE_REFRESH_S if r in loaded or r in failing_since else KEY_POLL_S
                if r not in acked and now - last_read.get(r, -1e9) >= every:
                    last_read[r] = now
                    key = self._store_key(r)
                    raw = store.get(key) if store.check([key]) else WITHDRAWN
                    if raw != WITHDRAWN:
                        info = pickle.loads(raw)
                        if loaded.get(r) != info["agent"]:
                            try:
                                loaded[r] = self._load_peer(r, info).agent
                            except Exception as exc:  # noqa: BLE001 - NIXL raises per code
                                # Its agent is unreachable: it died after publishing its key.
                                failing_since.setdefault(r, now)
                                logger.debug("rank %d: loading rank %d failed: %s",
                                             self.rank, r, exc)
                            else:
                                sent.pop(r, None)
                                failed_at.pop(r, None)
                                failing_since.pop(r, None)
                                acked.discard(r)
                if now - failing_since.get(r, now) >= PEER_GONE_S:
                    waiting.discard(r)
                    gone.add(r)
                    reason = (f"rank {r} refused the handshake for {PEER_GONE_S:g} s: the "
                              "process died")
                    if r in self._peers:
                        self._mask(self._peers[r], reason)
                    else:  # never loaded: unconnected ranks read as masked anyway
                        logger.warning("rank %d: %s", self.rank, reason)
                    continue
                peer = self._peers.get(r)
                if peer is None or loaded.get(r) != peer.agent:
                    continue
                if (
                    sent.get(r) != peer.agent
                    and now - failed_at.get(r, -1e9) >= HANDSHAKE_REFRESH_S
                ):
                    self._release_xfers(peer)
                    notif = b"H|%d|%s" % (self.rank, peer.agent.encode())
                    if self._post(
                        peer, layout.ctrl_send(), layout.ctrl_recv(self.rank), 8, notif,
                        mask_on_error=False,
                    ):
                        sent[r] = peer.agent
                    else:
                        failed_at[r] = now
                        failing_since.setdefault(r, now)
                if r not in acked and self._take_handshake(peer, me):
                    acked.add(r)
                if r in sent and not self._check_xfers(peer, mask_on_error=False):
                    # The write failed (a stale agent?): retry after the next key read.
                    sent.pop(r, None)
                    failed_at[r] = now
                    failing_since.setdefault(r, now)
                elif r in sent and not peer.xfers:
                    failing_since.pop(r, None)
                    if r not in acked and now - peer.last_probe >= PROBE_EVERY_S:
                        # Our handshake arrived but none came back yet: a live agent takes
                        # this tiny write, a dead one fails it.
                        peer.last_probe = now
                        if not self._post(peer, layout.ctrl_send(), layout.ctrl_recv(self.rank),
                                          8, b"", mask_on_error=False):
                            failing_since.setdefault(r, now)
                if r in acked and r in sent and not peer.xfers:
                    waiting.discard(r)
            if not waiting:
                break
            self._poll(skip=waiting)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"connect_ranks: rank {self.rank} got no handshake from ranks "
                    f"{sorted(waiting)} within {self.connect_timeout_s:.0f} s (every rank "
                    "named must call connect_ranks with this rank at about the same time)"
                )
            backoff()
        for r in ranks:
            if r in gone:
                continue
            peer = self._peers[r]
            peer.send_seq.clear()
            peer.recv_seq.clear()
        return gone

    def _take_handshake(self, peer: _Peer, my_agent: bytes) -> bool:
        """Find the peer's handshake naming our agent. Notifications are FIFO per sender and a
        peer sends data only after its handshake, so what precedes it is from an older
        session and is dropped."""
        msgs = self._inbox.get(peer.agent)
        if not msgs:
            return False
        for i in range(len(msgs) - 1, -1, -1):
            parts = msgs[i].split(b"|")
            if parts[0] == b"H" and len(parts) == 3 and parts[2] == my_agent:
                self._inbox[peer.agent] = [m for m in msgs[i + 1 :] if not m.startswith(b"H|")]
                return True
        return False

    def disconnect_ranks(self, remote_ranks: Iterable[int]) -> None:
        """Drop the connections to ``remote_ranks`` (one-sided; no handshake).

        nixl_ep requires them to be the tail of the connected ranks; this buffer accepts any
        connected ranks and ignores unknown ones.
        """
        self._finish_pending()
        for r in sorted({int(r) for r in remote_ranks} - {self.rank}):
            peer = self._peers.pop(r, None)
            if peer is None:
                continue
            self._forget_agent(peer)
            logger.debug("rank %d disconnected rank %d (agent %s)", self.rank, r, peer.agent)

    # ------------------------------------------------------------------ transfers

    def _poll(self, skip: set[int] | frozenset[int] = frozenset()) -> None:
        """Progress: reap EVERY outstanding write (except to ``skip`` ranks, whose caller does
        it) and collect notifications. A write is only driven when its status is checked (no
        progress thread), and a peer may be waiting for our write to a third rank: checking
        only the peers we wait for deadlocked a cycle of 3 ranks on UCX/TCP."""
        for r, peer in list(self._peers.items()):
            if peer.xfers and r not in skip:
                self._check_xfers(peer)
        new = self._agent.get_new_notifs()
        if new and _TRACE:
            _trace("rank %d notifs %s", self.rank, new)
        for name, msgs in new.items():
            box = self._inbox.setdefault(name, [])
            box.extend(msgs)
            if len(box) > MAX_INBOX_PER_AGENT:
                del box[: len(box) - MAX_INBOX_PER_AGENT]

    def _post(
        self,
        peer: _Peer,
        local_off: int,
        remote_off: int,
        nbytes: int,
        notif: bytes,
        *,
        mask_on_error: bool = True,
    ) -> bool:
        """WRITE ``nbytes`` of our region at ``local_off`` to the peer's region at
        ``remote_off``, with notification ``notif`` (none if empty)."""
        agent = self._agent
        try:
            local = agent.get_xfer_descs([(self._base + local_off, nbytes, 0)], "DRAM")
            remote = agent.get_xfer_descs([(peer.base_addr + remote_off, nbytes, 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, remote, peer.agent, notif)
            state = agent.transfer(handle)
        except Exception as exc:  # noqa: BLE001 - NIXL raises per error code
            if mask_on_error:
                self._mask(peer, _nixl_error(exc))
            return False
        _trace("rank %d post -> %d %r %d B: %s", self.rank, peer.rank, notif, nbytes, state)
        if state == "ERR":
            self._release(handle)
            if mask_on_error:
                self._mask(peer, "NIXL transfer returned ERR")
            return False
        peer.xfers.append(handle)
        return True

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception as exc:  # noqa: BLE001 - cannot cancel: NIXL keeps it in its leak list
            logger.debug("release xfer: %s", exc)

    def _release_xfers(self, peer: _Peer) -> None:
        for h in peer.xfers:
            self._release(h)
        peer.xfers.clear()

    def _check_xfers(self, peer: _Peer, *, mask_on_error: bool = True) -> bool:
        """Reap the peer's finished writes; False if one failed (and mask it if asked)."""
        failed: str | None = None
        still = []
        for h in peer.xfers:
            try:
                state = self._agent.check_xfer_state(h)
                reason = "NIXL transfer state ERR"
            except Exception as exc:  # noqa: BLE001 - NIXL raises per error code
                state, reason = "ERR", _nixl_error(exc)
            if state == "DONE":
                _trace("rank %d xfer -> %d DONE", self.rank, peer.rank)
                self._release(h)
            elif state == "ERR":
                self._release(h)
                failed = reason
            else:
                still.append(h)
        peer.xfers[:] = still
        if failed is not None and mask_on_error:
            self._mask(peer, failed)
        return failed is None

    def _probe(self, peer: _Peer, now: float) -> None:
        """A tiny WRITE to a silent peer whose earlier writes all completed: a dead process
        fails it (NIXL_ERR_REMOTE_DISCONNECT) instead of leaving us to the timeout."""
        if peer.xfers or now - peer.last_probe < PROBE_EVERY_S:
            return
        peer.last_probe = now
        layout = self.layout
        self._post(peer, layout.ctrl_send(), layout.ctrl_recv(self.rank), 8, b"")

    def _mask(self, peer: _Peer, reason: str) -> None:
        if not peer.masked:
            logger.warning("rank %d masks rank %d: %s", self.rank, peer.rank, reason)
        peer.masked = True
        peer.reason = reason
        self._release_xfers(peer)

    def _take(self, peer: _Peer, tag: bytes) -> int | None:
        """Consume the peer's next notification ``tag|seq``; stale sequence numbers are
        dropped, a jump ahead is accepted (with a warning)."""
        msgs = self._inbox.get(peer.agent)
        if not msgs:
            return None
        expected = peer.recv_seq.get(tag, 0) + 1
        for i, m in enumerate(msgs):
            if not m.startswith(tag + b"|"):
                continue
            seq = int(m[len(tag) + 1 :])
            if seq < expected:
                logger.debug("rank %d: dropping stale %r from rank %d (expected seq %d)",
                             self.rank, m, peer.rank, expected)
                msgs.pop(i)
                return self._take(peer, tag)
            msgs.pop(i)
            if seq > expected:
                logger.warning(
                    "rank %d: rank %d %s seq %d, expected %d (messages were skipped)",
                    self.rank, peer.rank, tag.decode(), seq, expected,
                )
            peer.recv_seq[tag] = seq
            return seq
        return None

    def _wait(self, tag: bytes, peers: Sequence[_Peer], deadline: float) -> dict[int, int]:
        """Wait for one ``tag`` notification from each peer; mask the ones that fail or stay
        silent past ``deadline``. Returns rank -> sequence number of what arrived."""
        got: dict[int, int] = {}
        waiting = {p.rank: p for p in peers if not p.masked}
        start = time.monotonic()
        backoff = _Backoff()
        while waiting:
            self._poll()
            now = time.monotonic()
            for r, peer in list(waiting.items()):
                seq = self._take(peer, tag)
                if seq is not None:
                    got[r] = seq
                    del waiting[r]
                    continue
                if not peer.masked and now - start >= PROBE_AFTER_S:
                    self._probe(peer, now)
                if peer.masked:
                    del waiting[r]
            if not waiting:
                break
            late = {
                r: peer for r, peer in waiting.items()
                if now >= deadline + (_first_message_grace_s() if not peer.recv_seq.get(tag)
                                      else 0.0)
            }
            if late:
                for r in late:
                    del waiting[r]
                for peer in late.values():
                    logger.warning(
                        "rank %d: no %s from rank %d (agent %s): expected seq %d, pending "
                        "notifications %s, writes in flight %d",
                        self.rank, tag.decode(), peer.rank, peer.agent,
                        peer.recv_seq.get(tag, 0) + 1, self._inbox.get(peer.agent, [])[-8:],
                        len(peer.xfers),
                    )
                    self._mask(
                        peer, f"timeout: no {tag.decode()} message within {self.timeout_ms} ms"
                    )
                if not waiting:
                    break
            backoff()
        return got

    def _flush(self, peers: Iterable[_Peer], deadline: float) -> None:
        """Wait until our writes to ``peers`` completed (so this rank may go idle)."""
        pending = [p for p in peers if p.xfers and not p.masked]
        backoff = _Backoff()
        while pending:
            self._poll()
            pending = [p for p in pending if p.xfers and not p.masked]
            if not pending:
                break
            if time.monotonic() >= deadline:
                for peer in pending:
                    self._mask(peer, f"timeout: write not completed within {self.timeout_ms} ms")
                break
            backoff()

    def _finish_pending(self) -> None:
        hook, self._pending_hook = self._pending_hook, None
        if hook is not None:
            hook()

    def _live_peers(self, num_ranks_layout: int) -> list[_Peer]:
        return [
            p for r, p in sorted(self._peers.items()) if not p.masked and r < num_ranks_layout
        ]

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_ms / 1000.0

    # ------------------------------------------------------------------ messages

    def _write_message(
        self,
        off: int,
        kind: int,
        seq: int,
        dtype_code: int,
        counts: torch.Tensor,
        src_idx: torch.Tensor | None,
        payload: torch.Tensor,
        what: str,
    ) -> int:
        mem = self._mem
        assert mem is not None
        n, row_bytes = int(payload.shape[0]), int(payload.shape[1])
        e = int(counts.numel())
        nbytes = message_bytes(n, row_bytes, e, src_idx is not None)
        self.layout.check_fits(nbytes, what)
        header = torch.tensor(
            [MAGIC, seq, kind, self.rank, n, dtype_code, row_bytes, e], dtype=torch.int64
        )
        mem[off : off + 8 * HEADER_WORDS].copy_(header.view(torch.uint8))
        co = off + counts_offset()
        mem[co : co + 4 * e].copy_(counts.to(torch.int32).view(torch.uint8))
        if src_idx is not None:
            so = off + src_idx_offset(e)
            mem[so : so + 4 * n].copy_(src_idx.to(torch.int32).view(torch.uint8))
        po = off + payload_offset(n, e, src_idx is not None)
        if n:
            mem[po : po + n * row_bytes].view(n, row_bytes).copy_(payload)
        return nbytes

    def _read_message(
        self, off: int, kind: int, seq: int, src_rank: int, with_src_idx: bool
    ) -> tuple[_Message, int, int] | str:
        """Parse the message in our region at ``off``; returns (message, dtype code, row
        bytes) or a reason string if the header does not match what was announced."""
        mem = self._mem
        assert mem is not None
        header = mem[off : off + 8 * HEADER_WORDS].view(torch.int64).tolist()
        magic, h_seq, h_kind, h_src, n, code, row_bytes, e = header
        if magic != MAGIC or h_kind != kind or h_src != src_rank or h_seq != seq:
            return (
                f"bad message header from rank {src_rank}: seq {h_seq} (notified {seq}), "
                f"kind {h_kind}, src {h_src}"
            )
        if e != self.layout.num_experts_per_rank:
            return f"rank {src_rank} sent {e} local experts, this buffer has " \
                f"{self.layout.num_experts_per_rank}"
        co = off + counts_offset()
        counts = mem[co : co + 4 * e].view(torch.int32).to(torch.int64)
        src_idx = None
        if with_src_idx:
            so = off + src_idx_offset(e)
            src_idx = mem[so : so + 4 * n].view(torch.int32).to(torch.int64)
        po = off + payload_offset(n, e, with_src_idx)
        payload = mem[po : po + n * row_bytes].view(n, row_bytes)
        return _Message(counts, src_idx, payload), code, row_bytes

    # ------------------------------------------------------------------ dispatch

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, DispatchHandle, EventOverlap, RecvHook]:
        """Send each token to the ranks owning its top-k experts; receive and pack per local
        expert.

        Returns ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is
        ``[local experts, ranks * max tokens, hidden]`` in ``x``'s dtype, or with ``use_fp8``
        a tuple of that in float8_e4m3fn and the float32 scales ``[..., hidden / 128]``
        (column-major in the last two dims, as nixl_ep). Only the first ``recv_count[e]`` rows
        of expert ``e`` are meaningful: rows from source rank 0 first, then 1, ..., each in
        token order. ``ranks`` is ``num_experts / num_experts_per_rank`` (default: the buffer's
        maximum). With ``return_recv_hook`` the receive happens when the hook is called.
        ``dispatch_wait_recv_cost_stats`` is accepted and left untouched.
        """
        layout = self.layout
        self._finish_pending()
        local_e = layout.num_experts_per_rank
        t_max = int(num_max_dispatch_tokens_per_rank)
        if num_experts is None:
            num_experts = local_e * self.group_size
        num_experts = int(num_experts)
        if num_experts % local_e or not 0 < num_experts // local_e <= self.group_size:
            raise ValueError(
                f"num_experts={num_experts} must be a multiple of {local_e} experts per rank "
                f"covering at most {self.group_size} ranks"
            )
        r_layout = num_experts // local_e
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"x [tokens, hidden] and topk_idx [tokens, k] expected, got "
                             f"{tuple(x.shape)} and {tuple(topk_idx.shape)}")
        if x.device.type != "cpu":
            raise ValueError("the CPU EP buffer takes CPU tensors")
        n_tok, hidden = int(x.shape[0]), int(x.shape[1])
        if n_tok > t_max:
            raise ValueError(f"{n_tok} tokens exceed num_max_dispatch_tokens_per_rank={t_max}")
        if x.dtype not in _DTYPE_CODES:
            raise TypeError(f"unsupported x dtype {x.dtype} (float32, bfloat16, float16)")
        if use_ue8m0:
            raise NotImplementedError(
                "use_ue8m0 (packed UE8M0 scales for Blackwell DeepGEMM) is not supported by the "
                "CPU EP buffer; use round_scale alone or a bf16 dispatch"
            )
        if use_fp8:
            fp8_mod.check_fp8_hidden(hidden)
        k = int(topk_idx.shape[1])

        # Route: (token, slot) pairs to live ranks, sorted expert-major then token.
        flat = topk_idx.reshape(-1).to(torch.int64)
        if flat.numel() and int(flat.max()) >= num_experts:
            raise ValueError(f"topk_idx has expert {int(flat.max())} >= num_experts {num_experts}")
        if k > 1 and n_tok:
            ordered = topk_idx.to(torch.int64).sort(dim=1).values
            if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
                raise ValueError("a token selects the same expert twice in topk_idx")
        live = self._live_peers(r_layout)
        allowed = torch.zeros(r_layout, dtype=torch.bool)
        for p in live:
            allowed[p.rank] = True
        if self.rank < r_layout:
            allowed[self.rank] = True
        valid = flat >= 0
        dest = torch.where(valid, flat // local_e, torch.zeros_like(flat))
        valid &= allowed[dest]
        pair = valid.nonzero().squeeze(1)
        experts = flat[pair]
        order = torch.argsort(experts * (n_tok * k + 1) + pair)
        pair, experts = pair[order], experts[order]
        tok, slot = pair // k, pair % k
        counts = torch.bincount(experts, minlength=num_experts)
        bounds = [0] + torch.cumsum(counts.view(r_layout, local_e).sum(1), 0).tolist()

        code = _FP8_CODE if use_fp8 else _DTYPE_CODES[x.dtype]
        row_bytes = row_bytes_for(hidden, x.element_size(), use_fp8)
        if n_tok == 0:  # (byte views of empty tensors can have odd strides)
            rows = torch.empty(0, row_bytes, dtype=torch.uint8)
        elif use_fp8:
            q, scales = fp8_mod.quantize(x, round_scale=round_scale)
            rows = torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        else:
            rows = x.contiguous().view(torch.uint8).reshape(n_tok, row_bytes)
        payload = rows[tok]

        handle = DispatchHandle(t_max, hidden, r_layout, n_tok, x.dtype)
        local_msg: _Message | None = None
        for r in range(r_layout):
            if not allowed[r]:
                continue
            sl = slice(bounds[r], bounds[r + 1])
            handle.send_pairs[r] = (tok[sl], slot[sl])
            rcounts = counts[r * local_e : (r + 1) * local_e]
            if r == self.rank:
                local_msg = _Message(rcounts, tok[sl], payload[sl])
                continue
            peer = self._peers[r]
            seq = peer.send_seq.get(_NOTIF_DISPATCH, 0) + 1
            off = layout.dispatch_send(r)
            nbytes = self._write_message(
                off, KIND_DISPATCH, seq, code, rcounts, tok[sl], payload[sl],
                f"dispatch to rank {r}",
            )
            if self._post(peer, off, layout.dispatch_recv(self.rank), nbytes,
                          b"D|%d" % seq):
                peer.send_seq[_NOTIF_DISPATCH] = seq
                handle.sent_to.append(r)

        # Receive side tensors (filled by the hook).
        rt = r_layout * t_max
        if use_fp8:
            recv_q = torch.zeros(local_e, rt, hidden, dtype=fp8_mod.FP8_DTYPE)
            recv_s = torch.zeros(local_e, hidden // fp8_mod.GROUP, rt, dtype=torch.float32)
            recv_x: Any = (recv_q, recv_s.transpose(1, 2))
        else:
            recv_x = torch.zeros(local_e, rt, hidden, dtype=x.dtype)
        recv_count = torch.zeros(local_e, dtype=torch.int32)

        def receive() -> None:
            self._pending_hook = None
            self._receive_dispatch(
                handle, live, local_msg, code, row_bytes, recv_x, recv_count
            )
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(
                    recv_count.to(cumulative_local_expert_recv_stats.dtype)
                )

        hook = RecvHook(receive)
        if return_recv_hook:
            self._pending_hook = hook
            return recv_x, recv_count, handle, EventOverlap(), hook
        hook()
        return recv_x, recv_count, handle, EventOverlap(), RecvHook()

    def _receive_dispatch(
        self,
        handle: DispatchHandle,
        live: list[_Peer],
        local_msg: _Message | None,
        code: int,
        row_bytes: int,
        recv_x: Any,
        recv_count: torch.Tensor,
    ) -> None:
        layout = self.layout
        t_max, hidden = handle.num_max_dispatch_tokens_per_rank, handle.hidden
        r_layout = handle.num_ranks_layout
        rt = r_layout * t_max
        deadline = self._deadline()
        got = self._wait(_NOTIF_DISPATCH, live, deadline)
        msgs: dict[int, _Message] = {}
        if local_msg is not None:
            msgs[self.rank] = local_msg
        for r, seq in got.items():
            parsed = self._read_message(layout.dispatch_recv(r), KIND_DISPATCH, seq, r, True)
            if isinstance(parsed, str):
                self._mask(self._peers[r], parsed)
                continue
            msg, r_code, r_row_bytes = parsed
            if r_code != code or r_row_bytes != row_bytes:
                raise RuntimeError(
                    f"rank {r} dispatched dtype code {r_code} rows of {r_row_bytes} B, this rank "
                    f"{code} / {row_bytes} B: every rank must dispatch the same dtype and hidden"
                )
            n = int(msg.payload.shape[0])
            if int(msg.counts.sum()) != n or bool((msg.counts > t_max).any()):
                self._mask(self._peers[r], f"rank {r} sent {n} rows for counts {msg.counts}")
                continue
            msgs[r] = msg

        local_e = layout.num_experts_per_rank
        counts = torch.zeros(r_layout, local_e, dtype=torch.int64)
        for r, msg in msgs.items():
            counts[r] = msg.counts
        begins = torch.cumsum(counts, 0) - counts  # [ranks, experts]: rows before rank r
        src_info = torch.full((local_e, rt), -1, dtype=torch.int32)
        expert_ids = torch.arange(local_e)
        fp8 = code == _FP8_CODE
        if fp8:
            q_flat = recv_x[0].view(local_e * rt, hidden)
            s_flat = recv_x[1]  # [E, rt, G] (transposed view)
        else:
            x_flat = recv_x.view(local_e * rt, hidden)
        for r in sorted(msgs):
            msg = msgs[r]
            n = int(msg.payload.shape[0])
            if n == 0:
                handle.recv_from[r] = torch.empty(0, dtype=torch.int64)
                continue
            e_of_row = torch.repeat_interleave(expert_ids, msg.counts)
            first_of_e = torch.cumsum(msg.counts, 0) - msg.counts
            within = torch.arange(n) - first_of_e[e_of_row]
            pos = e_of_row * rt + begins[r][e_of_row] + within
            if fp8:
                q_flat[pos] = msg.payload[:, :hidden].contiguous().view(fp8_mod.FP8_DTYPE)
                scales = msg.payload[:, hidden:].contiguous().view(torch.float32)
                s_flat[e_of_row, begins[r][e_of_row] + within] = scales
            else:
                x_flat[pos] = msg.payload.contiguous().view(recv_x.dtype).view(n, hidden)
            assert msg.src_idx is not None
            src_info.view(-1)[pos] = msg.src_idx.to(torch.int32)
            handle.recv_from[r] = pos
        recv_count.copy_(counts.sum(0).to(torch.int32))
        handle.src_info = src_info
        handle.layout_range = ((begins << 32) | counts).t().contiguous()
        handle.received = True
        self._flush([self._peers[r] for r in handle.sent_to], deadline)

    # ------------------------------------------------------------------ combine

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: DispatchHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, RecvHook]:
        """Send expert outputs back to their source ranks; each source returns
        ``sum_k topk_weights[t, k] * expert_k(x_t)`` over the experts that were reached.

        ``x`` is ``[local experts, ranks * max tokens, hidden]`` (the dispatch layout). The
        result ``[tokens, hidden]`` has the dispatched ``x``'s dtype (or ``out``'s).
        """
        if use_logfmt:
            raise NotImplementedError("use_logfmt is not supported by the CPU EP buffer")
        if zero_copy:
            raise NotImplementedError("zero_copy is not supported by the CPU EP buffer")
        if not handle.received:
            self._finish_pending()
        if not handle.received:
            raise RuntimeError("combine before the dispatch receive completed")
        self._finish_pending()
        layout = self.layout
        local_e = layout.num_experts_per_rank
        rt = handle.num_ranks_layout * handle.num_max_dispatch_tokens_per_rank
        hidden = handle.hidden
        if tuple(x.shape) != (local_e, rt, hidden):
            raise ValueError(f"x must be [{local_e}, {rt}, {hidden}], got {tuple(x.shape)}")
        if x.dtype not in _DTYPE_CODES:
            raise TypeError(f"unsupported combine dtype {x.dtype}")
        code = _DTYPE_CODES[x.dtype]
        x_flat = x.reshape(local_e * rt, hidden)
        local_rows: torch.Tensor | None = None
        sent: list[_Peer] = []
        for r, pos in handle.recv_from.items():
            rows = x_flat[pos] if pos.numel() else x_flat.new_empty(0, hidden)
            if r == self.rank:
                local_rows = rows
                continue
            peer = self._peers.get(r)
            if peer is None or peer.masked:
                continue
            seq = peer.send_seq.get(_NOTIF_COMBINE, 0) + 1
            off = layout.combine_send(r)
            e_counts = torch.zeros(local_e, dtype=torch.int64)
            nbytes = self._write_message(
                off, KIND_COMBINE, seq, code, e_counts, None,
                rows.contiguous().view(torch.uint8).reshape(
                    rows.shape[0], rows.shape[-1] * rows.element_size()
                ),
                f"combine to rank {r}",
            )
            if self._post(peer, off, layout.combine_recv(self.rank), nbytes, b"C|%d" % seq):
                peer.send_seq[_NOTIF_COMBINE] = seq
                sent.append(peer)

        n_tok = handle.num_tokens
        result = out if out is not None else torch.empty(n_tok, hidden, dtype=handle.x_dtype)
        expect = [self._peers[r] for r in handle.sent_to if r in self._peers]

        def receive() -> None:
            self._pending_hook = None
            deadline = self._deadline()
            got = self._wait(_NOTIF_COMBINE, expect, deadline)
            acc = torch.zeros(n_tok, hidden, dtype=torch.float32)
            weights = topk_weights.to(torch.float32)

            def reduce(r: int, rows: torch.Tensor) -> None:
                tok, slot = handle.send_pairs[r]
                if rows.shape[0] != tok.numel():
                    self._mask(self._peers[r], f"rank {r} combined {rows.shape[0]} rows, "
                               f"{tok.numel()} were sent")
                    return
                if tok.numel():
                    acc.index_add_(0, tok, rows.float() * weights[tok, slot].unsqueeze(1))

            if local_rows is not None:
                reduce(self.rank, local_rows)
            for r, seq in got.items():
                parsed = self._read_message(layout.combine_recv(r), KIND_COMBINE, seq, r, False)
                if isinstance(parsed, str):
                    self._mask(self._peers[r], parsed)
                    continue
                msg, r_code, r_row_bytes = parsed
                if r_code not in _CODE_DTYPES or r_row_bytes % hidden:
                    self._mask(self._peers[r], f"rank {r} combined dtype code {r_code}")
                    continue
                dtype = _CODE_DTYPES[r_code]
                n = msg.payload.shape[0]
                rows = (msg.payload.contiguous().view(dtype).view(n, hidden) if n
                        else torch.empty(0, hidden, dtype=dtype))
                reduce(r, rows)
            result.copy_(acc)
            self._flush(sent, deadline)

        hook = RecvHook(receive)
        if return_recv_hook:
            self._pending_hook = hook
            return result, EventOverlap(), hook
        hook()
        return result, EventOverlap(), RecvHook()

    # SGLang 0.5.23 calls ``dispatch`` / ``combine``; nixl_ep names them ``low_latency_*``.
    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        return self.low_latency_dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        return self.low_latency_combine(*args, **kwargs)

    # ------------------------------------------------------------------ barrier

    def barrier(self) -> None:
        """Barrier over the connected unmasked ranks; a rank that does not arrive within the
        timeout is masked (as nixl_ep's)."""
        self._finish_pending()
        layout = self.layout
        peers = [p for _, p in sorted(self._peers.items()) if not p.masked]
        for peer in peers:
            seq = peer.send_seq.get(_NOTIF_BARRIER, 0) + 1
            if self._post(peer, layout.ctrl_send(), layout.ctrl_recv(self.rank), 8,
                          b"B|%d" % seq):
                peer.send_seq[_NOTIF_BARRIER] = seq
        deadline = self._deadline()
        self._wait(_NOTIF_BARRIER, peers, deadline)
        self._flush(peers, deadline)

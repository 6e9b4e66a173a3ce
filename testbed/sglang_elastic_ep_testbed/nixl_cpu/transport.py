"""The transport under the CPU EP buffer: one NIXL agent (UCX backend), one registered DRAM
region, and one-sided WRITEs with notifications to connected peers.

:class:`NixlTransport` owns the agent, the region and the per-peer transfer state; it posts
writes, reaps them, collects notifications, probes silent peers and masks a peer whose transfer
failed or who stayed silent past the deadline. Rank connections (:mod:`.connections`) and
dispatch/combine (:mod:`.dispatch`) are built on it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_elastic_ep.sglang.mooncake_timeouts import timeouts_from_environment

from ._env import configure_ucx_env
from .layout import RegionLayout, rdma_size_hint

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_MS = 30_000
# A survivor that reported a dead peer sits in Mooncake's post-failure sync until the fault
# window closes, and sends nothing on this data plane meanwhile: its peers wait that long and
# this much more before they mask it, or two survivors take each other for dead.
FAULT_WINDOW_MARGIN_S = 15.0
# Probe a silent peer (a tiny WRITE) after this long, then this often, so a dead process is
# seen through NIXL's error long before the timeout.
PROBE_AFTER_S = 0.02
PROBE_EVERY_S = 0.05
MAX_INBOX_PER_AGENT = 64
_TRACE = os.environ.get("SGLANG_EEP_NIXL_CPU_TRACE") == "1"  # print every write and notification


def default_timeout_ms() -> int:
    """How long a wait for a peer lasts before the peer is masked: 30 s, or longer than the
    Mooncake fault window the server was given (``--elastic-ep-fault-window``)."""
    _, window = timeouts_from_environment()
    outlast = int((window + FAULT_WINDOW_MARGIN_S) * 1000) if window is not None else 0
    return max(DEFAULT_TIMEOUT_MS, outlast)


def _trace(fmt: str, *args: Any) -> None:
    if _TRACE:
        print(f"[trace {time.monotonic():.4f} pid {os.getpid()}] " + fmt % args, flush=True)


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


def _nixl_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


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


class NixlTransport:
    """The agent, the registered region and the peers' transfer state of one rank.

    Args:
        rank: this rank's global EP rank.
        timeout_ms: how long a wait for a peer lasts before the peer is masked.
        agent_name: NIXL agent name (default: unique per process incarnation).
    """

    def __init__(self, rank: int, timeout_ms: int, agent_name: str | None) -> None:
        # UCX reads its environment when the agent's context is created.
        configure_ucx_env()
        self.rank = int(rank)
        self.group_size = 0  # set by update_memory_buffers
        self.timeout_ms = int(timeout_ms)
        self.num_rdma_bytes = 0
        self.num_nvl_bytes = 0

        self.agent_name = agent_name or f"nixl-ep-cpu-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = make_nixl_agent(self.agent_name, _progress_thread_enabled())
        self._mem: torch.Tensor | None = None
        self._reg: Any = None
        self._base = 0
        self._layout: RegionLayout | None = None
        self._peers: dict[int, _Peer] = {}
        self._inbox: dict[str, list[bytes]] = {}
        # The receive of a dispatch/combine returned with its hook not yet called: every
        # operation that reads notifications completes it first, so messages stay in order.
        self._pending_hook: Callable[[], None] | None = None

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

    def _release_memory(self) -> None:
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception as exc:  # noqa: BLE001 - best effort on teardown
                logger.debug("deregister_memory failed: %s", exc)
        self._reg = None
        self._mem = None
        self._layout = None

    @property
    def layout(self) -> RegionLayout:
        if self._layout is None:
            raise RuntimeError("call update_memory_buffers(...) first")
        return self._layout

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

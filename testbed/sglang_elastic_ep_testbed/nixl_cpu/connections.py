"""Rank connections of the CPU EP buffer: agent metadata exchange through the TCPStore, the
two-sided NIXL handshake of ``connect_ranks``, ``disconnect_ranks``, and the mask buffer (which
connected ranks are live).

A pair is connected when each side loaded the other's published agent metadata, WROTE a
handshake record to it with a notification naming the agent it loaded, saw the other's
handshake naming its own agent, and its write completed.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from .transport import PROBE_EVERY_S, NixlTransport, _Backoff, _Peer

logger = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT_S = 300.0
STORE_KEY_PREFIX = "NIXL_EP_CPU"
# Re-read a peer's store key this often while its handshake is missing (a replacement process
# may have published newer metadata than the one loaded).
HANDSHAKE_REFRESH_S = 0.1
# A peer whose published agent refused every handshake write for this long, with no newer key
# in the store, died (a live NIXL agent accepts writes even while its process is busy).
PEER_GONE_S = float(os.environ.get("SGLANG_EEP_NIXL_CPU_PEER_GONE_S", "10"))
KEY_POLL_S = 0.005  # while a peer's key has not appeared yet
MEMBERSHIP_CHECK_S = 1.0  # how often a handshake asks ``peers_alive`` about the peers it awaits
WITHDRAWN = b""  # a rank's handshake key once its handshake is over


class HandshakeWaitParker(Protocol):
    """Keeps threads that busy-wait beside this one parked while ``connect_ranks`` waits."""

    def keep_parked(self) -> None: ...

    def unpark(self) -> None: ...


class RankConnections(NixlTransport):
    """``connect_ranks`` / ``disconnect_ranks`` and the mask buffer of ``nixl_ep.Buffer``."""

    # Set by the buffer's constructor.
    tcp_store_group: Any
    connect_timeout_s: float
    # None here; the CPU engine's buffer parks Mooncake's spinning worker through the wait.
    handshake_wait_parker: HandshakeWaitParker | None = None
    # Which of the given ranks are still members (None: no membership to ask). The CPU
    # engine's buffer asks Mooncake's WORLD, so that a peer that hung after it published its
    # key (alive to NIXL, never answering) is given up once WORLD counts it out.
    peers_alive: Callable[[list[int]], list[bool]] | None = None

    def set_tcp_store_group(self, tcp_store_group: Any) -> None:
        self.tcp_store_group = tcp_store_group

    # ------------------------------------------------------------------ introspection

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
            if self.handshake_wait_parker is not None:
                self.handshake_wait_parker.unpark()
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
        last_membership_check = time.monotonic()
        while True:
            now = time.monotonic()
            left: set[int] = set()
            if (self.peers_alive is not None and waiting
                    and now - last_membership_check >= MEMBERSHIP_CHECK_S):
                last_membership_check = now
                asked = sorted(waiting)
                left = {r for r, up in zip(asked, self.peers_alive(asked), strict=True) if not up}
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
                counted_out = r in left
                if counted_out or now - failing_since.get(r, now) >= PEER_GONE_S:
                    waiting.discard(r)
                    gone.add(r)
                    reason = (f"rank {r} left the membership during the handshake (it hung or "
                              "died)" if counted_out else
                              f"rank {r} refused the handshake for {PEER_GONE_S:g} s: the "
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
            if self.handshake_wait_parker is not None:
                self.handshake_wait_parker.keep_parked()
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

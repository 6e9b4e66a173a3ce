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

The class is composed of three parts, each in its own module:

* :mod:`.transport` — the NIXL agent, the registered region, posting and reaping WRITEs,
  notifications, probes and masking a failed peer (:class:`.transport.NixlTransport`).
* :mod:`.connections` — metadata exchange, ``connect_ranks`` / ``disconnect_ranks`` and the mask
  buffer (:class:`.connections.RankConnections`).
* :mod:`.dispatch` — ``dispatch`` / ``combine`` / ``barrier``, their handle, events and receive
  hooks (:class:`.dispatch.LowLatencyDispatch`).
"""

from __future__ import annotations

from typing import Any

import torch

from .connections import DEFAULT_CONNECT_TIMEOUT_S, RankConnections
from .dispatch import DispatchHandle, EventOverlap, LowLatencyDispatch, RecvHook
from .transport import DEFAULT_TIMEOUT_MS, default_timeout_ms, make_nixl_agent

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_MS",
    "Buffer",
    "DispatchHandle",
    "EventOverlap",
    "RecvHook",
    "make_nixl_agent",
    "topk_idx_t",
]

topk_idx_t = torch.int64


class Buffer(RankConnections, LowLatencyDispatch):
    """CPU stand-in for ``nixl_ep.Buffer`` (low-latency mode only).

    Args mirror ``nixl_ep.Buffer``; ``disable_ll_nvlink``, ``group`` and ``comm`` are accepted
    and ignored (there is no NVLink, and metadata always goes through ``tcp_store_group``).

    Args:
        rank: this rank's global EP rank.
        tcp_store_group: the TCPStore used to exchange agent metadata (may be set later with
            :meth:`set_tcp_store_group`).
        timeout_ms: how long dispatch/combine/barrier wait for a peer before masking it
            (default: ``default_timeout_ms()``).
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
        timeout_ms: int | None = None,
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
        # Plain attributes first: a bad argument then fails before a NIXL agent exists.
        self.low_latency_mode = True
        self.connect_timeout_s = float(connect_timeout_s)
        self.explicitly_destroy = explicitly_destroy
        self.group = group
        self.comm = comm
        self.tcp_store_group = tcp_store_group
        super().__init__(rank, default_timeout_ms() if timeout_ms is None else timeout_ms,
                         agent_name)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = int(new_num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    def destroy(self) -> None:
        """Disconnect every peer, deregister memory and drop the agent (also without
        ``explicitly_destroy``, unlike nixl_ep which asserts it)."""
        if self._agent is None:
            return
        self.disconnect_ranks(list(self._peers))
        self._release_memory()
        self._agent = None

"""Low-latency dispatch and combine of the CPU EP buffer, with the events, receive hooks and
handle they return, and the message format they write into the peers' registered regions.

``dispatch`` WRITEs, to every connected unmasked rank, one message with the tokens whose top-k
experts live there and a notification carrying a per-pair sequence number, then waits for one
message from each of those ranks and packs the rows per local expert. ``combine`` sends each
source its rows back in the order it sent them, and the source reduces them with its top-k
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fp8 as fp8_mod
from .layout import (
    HEADER_WORDS,
    KIND_COMBINE,
    KIND_DISPATCH,
    MAGIC,
    counts_offset,
    message_bytes,
    payload_offset,
    row_bytes_for,
    src_idx_offset,
)
from .transport import NixlTransport, _Peer

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


class LowLatencyDispatch(NixlTransport):
    """``low_latency_dispatch`` / ``low_latency_combine`` (and SGLang's ``dispatch`` /
    ``combine`` names), ``barrier`` and the buffer-cleaning calls of ``nixl_ep.Buffer``."""

    def clean_buffer(self, *args: Any, **kwargs: Any) -> None:
        """SGLang's ``NixlEPBuffer.clean_buffer`` calls this; nothing stale can be read (every
        message carries a checked sequence number), so only pending receives are finished."""
        self._finish_pending()

    def clean_low_latency_buffer(self, *args: Any, **kwargs: Any) -> None:
        self._finish_pending()

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

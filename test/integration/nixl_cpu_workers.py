"""One EP rank of the CPU EP buffer's integration test, run as its own process.

``python nixl_cpu_workers.py --port P --rank R --start-phase I --plan '[[0,1],[0,1,2]]' ...``

The plan is data, as in NIXL EP's elastic suite: phase ``i`` lists the ranks active in it; a
negative id ``-r`` means rank ``r`` is killed (SIGKILL, by the test driver) during the phase.
Ranks are contiguous from 0, so a phase's EP size is ``max(|id|) + 1``: scale-up connects the
new tail ranks, scale-down disconnects them (both through ``NixlMembership``, the plugin's
membership module, exactly as the SGLang hooks drive it).

Per phase each active rank: applies the membership change, meets the others at a store
barrier, dispatches its tokens, runs its local experts on the packed layout, combines, and
publishes what it got (combined output, packed rows, counts, mask) for the driver to check
against a dense single-process reference. A victim dispatches (sending its tokens) and then
hangs until it is killed.

The deterministic inputs and weights live here so the driver computes the same reference.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from datetime import timedelta
from typing import Any

import torch

MAX_RANKS = 4
LOCAL_EXPERTS = 4
MAX_TOKENS = 32
HIDDEN = 64
INTERMEDIATE = 32
TOPK = 2
FP8_HIDDEN = 128
SEED = 1234
KEY = "nixl_cpu_test"


# ----------------------------------------------------------------------------- shared data


# Extra round trips run in every phase without a victim, in the same buffer (sized for float32
# rows of HIDDEN): name -> (hidden, dtype, fp8 dispatch, receive through the hook).
VARIANTS: dict[str, tuple[int, torch.dtype, bool, bool]] = {
    "fp32": (HIDDEN, torch.float32, False, False),
    "bf16": (HIDDEN, torch.bfloat16, False, True),
    "fp8": (FP8_HIDDEN, torch.bfloat16, True, False),
}


def expert_weights(hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [MAX_RANKS * LOCAL_EXPERTS, 2I, H]``, ``w2 [.., H, I]`` (float32)."""
    g = torch.Generator().manual_seed(SEED + hidden)
    n = MAX_RANKS * LOCAL_EXPERTS
    w13 = torch.randn(n, 2 * INTERMEDIATE, hidden, generator=g) * 0.2
    w2 = torch.randn(n, hidden, INTERMEDIATE, generator=g) * 0.2
    return w13, w2


def phase_inputs(
    phase: int, rank: int, ep_size: int, variant: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens of ``rank`` in ``phase``: ``x [n, H]``, ``topk_ids [n, K]`` over the experts of
    ``ep_size`` ranks (some -1), ``topk_weights [n, K]``."""
    hidden, dtype, _, _ = VARIANTS[variant]
    salt = 97 * list(VARIANTS).index(variant)
    g = torch.Generator().manual_seed(SEED + 1000 * phase + rank + salt)
    # Some ranks have no tokens at all in a phase (e.g. a joiner's first, empty batch).
    n = 0 if (phase + rank) % 5 == 3 else 17 + (5 * rank + 7 * phase) % (MAX_TOKENS - 16)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    num_experts = ep_size * LOCAL_EXPERTS
    ids = torch.stack(
        [torch.randperm(num_experts, generator=g)[:TOPK] for _ in range(n)]
    ) if n else torch.empty(0, TOPK, dtype=torch.int64)
    ids[::5, TOPK - 1] = -1  # skipped top-k entries
    weights = torch.rand(n, TOPK, generator=g) + 0.1
    return x, ids, weights


def ep_size_of(phase: list[int]) -> int:
    ranks = sorted(abs(r) for r in phase)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"phase {phase}: ranks must be contiguous from 0")
    return len(ranks)


def store_key(*parts: Any) -> str:
    return "/".join([KEY, *(str(p) for p in parts)])


# ----------------------------------------------------------------------------- the worker


def _barrier(store: Any, name: str, ranks: list[int], rank: int, timeout_s: float) -> None:
    store.set(store_key(name, rank), b"1")
    store.wait([store_key(name, r) for r in ranks], timedelta(seconds=timeout_s))


def run(args: argparse.Namespace) -> int:
    from torch.distributed import TCPStore

    from sglang_elastic_ep.backends.nixl_membership import (
        BufferSizing,
        NixlMembership,
        RankRemovedError,
    )
    from sglang_elastic_ep_testbed.nixl_cpu import Buffer
    from sglang_elastic_ep_testbed.nixl_cpu.moe_runner import run_packed_experts

    torch.set_num_threads(1)
    plan: list[list[int]] = json.loads(args.plan)
    rank = args.rank
    store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=60))
    t0 = time.monotonic()
    buf = Buffer(rank=rank, tcp_store_group=store, timeout_ms=args.timeout_ms,
                 connect_timeout_s=40.0)
    sizing = BufferSizing(
        max_ep_size=MAX_RANKS,
        num_local_experts=LOCAL_EXPERTS,
        num_max_dispatch_tokens_per_rank=MAX_TOKENS,
        hidden_size=HIDDEN,
    )
    sizing.allocate(buf)
    if args.die_in_connect:
        # Publish the handshake key, then never answer: the driver kills this process while
        # the others wait for its handshake (a joiner dying during its first connect).
        def handshake_then_hang(*_: Any, **__: Any) -> set[int]:
            store.set(store_key("victim", args.start_phase, rank), b"1")
            time.sleep(3600)
            return set()

        buf._handshake = handshake_then_hang  # type: ignore[method-assign]
    if args.membership_in_store:
        # The membership as the driver tells it: a rank is out once its "out" key is set.
        buf.peers_alive = lambda ranks: [not store.check([store_key("out", r)]) for r in ranks]
    # The one line that picks the membership driver: the plugin's own module.
    membership = NixlMembership(reconnect_grace_s=0.0)
    membership.attach(
        buf, rank=rank, max_ep_size=MAX_RANKS, initial_ep_size=ep_size_of(plan[args.start_phase])
    )
    weights_by_hidden = {h: expert_weights(h) for h in {v[0] for v in VARIANTS.values()}}
    mine = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    store.set(store_key("started", args.incarnation), pickle.dumps(
        {"pid": os.getpid(), "agent": buf.agent_name, "init_s": time.monotonic() - t0}))

    prev_size: int | None = None
    for i in range(args.start_phase, len(plan)):
        phase = plan[i]
        size = ep_size_of(phase)
        victims = sorted(-r for r in phase if r < 0)
        survivors = [r for r in range(size) if r not in victims]
        if prev_size is not None and size != prev_size:
            membership.mark_activated(range(prev_size, size))
            membership.mark_drained(range(size, prev_size))
            membership.on_scale(size)
        prev_size = size
        if rank >= size:
            try:
                membership.ensure_connected()
            except RankRemovedError:
                membership.release()
                buf.destroy()
                store.set(store_key("left", i, rank), b"1")
                return 0
            raise AssertionError("a rank beyond the EP size was not told to leave")

        t_connect = time.monotonic()
        membership.ensure_connected()
        connect_s = time.monotonic() - t_connect
        mask = torch.zeros(MAX_RANKS, dtype=torch.int32)
        buf.query_mask_buffer(mask)  # a rank that died in the connect never comes
        _barrier(store, f"ready/{i}", [r for r in range(size) if not mask[r]], rank, 60)

        num_experts = LOCAL_EXPERTS * membership.connected_ep_size
        if rank in victims:
            x, ids, weights = phase_inputs(i, rank, size)
            buf.dispatch(x, ids, MAX_TOKENS, num_experts, use_fp8=False,
                         return_recv_hook=True)
            store.set(store_key("victim", i, rank), b"1")
            time.sleep(3600)  # killed (or stopped) by the driver
            return 1

        report: dict[str, Any] = {
            "pid": os.getpid(),
            "agent": buf.agent_name,
            "connect_s": connect_s,
            "connected_ep_size": membership.connected_ep_size,
        }
        for variant in (list(VARIANTS) if not victims else ["fp32"]):
            hidden, dtype, use_fp8, hook_mode = VARIANTS[variant]
            w13_all, w2_all = weights_by_hidden[hidden]
            w13, w2 = w13_all[mine].to(dtype), w2_all[mine].to(dtype)
            if use_fp8:
                w13, w2 = w13_all[mine], w2_all[mine]  # experts compute in float32
            x, ids, weights = phase_inputs(i, rank, size, variant)
            t_phase = time.monotonic()
            recv_x, recv_count, handle, event, hook = buf.dispatch(
                x, ids, MAX_TOKENS, num_experts, use_fp8=use_fp8, async_finish=not hook_mode,
                return_recv_hook=hook_mode, round_scale=False, use_ue8m0=False,
            )
            hook() if hook_mode else event.current_stream_wait()
            if use_fp8:
                q, scale = recv_x
                expert_out = run_packed_experts(q, recv_count, w13, w2, hidden_states_scale=scale)
            else:
                q, scale = recv_x, None
                expert_out = run_packed_experts(recv_x, recv_count, w13, w2)
            out, event, hook = buf.combine(
                x=expert_out, topk_idx=ids, topk_weights=weights, handle=handle,
                async_finish=not hook_mode, return_recv_hook=hook_mode,
            )
            hook() if hook_mode else event.current_stream_wait()
            elapsed = time.monotonic() - t_phase
            counts = recv_count.tolist()
            rows = torch.cat([q[e, : counts[e]] for e in range(LOCAL_EXPERTS)])
            report[variant] = {
                "out": out,
                "counts": counts,
                "rows": rows.view(torch.uint8) if use_fp8 else rows,
                "scales": None if scale is None
                else torch.cat([scale[e, : counts[e]] for e in range(LOCAL_EXPERTS)]),
                "elapsed_s": elapsed,
            }
        mask = torch.zeros(MAX_RANKS, dtype=torch.int32)
        buf.query_mask_buffer(mask)
        report["mask"] = mask.tolist()
        report["reasons"] = buf.mask_reasons()
        report["peers"] = {r: buf.peer_agent_name(r) for r in buf.connected_ranks}
        store.set(store_key("res", i, rank), pickle.dumps(report))
        _barrier(store, f"done/{i}", [r for r in survivors if not mask[r]], rank, 60)
    membership.release()
    buf.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--start-phase", type=int, default=0)
    p.add_argument("--plan", required=True)
    p.add_argument("--incarnation", required=True)
    p.add_argument("--timeout-ms", type=int, default=3000)
    p.add_argument("--die-in-connect", action="store_true")
    p.add_argument("--membership-in-store", action="store_true")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""One EP rank of ``test_nixl_ep_elastic.py``: a real ``nixl_ep.Buffer`` driven by our membership.

Roles:
  founder  rank 0 or 1, serves every phase;
  joiner   rank 2, joins in phase ``--join-phase`` and, with ``--leave-phase``, leaves in it.

Phases (the plan ``[[0,1],[0,1,2],[0,1],[0,1,2]]``):
  0  ranks 0,1 serve.
  1  scale-up to 3: the founders keep serving at 2 while the joiner starts ("HTTP request" and
     joiner launch touch no buffer); once the joiner is ready, rank 0 "activates" it (a store key,
     standing in for Mooncake activate_ranks); then each founder calls on_scale(3) and the joiner
     attaches; the next dispatch connects on every side. Dispatch/combine checked at 3.
  2  scale-down to 2: all three serve drain rounds that route nothing to rank 2 (EPLB moved its
     experts away); after the drain barrier the founders call mark_drained + on_scale(2), the
     joiner finds itself removed and releases its buffer; the founders' next dispatch
     disconnects rank 2. Checked at 2.
  3  scale-up to 3 again, with a new process as rank 2 (the membership waits out the reconnect
     grace). Checked at 3.

Roles of the plan ``[[0,1,2],[0,-1,2],[0,1,2]]`` (``--plan replace-middle``): a rank below the
top fails and a new process takes its id while the rank above it stays:
  member       ranks 0, 1 and 2 serve at 3 (phase 0); rank 1 is then killed by the test; ranks 0
               and 2 wait for the replacement, call ``replace([1])`` and serve at 3 with it
               (phase 1): the membership disconnects rank 1 and connects it again, and rank 2
               must stay in the dispatch throughout.
  replacement  the new rank 1: allocates, says it is ready, attaches at 3 and serves phase 1.

Every connect/disconnect, activation and drain is written with a wall-clock time to a JSONL log
the test checks for ordering. Timings on one GPU mean nothing; order and results do.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from sglang_elastic_ep.backends.nixl_membership import (  # noqa: E402
    BufferSizing,
    NixlMembership,
    RankRemovedError,
)

HIDDEN = 7168
MAX_TOKENS = 128  # num_max_dispatch_tokens_per_rank
TOKENS = 64  # tokens per rank per round
LOCAL_EXPERTS = 8
TOP_K = 8
MAX_EP = 4
ROUNDS = 2
STORE_TIMEOUT = timedelta(seconds=150)
# --fixed-layout: dispatch with num_experts for --max-ep-size ranks (a layout that does not change
# with the EP size, as a CUDA graph captured before a scale needs) instead of upstream's
# num_local_experts * current size.
FIXED_LAYOUT = False


def load_nixl_ep() -> Any:
    try:
        import nixl_ep_cu12 as nixl_ep
    except ImportError:
        import nixl_ep  # type: ignore[no-redef]
    return nixl_ep


class Log:
    def __init__(self, path: Path, rank: int, tag: str) -> None:
        self.f = path.open("a")
        self.rank, self.tag = rank, tag

    def __call__(self, event: str, **data: Any) -> None:
        rec = dict(t=time.time(), rank=self.rank, tag=self.tag, event=event, **data)
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        print(f"[rank {self.rank}{self.tag}] {event} {data}", flush=True)


class RecordingBuffer:
    """Delegates to the real buffer; logs each connect/disconnect around the call."""

    def __init__(self, inner: Any, log: Log) -> None:
        self._inner = inner
        self._log = log

    def connect_ranks(self, remote_ranks: list[int]) -> None:
        self._log("connect_begin", ranks=list(remote_ranks))
        self._inner.connect_ranks(remote_ranks)
        self._log("connect_end", ranks=list(remote_ranks))

    def disconnect_ranks(self, remote_ranks: list[int]) -> None:
        self._log("disconnect_begin", ranks=list(remote_ranks))
        self._inner.disconnect_ranks(remote_ranks)
        self._log("disconnect_end", ranks=list(remote_ranks))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Store:
    def __init__(self, port: int) -> None:
        self.s = torch.distributed.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT
        )

    def barrier(self, name: str, n: int) -> None:
        if self.s.add(f"eep/{name}/count", 1) == n:
            self.s.set(f"eep/{name}/done", "1")
        self.s.wait([f"eep/{name}/done"], STORE_TIMEOUT)

    def set_time(self, key: str) -> float:
        t = time.time()
        self.s.set(f"eep/{key}", str(t))
        return t

    def wait_time(self, key: str) -> float:
        self.s.wait([f"eep/{key}"], STORE_TIMEOUT)
        return float(self.s.get(f"eep/{key}").decode())


# ----------------------------------------------------------------------------- the workload


def token_value(rank: int, t: int) -> float:
    """Exactly representable in bf16: (rank + 1) + (t % 32) / 32."""
    return (rank + 1) + (t % 32) / 32.0


def make_inputs(
    phase: int, rnd: int, rank: int, num_experts: int, expert_ranks: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Deterministic per (phase, round, rank): every rank can rebuild every other rank's."""
    g = torch.Generator().manual_seed(1_000_003 * phase + 7919 * rnd + rank)
    scores = torch.rand((TOKENS, num_experts), generator=g) + 1.0
    allowed = torch.zeros(num_experts, dtype=torch.bool)
    for r in expert_ranks:
        allowed[r * LOCAL_EXPERTS : (r + 1) * LOCAL_EXPERTS] = True
    scores[:, ~allowed] = -1.0
    topk = torch.topk(scores, TOP_K, dim=-1).indices.to(torch.int64)
    drop = torch.randint(0, TOKENS * TOP_K, (6,), generator=g)
    topk.view(-1)[drop] = -1  # "no expert" entries
    weights = torch.rand((TOKENS, TOP_K), generator=g) + 0.1
    x = torch.tensor([token_value(rank, t) for t in range(TOKENS)]).view(-1, 1)
    x = x.expand(TOKENS, HIDDEN).to(torch.bfloat16).contiguous()
    return x, topk, weights


def expert_scale(e: int) -> float:
    return float(2 ** (e % 3))  # powers of two keep the bf16 products exact


def serve(
    buffer: Any,
    m: NixlMembership,
    sizing: BufferSizing,
    nixl_ep: Any,
    log: Log,
    *,
    phase: int,
    rank: int,
    ranks: list[int],
    expert_ranks: list[int] | None = None,
    rounds: int = ROUNDS,
    label: str = "serve",
) -> None:
    """``rounds`` dispatch+combine rounds among ``ranks``, each checked against a reference."""
    expert_ranks = ranks if expert_ranks is None else expert_ranks
    n = len(ranks)
    for rnd in range(rounds):
        m.ensure_connected()  # exactly where the plugin's get_nixl_buffer calls it
        assert m.connected_ep_size == n, (m.connected_ep_size, n)
        num_experts = sizing.dispatch_num_experts(n)
        dispatch_experts = sizing.dispatch_num_experts(n, fixed_layout=FIXED_LAYOUT)
        inputs = {r: make_inputs(phase, rnd, r, num_experts, expert_ranks) for r in ranks}
        x, topk, weights = (t.cuda() for t in inputs[rank])
        topk = topk.to(getattr(nixl_ep, "topk_idx_t", torch.int64))
        recv_x, recv_count, handle, _event, _hook = buffer.low_latency_dispatch(
            x,
            topk,
            MAX_TOKENS,
            dispatch_experts,
            use_fp8=False,
            async_finish=False,
            return_recv_hook=False,
        )
        torch.cuda.synchronize()
        src_info, layout = handle[0].cpu(), handle[1].cpu()
        recv_cpu, count_cpu = recv_x.float().cpu(), recv_count.cpu()
        for i in range(LOCAL_EXPERTS):
            e = rank * LOCAL_EXPERTS + i
            want = sum(int((inputs[r][1] == e).sum()) for r in ranks)
            assert int(count_cpu[i]) == want, f"expert {e}: received {int(count_cpu[i])} != {want}"
            for j in ranks:
                begin, cnt = int(layout[i, j]) >> 32, int(layout[i, j]) & 0xFFFFFFFF
                sel = (inputs[j][1] == e).any(dim=1).nonzero().flatten().tolist()
                assert cnt == len(sel), f"expert {e} from rank {j}: {cnt} != {len(sel)}"
                src = [v % MAX_TOKENS for v in src_info[i, begin : begin + cnt].tolist()]
                assert sorted(src) == sel, f"expert {e} from rank {j}: wrong tokens"
                got = recv_cpu[i, begin : begin + cnt]
                exp = torch.tensor([token_value(j, t) for t in src]).view(-1, 1)
                assert torch.equal(got, exp.expand_as(got)), f"expert {e} from {j}: wrong rows"
        scale = torch.tensor(
            [expert_scale(rank * LOCAL_EXPERTS + i) for i in range(LOCAL_EXPERTS)],
            device="cuda",
        ).view(-1, 1, 1)
        expert_out = (recv_x.float() * scale).to(torch.bfloat16)
        combined, _event, _hook = buffer.low_latency_combine(
            expert_out, topk, weights, handle, async_finish=False, return_recv_hook=False
        )
        torch.cuda.synchronize()
        tk = inputs[rank][1]
        s = torch.tensor([[expert_scale(int(e)) if e >= 0 else 0.0 for e in row] for row in tk])
        ref = x.float().cpu() * (weights.cpu() * s).sum(dim=1, keepdim=True)
        torch.testing.assert_close(combined.float().cpu(), ref, rtol=1e-2, atol=1e-2)
    mask = torch.zeros(MAX_EP, dtype=torch.int32, device="cuda")
    buffer.query_mask_buffer(mask)
    masked = mask.cpu().tolist()
    assert masked[:n] == [0] * n, f"ranks masked while serving: {masked}"
    log(
        "phase_ok",
        phase=phase,
        label=label,
        ranks=ranks,
        rounds=rounds,
        num_experts=sizing.dispatch_num_experts(n, fixed_layout=FIXED_LAYOUT),
        mask=masked,
    )


# ----------------------------------------------------------------------------- roles


def founder(args: argparse.Namespace, buffer: Any, sizing: BufferSizing, nixl_ep: Any) -> None:
    rank, store, log = args.rank, args.store, args.log
    m = NixlMembership(reconnect_grace_s=args.grace)
    m.attach(buffer, rank=rank, max_ep_size=MAX_EP, initial_ep_size=2)
    serve(buffer, m, sizing, nixl_ep, log, phase=0, rank=rank, ranks=[0, 1])
    store.barrier("p0/end", 2)

    for phase in (1, 3):
        # "POST /scale_elastic_ep" reached both founders: nothing touches the buffer. They go on
        # serving at 2 while the joiner loads (it is already running, blocked on activation).
        store.barrier(f"p{phase}/request", 2)
        serve(
            buffer,
            m,
            sizing,
            nixl_ep,
            log,
            phase=phase,
            rank=rank,
            ranks=[0, 1],
            rounds=1,
            label="serving_while_joiner_loads",
        )
        if rank == 0:
            store.wait_time(f"p{phase}/joiner_ready")  # Mooncake get_peer_state says ready
            t = store.set_time(f"p{phase}/activated")  # activate_ranks returned
        else:
            t = store.wait_time(f"p{phase}/activated")
        log("activated", ranks=[2], phase=phase, activated_at=t)
        m.mark_activated([2])
        m.on_scale(3)
        log("on_scale", size=3, connected=m.connected_ep_size, phase=phase)
        assert m.connected_ep_size == 2, "on_scale must not connect"
        serve(buffer, m, sizing, nixl_ep, log, phase=phase, rank=rank, ranks=[0, 1, 2])
        if phase == 3:
            break
        # Scale-down: EPLB moved every expert off rank 2; in-flight work finishes (drain).
        serve(
            buffer,
            m,
            sizing,
            nixl_ep,
            log,
            phase=2,
            rank=rank,
            ranks=[0, 1, 2],
            expert_ranks=[0, 1],
            label="drain",
        )
        store.barrier("p2/drained", 3)
        log("drained", ranks=[2], phase=2)
        m.mark_drained([2])
        m.on_scale(2)
        log("on_scale", size=2, connected=m.connected_ep_size, phase=2)
        serve(buffer, m, sizing, nixl_ep, log, phase=2, rank=rank, ranks=[0, 1])
        store.barrier("p2/end", 2)
    store.barrier("end", 3)
    log("applied", steps=[[k, list(r)] for k, r in m.applied])
    m.release()


def joiner(args: argparse.Namespace, buffer: Any, sizing: BufferSizing, nixl_ep: Any) -> None:
    rank, store, log, phase = args.rank, args.store, args.log, args.join_phase
    m = NixlMembership(reconnect_grace_s=args.grace)
    # Loaded and ready to join (Mooncake join_group would now wait for activate_ranks).
    store.set_time(f"p{phase}/joiner_ready")
    t = store.wait_time(f"p{phase}/activated")
    log("activated", ranks=[2], phase=phase, activated_at=t)
    m.attach(buffer, rank=rank, max_ep_size=MAX_EP, initial_ep_size=3)  # offset 2 + world 1
    serve(buffer, m, sizing, nixl_ep, log, phase=phase, rank=rank, ranks=[0, 1, 2])
    if args.leave_phase is not None:
        serve(
            buffer,
            m,
            sizing,
            nixl_ep,
            log,
            phase=args.leave_phase,
            rank=rank,
            ranks=[0, 1, 2],
            expert_ranks=[0, 1],
            label="drain",
        )
        store.barrier(f"p{args.leave_phase}/drained", 3)
        log("drained", ranks=[2], phase=args.leave_phase)
        m.on_scale(2)
        assert m.is_leaving
        try:
            m.ensure_connected()
        except RankRemovedError:
            log("removed", phase=args.leave_phase)
        else:
            raise AssertionError("a removed rank was allowed to dispatch")
        log("applied", steps=[[k, list(r)] for k, r in m.applied])
        m.release()
        return
    store.barrier("end", 3)
    log("applied", steps=[[k, list(r)] for k, r in m.applied])
    m.release()


def member(args: argparse.Namespace, buffer: Any, sizing: BufferSizing, nixl_ep: Any) -> None:
    rank, store, log = args.rank, args.store, args.log
    m = NixlMembership(reconnect_grace_s=args.grace)
    m.attach(buffer, rank=rank, max_ep_size=MAX_EP, initial_ep_size=3)
    serve(buffer, m, sizing, nixl_ep, log, phase=0, rank=rank, ranks=[0, 1, 2])
    store.barrier("p0/end", 3)
    if rank == 1:
        log("waiting_to_be_killed")
        time.sleep(3600)  # the test kills this process (SIGKILL) here
    t = store.wait_time("p1/replacement_ready")  # Mooncake: the replacement is in WORLD
    log("activated", ranks=[1], phase=1, activated_at=t)
    m.replace([1])
    assert m.connected_ep_size == 3, "replace must not cut the dispatch before it applies"
    serve(buffer, m, sizing, nixl_ep, log, phase=1, rank=rank, ranks=[0, 1, 2])
    store.barrier("end", 3)
    log("applied", steps=[[k, list(r)] for k, r in m.applied])
    m.release()


def replacement(args: argparse.Namespace, buffer: Any, sizing: BufferSizing,
                nixl_ep: Any) -> None:
    rank, store, log = args.rank, args.store, args.log
    m = NixlMembership(reconnect_grace_s=args.grace)
    t = store.set_time("p1/replacement_ready")
    log("activated", ranks=[rank], phase=1, activated_at=t)
    m.attach(buffer, rank=rank, max_ep_size=MAX_EP, initial_ep_size=3)
    serve(buffer, m, sizing, nixl_ep, log, phase=1, rank=rank, ranks=[0, 1, 2])
    store.barrier("end", 3)
    log("applied", steps=[[k, list(r)] for k, r in m.applied])
    m.release()


ROLES = {"founder": founder, "joiner": joiner, "member": member, "replacement": replacement}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--role", choices=tuple(ROLES), required=True)
    p.add_argument("--tag", default="")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--join-phase", type=int, default=1)
    p.add_argument("--leave-phase", type=int, default=None)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--hang-timeout", type=float, default=240.0)
    p.add_argument("--fixed-layout", action="store_true")
    args = p.parse_args()
    global FIXED_LAYOUT
    FIXED_LAYOUT = args.fixed_layout
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)

    torch.cuda.set_device(0)
    nixl_ep = load_nixl_ep()
    args.log = Log(args.log_dir / f"rank{args.rank}{args.tag}.jsonl", args.rank, args.tag)
    args.store = Store(args.port)
    sizing = BufferSizing(
        max_ep_size=MAX_EP,
        num_local_experts=LOCAL_EXPERTS,
        num_max_dispatch_tokens_per_rank=MAX_TOKENS,
        hidden_size=HIDDEN,
    )
    inner = nixl_ep.Buffer(rank=args.rank, tcp_store_group=args.store.s, explicitly_destroy=True)
    buffer = RecordingBuffer(inner, args.log)
    nbytes = sizing.allocate(buffer, nixl_ep.Buffer.get_rdma_size_hint)
    args.log("allocated", num_rdma_bytes=nbytes, max_ep=MAX_EP, pid=os.getpid())
    ROLES[args.role](args, buffer, sizing, nixl_ep)
    args.log("exit")


if __name__ == "__main__":
    main()

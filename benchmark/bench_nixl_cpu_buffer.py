"""CPU EP buffer (``backends/nixl_cpu``): dispatch + combine time over real NIXL transfers, and
the time to connect one new rank.

Shapes of the tiny CPU model: hidden 64, 16 experts, top-2, ``--tokens`` tokens per rank,
float32 (the CPU engine serves in float32). For each rank count, that many processes each own
``16 / ranks`` experts; every iteration is one dispatch (NIXL WRITEs to the ranks owning each
token's experts), an identity expert (the packed rows are combined back unchanged, so only the
data plane is timed) and one combine. Per-iteration wall time is measured on every rank; the
table shows the slowest rank's median and p90.

Connect: 2 ranks connected, a third process starts (buffer sized for 4 ranks), then all three
call ``connect_ranks`` at once (the two-sided handshake through the TCPStore); the time is the
slowest side's ``connect_ranks`` call. The new process's agent creation + memory registration is
shown separately.

Writes the ``nixl_cpu_buffer`` section of docs/benchmarks.md.
Run: ``python benchmark/bench_nixl_cpu_buffer.py`` (about 30 s).
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command_line, write_section  # noqa: E402

HIDDEN = 64
NUM_EXPERTS = 16
TOPK = 2
KEY = "bench_nixl_cpu"


def _key(*parts: object) -> str:
    return "/".join([KEY, *(str(p) for p in parts)])


# ----------------------------------------------------------------------------- worker side


def worker(args: argparse.Namespace) -> int:
    from torch.distributed import TCPStore

    from sglang_elastic_ep_testbed.nixl_cpu import Buffer

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=120))
    t0 = time.perf_counter()
    buf = Buffer(rank=args.rank, tcp_store_group=store, timeout_ms=30_000)
    local = NUM_EXPERTS // args.max_ranks
    buf.update_memory_buffers(
        num_ranks=args.max_ranks,
        num_experts_per_rank=local,
        num_rdma_bytes=Buffer.get_rdma_size_hint(args.tokens, HIDDEN, args.max_ranks,
                                                 NUM_EXPERTS),
    )
    init_s = time.perf_counter() - t0
    connect_s: dict[int, float] = {}
    for step in range(args.first_step, len(args.steps)):
        store.set(_key(args.tag, "ready", step, args.rank), b"1")
        store.wait([_key(args.tag, "go", step)], timedelta(seconds=120))
        t0 = time.perf_counter()
        buf.connect_ranks([int(r) for r in args.steps[step].split(",")])
        connect_s[step] = time.perf_counter() - t0
    result: dict[str, object] = {"init_s": init_s, "connect_s": connect_s}
    if args.iters:
        g = torch.Generator().manual_seed(args.rank)
        x = torch.randn(args.tokens, HIDDEN, generator=g)
        ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK]
                           for _ in range(args.tokens)])
        w = torch.rand(args.tokens, TOPK, generator=g)
        disp: list[float] = []
        comb: list[float] = []
        total: list[float] = []
        for it in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            recv, count, handle, _, _ = buf.dispatch(x, ids, args.tokens, NUM_EXPERTS,
                                                     use_fp8=False)
            t1 = time.perf_counter()
            out, _, _ = buf.combine(x=recv, topk_idx=ids, topk_weights=w, handle=handle)
            t2 = time.perf_counter()
            if it >= args.warmup:
                disp.append(t1 - t0)
                comb.append(t2 - t1)
                total.append(t2 - t0)
        # identity experts: combine must give sum_k w * x
        expect = x * w.sum(1, keepdim=True)
        torch.testing.assert_close(out, expect)
        result.update(dispatch=disp, combine=comb, total=total,
                      masked=len(buf.mask_reasons()))
    store.set(_key(args.tag, "res", args.rank), pickle.dumps(result))
    store.wait([_key(args.tag, "exit")], timedelta(seconds=120))
    buf.destroy()
    return 0


# ----------------------------------------------------------------------------- driver side


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, port: int, tag: str, rank: int, max_ranks: int, steps: list[str],
              tokens: int, iters: int = 0, warmup: int = 0, first_step: int = 0) -> None:
        cmd = [sys.executable, __file__, "--worker", "--port", str(port), "--tag", tag,
               "--rank", str(rank), "--max-ranks", str(max_ranks), "--tokens", str(tokens),
               "--iters", str(iters), "--warmup", str(warmup), "--first-step", str(first_step),
               "--steps", *steps]
        self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL))

    def wait(self) -> None:
        for p in self.procs:
            if p.wait(timeout=60) != 0:
                raise RuntimeError(f"worker {p.pid} exited with {p.returncode}")
        self.procs.clear()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def _gather(store, tag: str, ranks: list[int]) -> dict[int, dict]:
    store.wait([_key(tag, "res", r) for r in ranks], timedelta(seconds=180))
    return {r: pickle.loads(store.get(_key(tag, "res", r))) for r in ranks}


def _step(store, tag: str, step: int, ranks: list[int]) -> None:
    store.wait([_key(tag, "ready", step, r) for r in ranks], timedelta(seconds=120))
    store.set(_key(tag, "go", step), b"1")


def bench_data_plane(store, procs: Procs, ranks: int, tokens: int, iters: int,
                     warmup: int) -> dict[str, float]:
    tag = f"dp{ranks}"
    everyone = list(range(ranks))
    steps = [",".join(map(str, everyone))]
    for r in everyone:
        procs.start(store.port, tag, r, ranks, steps, tokens, iters, warmup)
    _step(store, tag, 0, everyone)
    res = _gather(store, tag, everyone)
    store.set(_key(tag, "exit"), b"1")
    procs.wait()
    totals = [res[r]["total"] for r in everyone]
    return {
        "dispatch_p50": max(statistics.median(res[r]["dispatch"]) for r in everyone) * 1e6,
        "combine_p50": max(statistics.median(res[r]["combine"]) for r in everyone) * 1e6,
        "total_p50": max(statistics.median(t) for t in totals) * 1e6,
        "total_p90": max(statistics.quantiles(t, n=10)[-1] for t in totals) * 1e6,
        "masked": sum(int(res[r]["masked"]) for r in everyone),
    }


def bench_connect(store, procs: Procs, tokens: int) -> dict[str, float]:
    """Ranks 0 and 1 connect (step 0); a third process starts and, once its buffer is ready,
    all three connect it (step 1: the founders call connect_ranks([2]), the joiner
    connect_ranks([0, 1, 2]))."""
    tag = "conn"
    steps = ["0,1", "2"]
    for r in (0, 1):
        procs.start(store.port, tag, r, 4, steps, tokens)
    _step(store, tag, 0, [0, 1])
    procs.start(store.port, tag, 2, 4, ["", "0,1,2"], tokens, first_step=1)
    _step(store, tag, 1, [0, 1, 2])
    res = _gather(store, tag, [0, 1, 2])
    store.set(_key(tag, "exit"), b"1")
    procs.wait()
    return {
        "pair_connect_s": max(res[r]["connect_s"][0] for r in (0, 1)),
        "join_connect_s": max(res[r]["connect_s"][1] for r in (0, 1, 2)),
        "agent_init_s": res[2]["init_s"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int)
    p.add_argument("--tag")
    p.add_argument("--rank", type=int)
    p.add_argument("--max-ranks", type=int)
    p.add_argument("--steps", nargs="*", default=[])
    p.add_argument("--first-step", type=int, default=0)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4])
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=180))
    procs = Procs()
    load_before = os.getloadavg()[0]
    try:
        rows = {n: bench_data_plane(store, procs, n, args.tokens, args.iters, args.warmup)
                for n in args.ranks}
        conn = bench_connect(store, procs, args.tokens)
    finally:
        procs.kill()
    load_after = os.getloadavg()[0]

    lines = [
        "## CPU EP buffer on NIXL (`backends/nixl_cpu`, issue: CPU EP data plane)",
        "",
        f"Command: `{command_line()}`",
        "",
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, NIXL UCX backend over TCP loopback "
        f"(`UCX_TLS={os.environ.get('UCX_TLS', 'tcp')}`), no progress thread. "
        f"Load average {load_before:.1f} before / {load_after:.1f} after (other processes "
        "share these cores, so absolute times are noisy).",
        "",
        f"Shapes: hidden {HIDDEN}, {NUM_EXPERTS} experts, top-{TOPK}, {args.tokens} tokens "
        f"per rank, float32; {args.iters} timed iterations after {args.warmup} warm-up; "
        "identity experts (data plane only); slowest rank's median / p90 per iteration; "
        "combined output checked against sum_k w*x on every rank.",
        "",
        "| ranks (processes) | dispatch p50 (us) | combine p50 (us) | dispatch+combine p50 (us) "
        "| dispatch+combine p90 (us) | ranks masked |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in rows.items():
        lines.append(f"| {n} | {r['dispatch_p50']:.0f} | {r['combine_p50']:.0f} | "
                     f"{r['total_p50']:.0f} | {r['total_p90']:.0f} | {r['masked']} |")
    lines += [
        "",
        "| connect | seconds |",
        "|---|---:|",
        f"| `connect_ranks` 2 ranks (pairwise handshake) | {conn['pair_connect_s']:.3f} |",
        f"| `connect_ranks` one new rank joining 2 (slowest of the 3 sides) | "
        f"{conn['join_connect_s']:.3f} |",
        f"| new process: NIXL agent + register buffer (before connecting) | "
        f"{conn['agent_init_s']:.3f} |",
    ]
    body = "\n".join(lines) + "\n"
    print(body)
    if not args.no_write:
        write_section("nixl_cpu_buffer", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

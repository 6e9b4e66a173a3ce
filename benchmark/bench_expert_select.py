"""Benchmark: Triton mask-aware expert selection vs its torch reference.

Setup (defaults): 256 logical experts, 288 physical slots on 16 ranks (18 per rank; experts
0..31 have a second replica in the 32 redundant slots), top-8, int32 ids, one rank dead. Each
call reads the top-k ids and writes physical ids and per-token flags; inputs and outputs rotate
over enough copies to exceed twice the L2 cache, so the bandwidth figures are HBM figures.

Times are per call, medians of several CUDA-event-timed batches: "graph" replays a CUDA graph of
back-to-back calls (device time, no launch overhead), "eager" launches from Python. Achieved
bandwidth counts compulsory bytes (ids in, ids and flags out, the small tables once) over the
graph time, against the device's peak from a table keyed by device name.

Writes its table into docs/benchmarks.md between ``<!-- BEGIN expert_select -->`` and
``<!-- END expert_select -->`` (other sections untouched), with the command that produced it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import sglang_elastic_ep_kernels  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "sgl-kernel"))
from sglang_elastic_ep_kernels import (  # noqa: E402
    select_physical_experts,
    select_physical_experts_reference,
)

BEGIN, END = "<!-- BEGIN expert_select -->", "<!-- END expert_select -->"

# Peak HBM bandwidth in bytes/s, by a substring of torch.cuda.get_device_name() (first match).
PEAK_BANDWIDTH = [
    ("H100 80GB HBM3", 3.35e12),  # H100 SXM5
    ("H100 SXM", 3.35e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H200", 4.8e12),
    ("GH200", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-SXM4-40GB", 1.555e12),
    ("A100-PCIE-40GB", 1.555e12),
    ("L40S", 0.864e12),
]


def peak_bandwidth(name: str) -> float | None:
    for key, peak in PEAK_BANDWIDTH:
        if key.lower() in name.lower():
            return peak
    return None


def build_problem(
    num_logical: int, num_slots: int, num_ranks: int, dead_ranks: list[int], device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if num_slots < num_logical or num_slots % num_ranks:
        raise SystemExit("need slots >= logical experts and slots divisible by ranks")
    redundant = num_slots - num_logical
    r_max = 1 + math.ceil(redundant / num_logical)
    table = torch.full((num_logical, r_max), -1, dtype=torch.int32)
    counts = torch.ones(num_logical, dtype=torch.int32)
    table[:, 0] = torch.arange(num_logical, dtype=torch.int32)
    for i in range(redundant):
        e = i % num_logical
        table[e, counts[e]] = num_logical + i
        counts[e] += 1
    slot_to_rank = (torch.arange(num_slots) // (num_slots // num_ranks)).to(torch.int32)
    mask = torch.ones(num_ranks, dtype=torch.int32)
    mask[dead_ranks] = 0
    return table.to(device), counts.to(device), slot_to_rank.to(device), mask.to(device)


def time_per_call(run_batch: Callable[[], None], calls_per_batch: int, reps: int = 7) -> float:
    """Median seconds per call over ``reps`` CUDA-event-timed batches (after a warm-up)."""
    run_batch()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_batch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_batch)
    return statistics.median(times)


def bench_one(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    sets: list[list[torch.Tensor]],
    outs: list[tuple[torch.Tensor, torch.Tensor]],
    tables: tuple[torch.Tensor, ...],
    use_out: bool,
    eager: bool = True,
) -> tuple[float, float]:
    """(graph seconds per call, eager seconds per call)."""

    def call(i: int) -> None:
        topk = sets[i % len(sets)][0]
        if use_out:
            out, flag = outs[i % len(outs)]
            fn(topk, *tables, out=out, flag_out=flag)
        else:
            fn(topk, *tables)

    n = len(sets)
    calls = max(n, 64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph_s = time_per_call(graph.replay, calls)
    if not eager:
        return graph_s, float("nan")

    def run_eager() -> None:
        for i in range(calls):
            call(i)

    eager_s = time_per_call(run_eager, calls)
    return graph_s, eager_s


def make_sets(
    num_tokens: int, top_k: int, num_logical: int, l2: int
) -> tuple[list[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]], int]:
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    per_set = num_tokens * top_k * 4 * 2 + num_tokens
    n_sets = max(2, min(64, math.ceil(2 * l2 / max(per_set, 1))))
    sets = [
        [
            torch.randint(0, num_logical, (num_tokens, top_k), device="cuda", generator=g).to(
                torch.int32
            )
        ]
        for _ in range(n_sets)
    ]
    outs = [
        (
            torch.empty((num_tokens, top_k), dtype=torch.int32, device="cuda"),
            torch.empty(num_tokens, dtype=torch.bool, device="cuda"),
        )
        for _ in range(n_sets)
    ]
    return sets, outs, per_set


def sweep(args: argparse.Namespace, tables: tuple[torch.Tensor, ...]) -> None:
    from functools import partial

    from sglang_elastic_ep_kernels._expert_select_triton import select_physical_experts_triton

    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        sets, outs, per_set = make_sets(num_tokens, args.top_k, args.logical, l2)
        results = []
        for block_t in (8, 16, 32, 64, 128, 256):
            for num_warps in (1, 2, 4, 8):
                fn = partial(select_physical_experts_triton, block_t=block_t, num_warps=num_warps)
                graph_s, _ = bench_one(fn, sets, outs, tables, use_out=True, eager=False)
                results.append((graph_s * 1e6, block_t, num_warps))
        results.sort()
        best = ", ".join(f"{t:.2f} us (block_t={b}, warps={w})" for t, b, w in results[:4])
        worst = results[-1]
        print(f"T={num_tokens}: best {best}; worst {worst[0]:.2f} us {worst[1:]}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,128,4096,65536")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--logical", type=int, default=256)
    p.add_argument("--slots", type=int, default=288)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--dead-ranks", default="3", help="comma-separated; empty for none")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--sweep", action="store_true", help="time kernel launch configs instead (no write)"
    )
    args = p.parse_args()

    if not torch.cuda.is_available():
        print("needs a CUDA device: nothing to compare on the CPU (the reference is the CPU path)")
        raise SystemExit(2)
    import triton

    device_name = torch.cuda.get_device_name()
    peak = peak_bandwidth(device_name)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    dead = [int(r) for r in args.dead_ranks.split(",") if r.strip()]
    tables = build_problem(args.logical, args.slots, args.ranks, dead, "cuda")
    table_bytes = sum(t.numel() * t.element_size() for t in tables)
    print(f"device: {device_name}; peak HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s")
    print(f"torch {torch.__version__}, triton {triton.__version__}")

    if args.sweep:
        sweep(args, tables)
        return

    rows = []
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        sets, outs, per_set = make_sets(num_tokens, args.top_k, args.logical, l2)
        kern = select_physical_experts(sets[0][0], *tables)
        ref = select_physical_experts_reference(sets[0][0], *tables)
        torch.cuda.synchronize()
        assert torch.equal(kern[0], ref[0]) and torch.equal(kern[1], ref[1]), "kernel != reference"
        k_graph, k_eager = bench_one(select_physical_experts, sets, outs, tables, use_out=True)
        r_graph, r_eager = bench_one(
            select_physical_experts_reference, sets, outs, tables, use_out=False
        )
        nbytes = per_set + table_bytes
        bw = nbytes / k_graph
        rows.append(
            dict(
                T=num_tokens,
                k_graph=k_graph * 1e6,
                r_graph=r_graph * 1e6,
                k_eager=k_eager * 1e6,
                r_eager=r_eager * 1e6,
                nbytes=nbytes,
                bw=bw / 1e9,
                pct=(100 * bw / peak) if peak else float("nan"),
            )
        )
        print(rows[-1], flush=True)

    header = (
        "| T | kernel, graph (us) | torch ref, graph (us) | ref / kernel (graph) "
        "| kernel, eager (us) | torch ref, eager (us) | ref / kernel (eager) "
        "| bytes | achieved GB/s (graph) | % of peak |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    body = "".join(
        f"| {r['T']} | {r['k_graph']:.2f} | {r['r_graph']:.2f} | {r['r_graph'] / r['k_graph']:.1f}x"
        f" | {r['k_eager']:.2f} | {r['r_eager']:.2f} | {r['r_eager'] / r['k_eager']:.1f}x"
        f" | {r['nbytes']:,} | {r['bw']:.0f} | {r['pct']:.1f} |\n"
        for r in rows
    )
    command = "python " + " ".join(
        shlex.quote(a) for a in [str(Path(sys.argv[0]).as_posix()), *sys.argv[1:]]
    )
    section = (
        f"{BEGIN}\n"
        "## Mask-aware expert selection (`sglang_elastic_ep_kernels.select_physical_experts`)\n\n"
        f"Device: {device_name} (peak HBM {peak / 1e12 if peak else float('nan'):.2f} TB/s from "
        f"the table in the script); torch {torch.__version__}, triton {triton.__version__}; "
        f"{dt.date.today().isoformat()}.\n\n"
        f"Problem: top-{args.top_k} int32 ids, {args.logical} logical experts, {args.slots} "
        f"physical slots on {args.ranks} ranks, dead ranks {dead or 'none'}. Per call: median of "
        "CUDA-event-timed batches; *graph* = replay of back-to-back calls captured in a CUDA "
        "graph (device time), *eager* = Python launches. Inputs rotate over copies larger than "
        "2x L2, so bandwidth is HBM bandwidth; bytes = ids in + ids and flags out + tables.\n\n"
        f"{header}{body}\n"
        f"Produced by: `{command}`\n"
        f"{END}"
    )
    print(section)
    if args.no_write:
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    text = args.output.read_text() if args.output.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        _, after = rest.split(END, 1)
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    args.output.write_text(text)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

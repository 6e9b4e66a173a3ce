"""Benchmark: the per-pass cost of the rank agreement, side by side in one run (CPU, gloo).

Each scheduler pass of a DP-attention deployment all-gathers one row per rank (upstream's
``MLPSyncBatchInfo``: 11 int64 values). Three ways of reaching the membership verdict are timed
over the same processes, pass after pass:

- ``upstream gather``: that gather alone (no agreement at all: the baseline);
- ``agreement in the gather`` (now): each row carries this rank's proposal columns
  (``core.agreement.pack_row``) and every rank reads the verdict from the gathered rows
  (``gathered_round``): no collective of its own;
- ``gather + all-reduce`` (before): the same gather, then one MAX all-reduce of
  ``(ready, -ready, target, abort)`` and ``lockstep_verdict``, the agreement's own collective.

Writes its table into docs/benchmarks.md between ``<!-- BEGIN agreement_cost -->`` and
``<!-- END agreement_cost -->``, with the command that produced it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402

from sglang_elastic_ep.controller.launchers.ports import free_port  # noqa: E402
from sglang_elastic_ep.core.agreement import (  # noqa: E402
    Proposal,
    StepKind,
    gathered_round,
    lockstep_verdict,
    pack_row,
)

UPSTREAM_COLUMNS = 11  # MLPSyncBatchInfo._get_local_tensor
WAYS = ("upstream gather", "agreement in the gather", "gather + all-reduce")


def _gather(row: torch.Tensor, world: int) -> list[torch.Tensor]:
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return rows


def _passes(rank: int, world: int, serving: int) -> dict[str, Callable[[], object]]:
    info = torch.arange(UPSTREAM_COLUMNS, dtype=torch.int64)
    proposal = Proposal(rank=rank, kind=StepKind.SHRINK, ready=0, target=serving - 1,
                        serving=serving)

    def upstream() -> object:
        return _gather(info, world)

    def in_the_gather() -> object:
        row = torch.cat([info, torch.tensor(pack_row(proposal), dtype=torch.int64)])
        rows = _gather(row, world)
        return gathered_round([r[UPSTREAM_COLUMNS:].tolist() for r in rows])

    def with_all_reduce() -> object:
        _gather(info, world)
        reduced = torch.tensor([proposal.ready, -proposal.ready, proposal.target, 0],
                               dtype=torch.int64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return lockstep_verdict(int(reduced[0]), -int(reduced[1]), int(reduced[2]))

    return dict(zip(WAYS, (upstream, in_the_gather, with_all_reduce), strict=True))


def _worker(rank: int, world: int, port: int, passes: int, rounds: int, out: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        ways = _passes(rank, world, serving=world)
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):  # interleaved, so drift in the machine's load hits every way
            for name, run in ways.items():
                for _ in range(passes // 10):  # warm-up
                    run()
                dist.barrier()
                for _ in range(passes):
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
        if rank == 0:
            lines = [f"{name}\t{' '.join(f'{t:.9f}' for t in samples)}"
                     for name, samples in times.items()]
            out.write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--passes", type=int, default=2000, help="timed passes per way and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    out = Path(f"/tmp/bench_agreement_cost.{os.getpid()}.tsv")
    mp.spawn(_worker, args=(args.ranks, free_port(), args.passes, args.rounds, out),
             nprocs=args.ranks, join=True)
    samples = {name: [float(v) for v in values.split()] for name, values in
               (line.split("\t") for line in out.read_text().splitlines())}
    out.unlink()
    base = statistics.median(samples[WAYS[0]])
    lines = [
        *section_head(
            "The per-pass cost of the rank agreement",
            f"{args.ranks} processes, gloo over 127.0.0.1 (the CPU bed's host collectives), "
            f"{args.rounds} rounds of {args.passes} timed passes per way, interleaved; rank 0's "
            "wall time per pass, including building the row and reading the verdict.",
        ),
        "| way | collectives per pass | median (us) | p99 (us) | added to the gather (us) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, collectives in zip(WAYS, (1, 1, 2), strict=True):
        median = statistics.median(samples[name])
        lines.append(f"| {name} | {collectives} | {median * 1e6:.1f} | "
                     f"{_quantile(samples[name], 0.99) * 1e6:.1f} | {(median - base) * 1e6:+.1f} |")
    lines += [
        "",
        "The agreement in the gather costs the few extra columns of one gather and a verdict read "
        "on the host; the all-reduce it replaced cost one more collective per pass, whose time "
        "on a GPU is a device collective plus the host sync to read its result.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("agreement_cost", text)


if __name__ == "__main__":
    main()

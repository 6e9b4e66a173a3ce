"""Diagnostic: where each scheduler of a grown cluster spends its time, beside a fresh cluster
of the same size. A 2-rank cluster is grown to 3 by a scale joiner under load (2 clients,
8-token greedy requests); after ``--settle-seconds`` it is measured, then stopped, and a fresh
3-rank cluster is measured under the same load (never two clusters at once). Each measurement
is, in order:

- a quiet window of ``--seconds``: completed requests per second, and every scheduler
  process's threads by the CPU they used (a thread's name, from ``/proc``, and cores used),
  read from ``/proc`` before and after, which costs the cluster nothing;
- then, unless ``--no-py-spy``, a py-spy window (``--idle``) of the same length: the share of
  each scheduler thread's samples with each frame below on the stack (parking and releasing
  Mooncake's worker, the pass's DP gather, the NIXL data plane's waits, the idle poll).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scenario import Timeline, grow_by_joiner, tiny_spec, under_load  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import py_spy  # noqa: E402

FRAMES = ("ThreadParker.unpark", "ThreadParker.park", "seeing_the_all_reduce.<locals>.all_reduce",
          "all_gather_single", "exchange_sync_rows", "NixlTransport._wait", "Poller.poll")
SCHEDULER_THREAD = "run_scheduler_process"
TOP_THREADS = 4


def frame_shares(raw: str) -> dict[str, float]:
    """Per frame of ``FRAMES``: the share of the scheduler thread's samples with it on the
    stack, from py-spy's raw output (``frame;frame;... count``)."""
    total = 0
    hits = dict.fromkeys(FRAMES, 0)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or SCHEDULER_THREAD not in stack:
            continue
        total += int(count)
        names = {frame.split(" (", 1)[0] for frame in stack.split(";")}
        for frame in FRAMES:
            hits[frame] += int(count) * (frame in names)
    return {frame: 100 * n / (total or 1) for frame, n in hits.items()}


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Thread id -> (its name, CPU seconds used so far) for every thread of ``pid``; the
    process's main thread (the scheduler's loop) is named ``main``."""
    out: dict[int, tuple[str, float]] = {}
    for thread in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            continue
        out[thread.id] = ("main" if thread.id == pid else name,
                          thread.user_time + thread.system_time)
    return out


def placement(pid: int) -> str:
    """What decides the process's CPU share beside the others: its nice value, session and
    scheduler autogroup."""
    proc = psutil.Process(pid)
    try:
        autogroup = Path(f"/proc/{pid}/autogroup").read_text().strip()
    except OSError:
        autogroup = "-"
    return f"nice {proc.nice()}, session {os.getsid(pid)}, autogroup {autogroup}"


def cpu_since(before: Mapping[int, tuple[str, float]], pid: int) -> list[tuple[str, float]]:
    """``pid``'s threads as (name/tid, CPU seconds used since ``before``, a
    ``thread_cpu_seconds`` of it), busiest first."""
    used = [(f"{name}/{tid}", cpu - before.get(tid, (name, 0.0))[1])
            for tid, (name, cpu) in thread_cpu_seconds(pid).items()]
    return sorted(used, key=lambda item: -item[1])


def busiest_threads(pids: Mapping[int, int], seconds: float) -> dict[int, list[tuple[str, float]]]:
    """Rank -> its scheduler's threads as (name/tid, cores used over ``seconds``), busiest
    first."""
    before = {rank: thread_cpu_seconds(pid) for rank, pid in pids.items()}
    time.sleep(seconds)
    return {rank: [(name, cpu / seconds) for name, cpu in cpu_since(before[rank], pid)]
            for rank, pid in pids.items()}


def measure(label: str, timeline: Timeline, pids: Mapping[int, int], seconds: int,
            with_py_spy: bool) -> None:
    start_count = timeline.completed()
    threads = busiest_threads(pids, seconds)
    rate = (timeline.completed() - start_count) / seconds
    print(f"== {label}: {rate:.2f} requests/s over {seconds} s")
    for rank in sorted(threads):
        total = sum(cores for _, cores in threads[rank])
        top = ", ".join(f"{name} {cores:.2f}" for name, cores in threads[rank][:TOP_THREADS])
        print(f"rank {rank} ({placement(pids[rank])}): {total:.2f} cores in all; busiest: "
              f"{top}")
    tool = py_spy()
    if not with_py_spy or tool is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        outs = {rank: Path(tmp) / f"rank{rank}.txt" for rank in pids}
        samplers = [subprocess.Popen([tool, "record", "--pid", str(pid), "--duration",
                                      str(seconds), "--format", "raw", "--output",
                                      str(outs[rank]), "--nonblocking", "--idle"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for rank, pid in pids.items()]
        for sampler in samplers:
            sampler.wait(timeout=seconds + 120)
        for rank in sorted(outs):
            shares = frame_shares(outs[rank].read_text()) if outs[rank].exists() else {}
            print(f"rank {rank} py-spy: " + ", ".join(f"{frame} {share:.1f} %"
                                                      for frame, share in shares.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-seconds", type=float, default=20.0)
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--no-py-spy", action="store_true")
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh 3-rank cluster")
    args = parser.parse_args()
    with LocalCluster(tiny_spec()) as cluster, under_load(cluster) as timeline:
        joiner = grow_by_joiner(cluster, "profile-grow")
        time.sleep(args.settle_seconds)  # the joiner's first passes (NIXL handshakes) settle
        assert cluster.primary is not None
        pids = {**cluster.primary.scheduler_pids(), **joiner.scheduler_pids()}
        measure("grown 2 -> 3", timeline, pids, args.seconds, not args.no_py_spy)
    if args.no_fresh:
        return
    # 16 experts need 24 slots on 3 launch ranks (the slots a 2 -> 3 scale-up reaches too).
    fresh = tiny_spec(3, extra_args=("--ep-num-redundant-experts", "8"))
    with LocalCluster(fresh) as cluster, under_load(cluster) as timeline:
        time.sleep(args.settle_seconds)
        assert cluster.primary is not None
        measure("fresh 3", timeline, cluster.primary.scheduler_pids(), args.seconds,
                not args.no_py_spy)


if __name__ == "__main__":
    main()

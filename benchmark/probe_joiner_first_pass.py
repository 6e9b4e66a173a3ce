"""Diagnostic: where the time goes between a prepared scale joiner's registration and the
operation's commit as the HTTP status reports it (the scale-up benchmark's "ready ->
`serving_expanded`"). A 2-rank cluster under load (2 clients, 8-token greedy requests) grows to
3 and shrinks back ``--cycles`` times. From the joiner's registration, every scheduler is
sampled for ``--seconds``: py-spy (``--idle``, raw, kept in ``--out``) and the CPU each of its
threads used (from ``/proc``). Per cycle it prints ready -> committed, each scheduler thread's
share of samples in the frames of ``profile_grown_cluster.FRAMES``, and each process's
busiest threads.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scenario import logged, operation_succeeded, tiny_spec, under_load  # noqa: E402
from profile_grown_cluster import (  # noqa: E402
    TOP_THREADS,
    cpu_since,
    frame_shares,
    thread_cpu_seconds,
)

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import py_spy  # noqa: E402
from sglang_elastic_ep_testbed.cluster.waits import wait_until  # noqa: E402

WARM_UP_S = 15.0
STEADY_S = 10.0


def cycle(cluster: LocalCluster, n: int, seconds: int, out: Path, tool: str) -> None:
    assert cluster.primary is not None
    time.sleep(STEADY_S)
    joiner = cluster.start_joiner("scale", rank_offset=2)
    operation = f"probe-{n}"
    post_scale(cluster.url, 3, operation)
    logged(joiner, "registered its cohort", 300)
    ready = time.monotonic()
    pids = {**cluster.primary.scheduler_pids(), **joiner.scheduler_pids()}
    before = {rank: thread_cpu_seconds(pid) for rank, pid in pids.items()}
    raw = {rank: out / f"cycle{n}-rank{rank}.txt" for rank in pids}
    samplers = [subprocess.Popen([tool, "record", "--pid", str(pid), "--duration", str(seconds),
                                  "--rate", "50", "--format", "raw", "--output", str(raw[rank]),
                                  "--nonblocking", "--idle", "--threads"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for rank, pid in pids.items()]
    operation_succeeded(cluster.url, operation, 300)
    committed = time.monotonic() - ready
    for sampler in samplers:
        sampler.wait(timeout=seconds + 120)
    window = time.monotonic() - ready
    print(f"== cycle {n}: ready -> committed {committed:.2f} s; sampled {window:.1f} s "
          f"(joiner log {joiner.log_path})")
    for rank, pid in sorted(pids.items()):
        shares = frame_shares(raw[rank].read_text()) if raw[rank].exists() else {}
        frames = ", ".join(f"{frame} {share:.0f} %" for frame, share in shares.items()
                           if share >= 1)
        top = cpu_since(before[rank], pid)[:TOP_THREADS]
        busiest = ", ".join(f"{name} {cpu:.2f}" for name, cpu in top)
        print(f"rank {rank}: CPU s {busiest}; scheduler thread: {frames}")
    post_scale(cluster.url, 2, operation + "-down")
    operation_succeeded(cluster.url, operation + "-down", 300)
    wait_until(lambda: not joiner.alive(), 120, f"{joiner.log_path.name} exited", poll_s=0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("probe-joiner-first-pass"))
    args = parser.parse_args()
    tool = py_spy()
    if tool is None:
        sys.exit("py-spy is not installed (scripts/setup.sh installs it)")
    args.out.mkdir(parents=True, exist_ok=True)
    with LocalCluster(tiny_spec()) as cluster, under_load(cluster):
        time.sleep(WARM_UP_S)
        for n in range(1, args.cycles + 1):
            cycle(cluster, n, args.seconds, args.out, tool)


if __name__ == "__main__":
    main()

"""Diagnostic: where each scheduler of a grown cluster spends its time. A 2-rank cluster is
grown to 3 by a scale joiner under load (2 clients, 8-token greedy requests); after
``--settle-seconds`` every scheduler is sampled with py-spy (``--idle``) for ``--seconds``, at
the same time. Prints, per rank, the share of its scheduler thread's samples that have each
frame below on the stack: parking and releasing Mooncake's worker, the pass's DP gather (an
all-reduce over the expanded WORLD in a grown cluster), the NIXL data plane's waits, and the
idle poll.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scenario import grow_by_joiner, tiny_spec, under_load  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import py_spy  # noqa: E402

FRAMES = ("ThreadParker.unpark", "ThreadParker.park", "seeing_the_all_reduce.<locals>.all_reduce",
          "exchange_sync_rows", "NixlTransport._wait", "Poller.poll")
SCHEDULER_THREAD = "run_scheduler_process"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settle-seconds", type=float, default=20.0)
    parser.add_argument("--seconds", type=int, default=15)
    args = parser.parse_args()
    tool = py_spy()
    if tool is None:
        sys.exit("py-spy not found")
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(tiny_spec()) as cluster, \
            under_load(cluster):
        joiner = grow_by_joiner(cluster, "profile-grow")
        time.sleep(args.settle_seconds)  # the joiner's first passes (NIXL handshakes) settle
        assert cluster.primary is not None
        pids = {**cluster.primary.scheduler_pids(), **joiner.scheduler_pids()}
        outs = {rank: Path(tmp) / f"rank{rank}.txt" for rank in pids}
        samplers = [subprocess.Popen([tool, "record", "--pid", str(pid), "--duration",
                                      str(args.seconds), "--format", "raw", "--output",
                                      str(outs[rank]), "--nonblocking", "--idle"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for rank, pid in pids.items()]
        for sampler in samplers:
            sampler.wait(timeout=args.seconds + 120)
        for rank in sorted(outs):
            shares = frame_shares(outs[rank].read_text()) if outs[rank].exists() else {}
            print(f"rank {rank}: " + ", ".join(f"{frame} {share:.1f} %"
                                               for frame, share in shares.items()))


if __name__ == "__main__":
    main()

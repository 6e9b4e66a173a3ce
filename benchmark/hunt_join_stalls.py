"""Diagnostic for the known issue in docs/design.md: kill -9 and recover a node under load,
``--iterations`` times; when requests stop completing, py-spy every scheduler into
``--dumps``. Prints ``ok`` or ``stalled`` per iteration. ``--scenario joiner`` kills and
recovers a rank that joined by scale-up instead.

Stop 9: with thread parking on, 2 of 4 iterations stalled, with it off 0 of 4. Stop 10, after
the idle membership step moved out of ``Scheduler.on_idle`` (docs/design.md, "Fixed: the first
idle pass"): parking on, 4 of 4 ok.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scenario import REPLICATED, Timeline, grow_by_joiner, tiny_spec, under_load  # noqa: E402

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import wait_rank_state  # noqa: E402


def fault_reported(timeline: Timeline, rank: int, dumps: Path, tag: str) -> bool:
    """Whether the status marks the killed ``rank`` failed in time; stacks dumped if not."""
    try:
        wait_rank_state(timeline.url, rank, "failed", 60)
    except TimeoutError:
        timeline.cluster.dump_stacks(f"{tag}: fault never reported", out=dumps)
        return False
    return True


def progress_or_dump(timeline: Timeline, dumps: Path, tag: str, seconds: float) -> bool:
    """Whether a request completes within ``seconds``; stacks dumped (``tag``) if none does."""
    served = timeline.completed()
    timeline.hold(seconds)
    if timeline.completed() > served:
        return True
    timeline.cluster.dump_stacks(tag, out=dumps)
    return False


def one_iteration(spec: ClusterSpec, dumps: Path, tag: str) -> str:
    with LocalCluster(spec) as cluster, under_load(cluster) as timeline:
        timeline.hold(3.0)
        cluster.kill_node(1)
        if not fault_reported(timeline, 1, dumps, tag):
            return "stalled at the fault"
        timeline.hold(3.0)
        cluster.start_node(1, recover=True)
        wait_rank_state(timeline.url, 1, "active", 300)
        if not progress_or_dump(timeline, dumps, f"{tag}: stalled after recovery", 15.0):
            return "stalled after recovery"
        return "ok"


def one_joiner_iteration(spec: ClusterSpec, dumps: Path, tag: str) -> str:
    """2 -> 3 by a joiner, kill it under load, relaunch it with --ep-join-mode recover."""
    with LocalCluster(spec) as cluster:
        joiner = grow_by_joiner(cluster, "g")
        with under_load(cluster) as timeline:
            if not progress_or_dump(timeline, dumps, f"{tag}: stalled after the scale-up", 60.0):
                return "stalled after the scale-up"
            cluster.kill_server(joiner)
            if not fault_reported(timeline, 2, dumps, tag):
                return "stalled at the fault"
            if not progress_or_dump(timeline, dumps, f"{tag}: stalled after the fault", 15.0):
                return "stalled after the fault"
            cluster.start_joiner("recover", rank_offset=2)
            wait_rank_state(timeline.url, 2, "active", 420)
            if not progress_or_dump(timeline, dumps, f"{tag}: stalled after recovery", 60.0):
                return "stalled after recovery"
            return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--dumps", type=Path, default=Path("stall_dumps.txt"))
    parser.add_argument("--scenario", choices=["node", "joiner"], default="node",
                        help="node: kill and recover launch node 1; joiner: a scale-joined rank")
    args = parser.parse_args()
    joiner = args.scenario == "joiner"
    spec = tiny_spec(nodes=1 if joiner else 2, extra_args=REPLICATED)
    iteration = one_joiner_iteration if joiner else one_iteration
    for i in range(args.iterations):
        print(f"iteration {i}: {iteration(spec, args.dumps, f'iteration {i}')}", flush=True)


if __name__ == "__main__":
    main()

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
import time
from pathlib import Path

import httpx

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep.cluster.observe import wait_operation, wait_rank_state
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model


def one_iteration(spec: ClusterSpec, dumps: Path, tag: str) -> str:
    with LocalCluster(spec) as cluster:
        url = cluster.url
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(3.0)
            cluster.kill_node(1)
            try:
                wait_rank_state(url, 1, "failed", 60)
            except TimeoutError:
                cluster.dump_stacks(f"{tag}: fault never reported", out=dumps)
                return "stalled at the fault"
            time.sleep(3.0)
            cluster.start_node(1, recover=True)
            wait_rank_state(url, 1, "active", 300)
            served = len(load.snapshot())
            time.sleep(15.0)
            if len(load.snapshot()) == served:
                cluster.dump_stacks(f"{tag}: stalled after recovery", out=dumps)
                return "stalled after recovery"
            return "ok"
        finally:
            load.stop()


def progress_or_dump(cluster: LocalCluster, load: LoadClient, dumps: Path, tag: str,
                     seconds: float) -> bool:
    served = len(load.snapshot())
    time.sleep(seconds)
    if len(load.snapshot()) > served:
        return True
    cluster.dump_stacks(tag, out=dumps)
    return False


def one_joiner_iteration(spec: ClusterSpec, dumps: Path, tag: str) -> str:
    """2 -> 3 by a joiner, kill it under load, relaunch it with --ep-join-mode recover."""
    with LocalCluster(spec) as cluster:
        url = cluster.url
        joiner = cluster.start_joiner("scale", rank_offset=2)
        httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": 3, "operation_id": "g"},
                   timeout=60).raise_for_status()
        wait_operation(url, "g", 420)
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            tag_up = f"{tag}: stalled after the scale-up"
            if not progress_or_dump(cluster, load, dumps, tag_up, 60.0):
                return "stalled after the scale-up"
            cluster.kill_server(joiner)
            try:
                wait_rank_state(url, 2, "failed", 60)
            except TimeoutError:
                cluster.dump_stacks(f"{tag}: fault never reported", out=dumps)
                return "stalled at the fault"
            if not progress_or_dump(cluster, load, dumps, f"{tag}: stalled after the fault", 15.0):
                return "stalled after the fault"
            cluster.start_joiner("recover", rank_offset=2)
            wait_rank_state(url, 2, "active", 420)
            if not progress_or_dump(cluster, load, dumps, f"{tag}: stalled after recovery", 60.0):
                return "stalled after recovery"
            return "ok"
        finally:
            load.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--dumps", type=Path, default=Path("stall_dumps.txt"))
    parser.add_argument("--scenario", choices=["node", "joiner"], default="node",
                        help="node: kill and recover launch node 1; joiner: a scale-joined rank")
    args = parser.parse_args()
    joiner = args.scenario == "joiner"
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4,
                       moe_a2a_backend="nixl", nodes=1 if joiner else 2,
                       extra_args=["--ep-num-redundant-experts", "16"])
    iteration = one_joiner_iteration if joiner else one_iteration
    for i in range(args.iterations):
        print(f"iteration {i}: {iteration(spec, args.dumps, f'iteration {i}')}", flush=True)


if __name__ == "__main__":
    main()

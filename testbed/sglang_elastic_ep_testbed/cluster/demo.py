"""The README demo: a 2-rank EP cluster on CPU serving a steady stream of requests scales to 3
ranks at runtime, then back to 2. Prints the phase timeline of both operations, which ranks
became safe to terminate and when, and where requests were served.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from sglang_elastic_ep_testbed.cluster.launcher import ClusterSpec, LocalCluster
from sglang_elastic_ep_testbed.cluster.load import DEFAULT_PROMPTS, LoadClient, RequestResult
from sglang_elastic_ep_testbed.cluster.observe import sse_events, status, wait_operation
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model

console = Console()
OPERATION_ID = "demo-grow"
SHRINK_ID = "demo-shrink"


def prefill_batches(log: Path, shard: int) -> int:
    """Batches a shard's scheduler ran (a joiner's responses carry no dp_rank)."""
    return log.read_text(errors="replace").count(f" DP{shard}] Prefill batch")


def timeline(url: str, t0_wall: float) -> Table:
    table = Table(title=f"operations {OPERATION_ID}, {SHRINK_ID}: events (SSE)")
    for col in ("t (s)", "operation", "event", "ranks", "detail"):
        table.add_column(col)
    for event in sse_events(url):
        if event.get("operation_id") not in (OPERATION_ID, SHRINK_ID):
            continue
        detail = ""
        if event["type"] == "scale_committed":
            sizes = f"{event['old_ep_size']} -> {event['new_ep_size']}"
            detail = f"{sizes} in {event['duration_s']:.1f} s"
        table.add_row(f"{event['time'] - t0_wall:6.1f}", event["operation_id"], event["type"],
                      str(event.get("ranks", "")), detail)
    return table


def phases(operations: list[dict], t0_wall: float) -> Table:
    table = Table(title="phases (GET /elastic_ep/status)")
    for col in ("t (s)", "operation", "phase"):
        table.add_column(col)
    for operation in operations:
        for stamp in operation["phase_timestamps"]:
            table.add_row(f"{stamp['at'] - t0_wall:6.1f}", operation["operation_id"],
                          stamp["phase"])
    return table


def summary(results: list[RequestResult], new_shard_batches: int) -> str:
    ok = sum(r.ok for r in results)
    return (f"[bold]{ok}/{len(results)} requests ok[/]; the new shard 2 ran "
            f"{new_shard_batches} prefill batches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="steady traffic before/after")
    args = parser.parse_args()

    model = write_tiny_model(DEFAULT_DIR)
    spec = ClusterSpec(model, ep_size=2, max_ep_size=4, moe_a2a_backend="nixl")
    console.print(f"[bold]starting a 2-rank EP cluster on CPU[/] (max 4 ranks; model {model})")
    t_launch = time.monotonic()
    with LocalCluster(spec) as cluster:
        url = cluster.url
        console.print(f"ready in {time.monotonic() - t_launch:.0f} s at {url}; "
                      f"logs in {spec.log_dir}")
        t0_wall = time.time()
        with LoadClient(url, DEFAULT_PROMPTS, concurrency=2) as load:
            time.sleep(args.seconds)
            console.print(f"{len(load.snapshot())} requests served by 2 ranks; launching a "
                          "joiner (--ep-join-mode scale) and POSTing /scale_elastic_ep 2 -> 3")
            joiner = cluster.start_joiner("scale", rank_offset=2)
            resp = httpx.post(url + "/scale_elastic_ep",
                              json={"new_ep_size": 3, "operation_id": OPERATION_ID}, timeout=60)
            console.print(f"POST -> {resp.status_code}: {resp.json()['message']}")
            result = wait_operation(url, OPERATION_ID, 600)
            console.print(f"operation {result['result']} in {result['duration_s']:.1f} s; "
                          f"serving with {status(url)['effective_ep_size']} ranks")
            time.sleep(args.seconds)
            # Shrink only once shard 2 served: its first batch can take longer than the
            # traffic window on a busy machine.
            wait_until(lambda: prefill_batches(joiner.log_path, 2), 300,
                       "a batch run by the new shard 2")
            console.print(f"{len(load.snapshot())} requests so far; POSTing /scale_elastic_ep "
                          "3 -> 2 (shard 2 drains, then rank 2 is released)")
            resp = httpx.post(url + "/scale_elastic_ep",
                              json={"new_ep_size": 2, "operation_id": SHRINK_ID}, timeout=60)
            console.print(f"POST -> {resp.status_code}: {resp.json()['message']}")
            shrink = wait_operation(url, SHRINK_ID, 600)
            after = status(url)
            safe = after["safe_to_terminate_ranks"]
            console.print(f"operation {shrink['result']} in {shrink['duration_s']:.1f} s; "
                          f"serving with {after['effective_ep_size']} ranks; "
                          f"[bold]safe to terminate: ranks {safe}[/]")
            exit_code = joiner.wait_exit(60)
            console.print(f"the joiner's server (rank 2) exited by itself with code {exit_code}")
            time.sleep(args.seconds)
        results = load.snapshot()
        batches = prefill_batches(joiner.log_path, 2)
        console.print(phases([result, shrink], t0_wall))
        console.print(timeline(url, t0_wall))
        console.print(summary(results, batches))
        ok = result["result"] == shrink["result"] == "succeeded" and exit_code == 0
        if not ok or not all(r.ok for r in results) or batches == 0:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

"""The README demo: a 2-rank EP cluster on CPU serving a steady stream of requests scales to 3
ranks at runtime. Prints the phase timeline of the operation and where requests were served.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from sglang_elastic_ep.cluster.launcher import ClusterSpec, LocalCluster
from sglang_elastic_ep.cluster.load import DEFAULT_PROMPTS, LoadClient, RequestResult
from sglang_elastic_ep.cluster.observe import sse_events, status, wait_operation
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model

console = Console()
OPERATION_ID = "demo-grow"


def prefill_batches(log: Path, shard: int) -> int:
    """Batches a shard's scheduler ran (a joiner's responses carry no dp_rank)."""
    return log.read_text(errors="replace").count(f" DP{shard}] Prefill batch")


def timeline(url: str, t0_wall: float) -> Table:
    table = Table(title=f"operation {OPERATION_ID}: events (SSE)")
    for col in ("t (s)", "event", "ranks", "detail"):
        table.add_column(col)
    for event in sse_events(url):
        if event.get("operation_id") != OPERATION_ID:
            continue
        detail = ""
        if event["type"] == "scale_committed":
            sizes = f"{event['old_ep_size']} -> {event['new_ep_size']}"
            detail = f"{sizes} in {event['duration_s']:.1f} s"
        table.add_row(f"{event['time'] - t0_wall:6.1f}", event["type"],
                      str(event.get("ranks", "")), detail)
    return table


def phases(operation: dict, t0_wall: float) -> Table:
    table = Table(title=f"operation {OPERATION_ID}: phases (GET /elastic_ep/status)")
    table.add_column("t (s)")
    table.add_column("phase")
    for stamp in operation["phase_timestamps"]:
        table.add_row(f"{stamp['at'] - t0_wall:6.1f}", stamp["phase"])
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
        results = load.snapshot()
        batches = prefill_batches(joiner.log_path, 2)
        console.print(phases(result, t0_wall))
        console.print(timeline(url, t0_wall))
        console.print(summary(results, batches))
        if result["result"] != "succeeded" or not all(r.ok for r in results) or batches == 0:
            raise SystemExit(1)


if __name__ == "__main__":
    main()

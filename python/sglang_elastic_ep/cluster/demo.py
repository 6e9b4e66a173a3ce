"""The README demo: a CPU cluster serving a short stream of requests, printing what it served."""

from __future__ import annotations

import argparse
import time

import httpx
from rich.console import Console
from rich.table import Table

from sglang_elastic_ep.cluster.launcher import ClusterSpec, LocalCluster
from sglang_elastic_ep.cluster.load import DEFAULT_PROMPTS, LoadClient
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model

console = Console()


def served_table(results: list, tokenizer_url: str, t0: float) -> Table:
    table = Table(title="requests served")
    for col in ("t (s)", "shard", "prompt", "status", "first tokens"):
        table.add_column(col)
    for r in results:
        table.add_row(
            f"{r.finished - t0:6.1f}", str(r.dp_rank), r.prompt, "ok" if r.ok else f"{r.status}",
            " ".join(map(str, r.output_ids[:6])),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to send traffic")
    args = parser.parse_args()

    model = write_tiny_model(DEFAULT_DIR)
    spec = ClusterSpec(model, ep_size=args.ranks)
    console.print(f"[bold]starting a {args.ranks}-rank EP cluster on CPU[/] (model {model})")
    t_launch = time.monotonic()
    with LocalCluster(spec) as cluster:
        console.print(f"ready in {time.monotonic() - t_launch:.0f} s at {cluster.url}; "
                      f"logs in {spec.log_dir}")
        info = httpx.get(cluster.url + "/server_info", timeout=30).json()
        console.print(f"ep_size={info['ep_size']} elastic_ep_backend={info['elastic_ep_backend']}")
        t0 = time.monotonic()
        with LoadClient(cluster.url, DEFAULT_PROMPTS, concurrency=2) as load:
            time.sleep(args.seconds)
        results = load.snapshot()
        console.print(served_table(results, cluster.url, t0))
        ok = sum(r.ok for r in results)
        per_shard: dict[object, int] = {}
        for r in results:
            per_shard[r.dp_rank] = per_shard.get(r.dp_rank, 0) + int(r.ok)
        console.print(f"[bold]{ok}/{len(results)} requests ok[/], per shard {per_shard}")
        if ok != len(results):
            raise SystemExit(1)


if __name__ == "__main__":
    main()

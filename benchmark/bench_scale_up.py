"""Runtime scale-up 2 -> 3 on the CPU cluster under steady load: control-plane latency (from the
joiner being ready to ``serving_expanded``) and the longest gap between completed requests
during the scale window vs steady state.

The joiner is launched before the POST; "ready" is the moment its scheduler logs that it
finished loading weights. Writes docs/benchmarks.md section ``scale_up``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402
from bench_recovery import scheduler_joined  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import wait_operation  # noqa: E402
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402


def run(steady_s: float) -> dict[str, float]:
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4,
                       moe_a2a_backend="nixl")
    with LocalCluster(spec) as cluster:
        url = cluster.url
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            t_steady = time.monotonic()
            time.sleep(steady_s)
            t_launch = time.monotonic()
            joiner = cluster.start_joiner("scale", rank_offset=2)
            t_post = time.monotonic()
            resp = httpx.post(url + "/scale_elastic_ep",
                              json={"new_ep_size": 3, "operation_id": "bench-grow"}, timeout=60)
            resp.raise_for_status()
            t_ready = scheduler_joined(joiner.log_path, 300)
            operation = wait_operation(url, "bench-grow", 420)
            t_committed = time.monotonic()
            if operation["result"] != "succeeded":
                raise RuntimeError(f"scale-up failed: {operation}")
            time.sleep(steady_s)
            t_end = time.monotonic()
        finally:
            results = load.stop()
    return {
        "launch_to_ready_s": t_ready - t_launch,
        "ready_to_committed_s": t_committed - t_ready,
        "post_to_committed_s": t_committed - t_post,
        "gap_steady_s": longest_gap(results, t_steady + 2.0, t_launch),
        "gap_scale_s": longest_gap(results, t_launch, t_committed),
        "gap_after_s": longest_gap(results, t_committed, t_end),
        **load_counts(results),
    }


def main() -> None:
    r = run_under_load(__doc__, run)
    lines = [
        *seconds_table(
            "Runtime scale-up 2 -> 3 under load (issue: scale-up and crash recovery, item 8)",
            "Primary with 2 EP ranks (`--moe-a2a-backend nixl`), 2 concurrent clients sending "
            "8-token greedy requests back to back; the joiner is launched, then the scale POSTed.",
        ),
        f"| joiner launched -> its weights loaded (ready) | {r['launch_to_ready_s']:.1f} |",
        f"| joiner ready -> `serving_expanded` (control-plane latency) | "
        f"{r['ready_to_committed_s']:.1f} |",
        f"| POST -> `serving_expanded` | {r['post_to_committed_s']:.1f} |",
        f"| longest gap between completed requests, steady state | {r['gap_steady_s']:.2f} |",
        f"| longest gap, joiner launch -> committed | {r['gap_scale_s']:.2f} |",
        f"| longest gap, after the commit | {r['gap_after_s']:.2f} |",
        "",
        f"{int(r['requests'])} requests, {int(r['failed'])} failed. The joiner's start-up "
        "(imports, weights, Mooncake set-up) shares the 2 cores with the serving ranks; the gap "
        "after the commit covers the first passes with the new rank, which creates its NIXL "
        "buffer and handshakes with every peer on its first dispatch.",
    ]
    write_section("scale_up", "\n".join(lines))


if __name__ == "__main__":
    main()

"""Runtime scale-down 3 -> 2 on the CPU cluster under steady load: POST -> ``safe_to_terminate``
latency, and the longest gap between completed requests during the shrink vs steady state.

The cluster is grown 2 -> 3 first (a joiner), then shrunk back; the leaving rank is that joiner,
whose server then exits by itself. Writes docs/benchmarks.md section ``scale_down``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import (  # noqa: E402
    post_scale,
    sse_events,
    wait_operation,
)
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402


def run(steady_s: float) -> dict[str, float]:
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4,
                       moe_a2a_backend="nixl")
    with LocalCluster(spec) as cluster:
        url = cluster.url
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            joiner = cluster.start_joiner("scale", rank_offset=2)
            post_scale(url, 3, "bench-grow")
            if wait_operation(url, "bench-grow", 420)["result"] != "succeeded":
                raise RuntimeError("scale-up 2 -> 3 failed")
            time.sleep(steady_s)  # the joiner's first passes (NIXL handshakes) settle first
            t_steady = time.monotonic()
            time.sleep(steady_s)
            t_post = time.monotonic()
            post_scale(url, 2, "bench-shrink")
            operation = wait_operation(url, "bench-shrink", 420)
            t_committed = time.monotonic()
            if operation["result"] != "succeeded":
                raise RuntimeError(f"scale-down failed: {operation}")
            if joiner.wait_exit(120) != 0:
                raise RuntimeError("the leaving rank's server did not exit with code 0")
            t_exit = time.monotonic()
            time.sleep(steady_s)
            t_end = time.monotonic()
            events = sse_events(url)
        finally:
            results = load.stop()
    safe = [e for e in events
            if e.get("operation_id") == "bench-shrink" and e["type"] == "safe_to_terminate"]
    if not safe:
        raise RuntimeError("no safe_to_terminate event")
    return {
        "post_to_safe_s": t_committed - t_post,
        "safe_to_exit_s": t_exit - t_committed,
        "gap_steady_s": longest_gap(results, t_steady, t_post),
        "gap_shrink_s": longest_gap(results, t_post, t_committed),
        "gap_after_s": longest_gap(results, t_committed, t_end),
        **load_counts(results),
    }


def main() -> None:
    r = run_under_load(__doc__, run)
    lines = [
        *seconds_table(
            "Runtime scale-down 3 -> 2 under load (issue: scale-down, item 9)",
            "A 2-rank primary grown to 3 by a joiner (`--moe-a2a-backend nixl`), 2 concurrent "
            "clients sending 8-token greedy requests back to back; after the scale-up has "
            "settled (`--steady-seconds`), the steady window, then `new_ep_size: 2`.",
        ),
        f"| POST -> `safe_to_terminate` for rank 2 (operation committed) | "
        f"{r['post_to_safe_s']:.1f} |",
        f"| `safe_to_terminate` -> the leaving rank's server exited (code 0) | "
        f"{r['safe_to_exit_s']:.1f} |",
        f"| longest gap between completed requests, steady state (3 ranks) | "
        f"{r['gap_steady_s']:.2f} |",
        f"| longest gap, POST -> committed | {r['gap_shrink_s']:.2f} |",
        f"| longest gap, after the commit (2 ranks) | {r['gap_after_s']:.2f} |",
        "",
        f"{int(r['requests'])} requests, {int(r['failed'])} failed. The shrink waits for shard "
        "2's running requests to finish (drain), then all ranks switch the expert map and "
        "release rank 2 on one agreed pass.",
    ]
    write_section("scale_down", "\n".join(lines))


if __name__ == "__main__":
    main()

"""Runtime scale-down on the CPU cluster under steady load, side by side in one run: 3 -> 2 with
no expert to move, and 3 -> 1 where half of the experts move P2P before the ranks leave.
POST -> ``safe_to_terminate`` latency, the move's own time, and the longest gap between
completed requests during each shrink vs steady state.

One cluster: launched with 2 ranks whose placement (``--init-expert-location``) puts experts
0..7 twice on rank 0 and 8..15 twice on rank 1; grown to 3 by a joiner, shrunk to 2 (the
joiner leaves, its copies are not needed), grown to 3 again, then shrunk to 1 (experts 8..15
move from the leaving ranks into rank 0's duplicate slots). Writes docs/benchmarks.md section
``scale_down``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import sse_events, wait_operation  # noqa: E402
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402

HALVES = [*range(8), *range(8), *range(8, 16), *range(8, 16)]  # 2 ranks x 16 slots
MOVE_LOG = re.compile(r"rank 0: moved experts into (\d+) slots .* \(([\d.]+) s\)")


def post_scale(url: str, size: int, operation_id: str) -> None:
    httpx.post(url + "/scale_elastic_ep", json={"new_ep_size": size, "operation_id": operation_id},
               timeout=60).raise_for_status()


def succeed(url: str, operation_id: str) -> None:
    operation = wait_operation(url, operation_id, 420)
    if operation["result"] != "succeeded":
        raise RuntimeError(f"{operation_id} failed: {operation}")


def grow_to_3(cluster: LocalCluster, operation_id: str, steady_s: float) -> None:
    cluster.start_joiner("scale", rank_offset=2)
    post_scale(cluster.url, 3, operation_id)
    succeed(cluster.url, operation_id)
    time.sleep(steady_s)  # the joiner's first passes (NIXL handshakes) settle first


def shrink(cluster: LocalCluster, size: int, operation_id: str,
           steady_s: float) -> dict[str, float]:
    """Steady window, the shrink, the joiner's exit, a window after; times and gap bounds."""
    t_steady = time.monotonic()
    time.sleep(steady_s)
    t_post = time.monotonic()
    post_scale(cluster.url, size, operation_id)
    succeed(cluster.url, operation_id)
    t_committed = time.monotonic()
    if cluster.joiners[-1].wait_exit(120) != 0:
        raise RuntimeError("the leaving joiner's server did not exit with code 0")
    t_exit = time.monotonic()
    time.sleep(steady_s)
    return {"steady": t_steady, "post": t_post, "committed": t_committed, "exit": t_exit,
            "end": time.monotonic()}


def run(steady_s: float) -> dict[str, float]:
    placement = json.dumps({"physical_to_logical_map": [HALVES, HALVES]})
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4,
                       moe_a2a_backend="nixl",
                       extra_args=["--ep-num-redundant-experts", "16",
                                   "--init-expert-location", placement])
    with LocalCluster(spec) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
        try:
            grow_to_3(cluster, "bench-grow", steady_s)
            plain = shrink(cluster, 2, "bench-shrink", steady_s)
            grow_to_3(cluster, "bench-grow-again", steady_s)
            moving = shrink(cluster, 1, "bench-shrink-moving", steady_s)
            events = sse_events(cluster.url)
        finally:
            results = load.stop()
        log = cluster.primary.log_path.read_text(errors="replace")
    for operation_id in ("bench-shrink", "bench-shrink-moving"):
        if not any(e.get("operation_id") == operation_id and e["type"] == "safe_to_terminate"
                   for e in events):
            raise RuntimeError(f"no safe_to_terminate event for {operation_id}")
    moves = MOVE_LOG.findall(log)
    if len(moves) != 1:
        raise RuntimeError(f"expected one logged expert move on rank 0, found {moves}")
    out: dict[str, float] = {"moved_slots": float(moves[0][0]), "move_s": float(moves[0][1])}
    for name, t in (("plain", plain), ("moving", moving)):
        out |= {
            f"{name}_post_to_safe_s": t["committed"] - t["post"],
            f"{name}_safe_to_exit_s": t["exit"] - t["committed"],
            f"{name}_gap_steady_s": longest_gap(results, t["steady"], t["post"]),
            f"{name}_gap_shrink_s": longest_gap(results, t["post"], t["committed"]),
            f"{name}_gap_after_s": longest_gap(results, t["committed"], t["end"]),
        }
    return out | load_counts(results)


def main() -> None:
    r = run_under_load(__doc__, run)
    header = seconds_table(
        "Runtime scale-down under load: 3 -> 2, and 3 -> 1 with expert moves (issue: scale-down, "
        "item 9)",
        "A 2-rank primary (`--moe-a2a-backend nixl`, 16 expert slots per rank: experts 0..7 "
        "twice on rank 0, 8..15 twice on rank 1) grown to 3 by a joiner, 2 concurrent clients "
        "sending 8-token greedy requests back to back. 3 -> 2 removes the joiner, whose slots "
        "are only copies; after growing to 3 again, 3 -> 1 removes ranks 1 and 2, and experts "
        "8..15 move into rank 0 first. Each shrink after `--steady-seconds` of traffic.",
    )
    header[-2:] = ["| measure | 3 -> 2 (nothing moves) | 3 -> 1 (experts move) |",
                   "|---|---:|---:|"]
    rows = [
        ("POST -> `safe_to_terminate` (operation committed)", "post_to_safe_s", 1),
        ("`safe_to_terminate` -> the joiner's server exited (code 0)", "safe_to_exit_s", 1),
        ("longest gap between completed requests, steady state (3 ranks)", "gap_steady_s", 2),
        ("longest gap, POST -> committed", "gap_shrink_s", 2),
        ("longest gap, after the commit", "gap_after_s", 2),
    ]
    lines = [
        *header,
        *(f"| {label} | {r['plain_' + key]:.{digits}f} | {r['moving_' + key]:.{digits}f} |"
          for label, key, digits in rows),
        f"| expert weight move on the commit pass (rank 0's log) | - | {r['move_s']:.3f} |",
        "",
        f"{int(r['requests'])} requests, {int(r['failed'])} failed. {int(r['moved_slots'])} "
        "physical slots (8 experts x 2 layers) received weights P2P. Each shrink waits for the "
        "leaving shards' running requests to finish (drain); then all ranks move experts, "
        "switch the expert map and release the tail on one agreed pass.",
    ]
    write_section("scale_down", "\n".join(lines))


if __name__ == "__main__":
    main()

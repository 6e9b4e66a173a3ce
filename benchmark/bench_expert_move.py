"""Scale-down 3 -> 2 that must move experts first vs one that moves nothing, side by side in
one run on the CPU cluster under steady load (issue: scale-down, items 3 and 9).

Both runs launch 3 ranks with 8 expert slots each (16 experts + 8 redundant). ``move``: rank 2
alone holds experts 12..15, so they move into surplus slots of ranks 0 and 1 (P2P) on the
commit pass. ``no-move``: every expert rank 2 holds has a copy on rank 0 or 1. Measured: POST
-> committed (``safe_to_terminate``), the move itself (the ranks' log line), and the longest gap
between completed requests before, during and after. Writes docs/benchmarks.md section
``expert_move``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import post_scale, wait_operation  # noqa: E402
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402

PLACEMENTS = {
    "move": [*range(8), 8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7],
    "no-move": [*range(16), *range(8)],
}
MOVE_LINE = re.compile(r"moved experts into (\d+) slots .* \(([\d.]+) s\)")


def shrink_once(row: list[int], steady_s: float) -> dict[str, float]:
    placement = json.dumps({"physical_to_logical_map": [row, row]})
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=3, max_ep_size=4,
                       moe_a2a_backend="nixl",
                       extra_args=["--ep-num-redundant-experts", "8",
                                   "--init-expert-location", placement])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(steady_s)
            t_steady = time.monotonic()
            time.sleep(steady_s)
            t_post = time.monotonic()
            post_scale(url, 2, "bench-shrink")
            operation = wait_operation(url, "bench-shrink", 300)
            t_committed = time.monotonic()
            if operation["result"] != "succeeded":
                raise RuntimeError(f"scale-down failed: {operation}")
            time.sleep(steady_s)
            t_end = time.monotonic()
        finally:
            results = load.stop()
        moves = MOVE_LINE.findall(cluster.primary.log_path.read_text(errors="replace"))
    return {
        "post_to_safe_s": t_committed - t_post,
        "moved_slots": float(moves[0][0]) if moves else 0.0,
        "move_s": max((float(s) for _, s in moves), default=0.0),
        "gap_steady_s": longest_gap(results, t_steady, t_post),
        "gap_shrink_s": longest_gap(results, t_post, t_committed),
        "gap_after_s": longest_gap(results, t_committed, t_end),
        **load_counts(results),
    }


def run(steady_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, row in PLACEMENTS.items():
        for key, value in shrink_once(row, steady_s).items():
            out[f"{name}:{key}"] = value
    return out


def main() -> None:
    r = run_under_load(__doc__, run)
    rows = [
        ("POST -> `safe_to_terminate` for rank 2 (committed)", "post_to_safe_s", "{:.1f}"),
        ("the move on the commit pass (slowest rank's log line)", "move_s", "{:.3f}"),
        ("longest gap between completed requests, steady state (3 ranks)", "gap_steady_s",
         "{:.2f}"),
        ("longest gap, POST -> committed", "gap_shrink_s", "{:.2f}"),
        ("longest gap, after the commit (2 ranks)", "gap_after_s", "{:.2f}"),
    ]
    lines = seconds_table(
        "Scale-down 3 -> 2 with and without moving experts (issue: scale-down, items 3, 9)",
        "3 launch ranks, 8 slots each (`--ep-num-redundant-experts 8`, `--init-expert-location`"
        ", `--moe-a2a-backend nixl`), 2 concurrent clients sending 8-token greedy requests back "
        "to back; a steady window (`--steady-seconds`), then `new_ep_size: 2`. `move`: rank 2 "
        "alone holds experts 12..15 (both MoE layers); `no-move`: everything on rank 2 has a "
        "copy on rank 0 or 1.",
    )
    lines[-2:] = ["| measure | move | no-move |", "|---|---:|---:|"]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt.format(r['move:' + key])} | "
                     f"{fmt.format(r['no-move:' + key])} |")
    lines += [
        "",
        f"`move`: {int(r['move:moved_slots'])} slots received weights; "
        f"{int(r['move:requests'])} requests, {int(r['move:failed'])} failed. `no-move`: "
        f"{int(r['no-move:moved_slots'])} slots; {int(r['no-move:requests'])} requests, "
        f"{int(r['no-move:failed'])} failed.",
    ]
    write_section("expert_move", "\n".join(lines))


if __name__ == "__main__":
    main()

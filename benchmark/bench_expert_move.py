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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import tiny_spec, under_load  # noqa: E402
from bench_scale_down import SHRINK_GAP_ROWS, SHRINK_GAPS  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402

PLACEMENTS = {
    "move": [*range(8), 8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7],
    "no-move": [*range(16), *range(8)],
}
MOVE_LINE = re.compile(r"moved experts into (\d+) slots .* \(([\d.]+) s\)")


def shrink_once(row: list[int], steady_s: float) -> dict[str, float]:
    placement = json.dumps({"physical_to_logical_map": [row, row]})
    spec = tiny_spec(3, extra_args=["--ep-num-redundant-experts", "8",
                                    "--init-expert-location", placement])
    with LocalCluster(spec) as cluster:
        with under_load(cluster) as timeline:
            timeline.hold(steady_s, then="steady")
            timeline.hold(steady_s)
            timeline.scale(2, "bench-shrink", 300)
            timeline.hold(steady_s, then="end")
        assert cluster.primary is not None
        moves = MOVE_LINE.findall(cluster.primary.log_path.read_text(errors="replace"))
    return {
        **timeline.figures(spans={"post_to_safe_s": ("post", "committed")}, gaps=SHRINK_GAPS),
        "moved_slots": float(moves[0][0]) if moves else 0.0,
        "move_s": max((float(s) for _, s in moves), default=0.0),
    }


def run(steady_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, row in PLACEMENTS.items():
        for key, value in shrink_once(row, steady_s).items():
            out[f"{name}:{key}"] = value
    return out


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "expert_move",
        "Scale-down 3 -> 2 with and without moving experts (issue: scale-down, items 3, 9)",
        "3 launch ranks, 8 slots each (`--ep-num-redundant-experts 8`, `--init-expert-location`"
        ", `--moe-a2a-backend nixl`), 2 concurrent clients sending 8-token greedy requests back "
        "to back; a steady window (`--steady-seconds`), then `new_ep_size: 2`. `move`: rank 2 "
        "alone holds experts 12..15 (both MoE layers); `no-move`: everything on rank 2 has a "
        "copy on rank 0 or 1.",
        r,
        [
            ("POST -> `safe_to_terminate` for rank 2 (committed)", "post_to_safe_s", ".1f"),
            ("the move on the commit pass (slowest rank's log line)", "move_s", ".3f"),
            *SHRINK_GAP_ROWS,
        ],
        f"`move`: {int(r['move:moved_slots'])} slots received weights; "
        f"{requests_text(r, 'move')}. `no-move`: {int(r['no-move:moved_slots'])} slots; "
        f"{requests_text(r, 'no-move')}.",
        runs=list(PLACEMENTS),
    )


if __name__ == "__main__":
    main()

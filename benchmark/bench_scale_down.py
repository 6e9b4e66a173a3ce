"""Runtime scale-down 3 -> 2 on the CPU cluster under steady load: POST -> ``safe_to_terminate``
latency, and the longest gap between completed requests during the shrink vs steady state.

The cluster is grown 2 -> 3 first (a joiner), then shrunk back; the leaving rank is that joiner,
whose server then exits by itself. Writes docs/benchmarks.md section ``scale_down``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import grow_by_joiner, tiny_spec, under_load  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import sse_events  # noqa: E402

# The shrink's windows, shared with bench_expert_move: steady (3 ranks), POST -> committed, after.
SHRINK_GAPS = {"gap_steady_s": ("steady", "post"), "gap_shrink_s": ("post", "committed"),
               "gap_after_s": ("committed", "end")}
SHRINK_GAP_ROWS = [
    ("longest gap between completed requests, steady state (3 ranks)", "gap_steady_s", ".2f"),
    ("longest gap, POST -> committed", "gap_shrink_s", ".2f"),
    ("longest gap, after the commit (2 ranks)", "gap_after_s", ".2f"),
]


def run(steady_s: float) -> dict[str, float]:
    with LocalCluster(tiny_spec()) as cluster, under_load(cluster) as timeline:
        joiner = grow_by_joiner(cluster, "bench-grow")
        timeline.hold(steady_s, then="steady")  # the joiner's first passes (NIXL handshakes) settle
        timeline.hold(steady_s)
        timeline.scale(2, "bench-shrink", 420)
        if joiner.wait_exit(120) != 0:
            raise RuntimeError("the leaving rank's server did not exit with code 0")
        timeline.mark("exit")
        timeline.hold(steady_s, then="end")
        events = sse_events(timeline.url)
    if not any(e.get("operation_id") == "bench-shrink" and e["type"] == "safe_to_terminate"
               for e in events):
        raise RuntimeError("no safe_to_terminate event")
    return timeline.figures(
        spans={"post_to_safe_s": ("post", "committed"), "safe_to_exit_s": ("committed", "exit")},
        gaps=SHRINK_GAPS,
    )


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "scale_down",
        "Runtime scale-down 3 -> 2 under load (issue: scale-down, item 9)",
        "A 2-rank primary grown to 3 by a joiner (`--moe-a2a-backend nixl`), 2 concurrent "
        "clients sending 8-token greedy requests back to back; after the scale-up has "
        "settled (`--steady-seconds`), the steady window, then `new_ep_size: 2`.",
        r,
        [
            ("POST -> `safe_to_terminate` for rank 2 (operation committed)", "post_to_safe_s",
             ".1f"),
            ("`safe_to_terminate` -> the leaving rank's server exited (code 0)", "safe_to_exit_s",
             ".1f"),
            *SHRINK_GAP_ROWS,
        ],
        f"{requests_text(r)}. The shrink waits for shard 2's running requests to finish (drain), "
        "then all ranks switch the expert map and release rank 2 on one agreed pass.",
    )


if __name__ == "__main__":
    main()

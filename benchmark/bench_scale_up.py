"""Runtime scale-up 2 -> 3 on the CPU cluster under steady load: control-plane latency (from the
joiner being ready to ``serving_expanded``) and the longest gap between completed requests
during the scale window vs steady state.

The joiner is launched before the POST; "ready" is the moment its scheduler logs that it
finished loading weights. Writes docs/benchmarks.md section ``scale_up``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import operation_succeeded, tiny_spec, under_load, weights_loaded  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402


def run(steady_s: float) -> dict[str, float]:
    with LocalCluster(tiny_spec()) as cluster, under_load(cluster) as timeline:
        timeline.hold(steady_s, then="launch")
        joiner = cluster.start_joiner("scale", rank_offset=2)
        timeline.mark("post")
        post_scale(timeline.url, 3, "bench-grow")
        weights_loaded(joiner, 300)
        timeline.mark("ready")
        operation_succeeded(timeline.url, "bench-grow", 420)
        timeline.mark("committed")
        timeline.hold(steady_s, then="end")
    return timeline.figures(
        spans={"launch_to_ready_s": ("launch", "ready"),
               "ready_to_committed_s": ("ready", "committed"),
               "post_to_committed_s": ("post", "committed")},
        gaps={"gap_steady_s": ("warm", "launch"), "gap_scale_s": ("launch", "committed"),
              "gap_after_s": ("committed", "end")},
    )


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "scale_up",
        "Runtime scale-up 2 -> 3 under load (issue: scale-up and crash recovery, item 8)",
        "Primary with 2 EP ranks (`--moe-a2a-backend nixl`), 2 concurrent clients sending "
        "8-token greedy requests back to back; the joiner is launched, then the scale POSTed.",
        r,
        [
            ("joiner launched -> its weights loaded (ready)", "launch_to_ready_s", ".1f"),
            ("joiner ready -> `serving_expanded` (control-plane latency)",
             "ready_to_committed_s", ".1f"),
            ("POST -> `serving_expanded`", "post_to_committed_s", ".1f"),
            ("longest gap between completed requests, steady state", "gap_steady_s", ".2f"),
            ("longest gap, joiner launch -> committed", "gap_scale_s", ".2f"),
            ("longest gap, after the commit", "gap_after_s", ".2f"),
        ],
        f"{requests_text(r)}. The joiner's start-up (imports, weights, Mooncake set-up) shares "
        "the 2 cores with the serving ranks; the gap after the commit covers the first passes "
        "with the new rank, which creates its NIXL buffer and handshakes with every peer on its "
        "first dispatch.",
    )


if __name__ == "__main__":
    main()

"""Crash recovery of a rank that joined by scale-up, on the CPU cluster under steady load.

2 ranks (NIXL EP, every expert on both) grow to 3 with a joiner; after a settle period the
joiner is SIGKILLed, the survivors let go of its slot, and a replacement launched with
``--ep-join-mode recover`` (same join offset) is re-admitted. Upstream answers
``recovery_unsupported`` here. Writes docs/benchmarks.md section ``recovery_after_scale``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import REPLICATED, grow_by_joiner, tiny_spec, under_load  # noqa: E402
from bench_recovery import (  # noqa: E402
    SCALE_JOINED_READY,
    crash_and_recover,
    recovery_figures,
    recovery_rows,
)

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402

SETTLE_S = 45.0  # three ranks on two cores are slow for a while after a commit


def run(steady_s: float) -> dict[str, float]:
    with LocalCluster(tiny_spec(extra_args=REPLICATED)) as cluster:
        joiner = grow_by_joiner(cluster, "grow")
        with under_load(cluster) as timeline:
            timeline.hold(SETTLE_S, then="steady")
            crash_and_recover(timeline, 2, lambda: cluster.kill_server(joiner),
                              lambda: cluster.start_joiner("recover", rank_offset=2), steady_s,
                              420, SCALE_JOINED_READY)
    return recovery_figures(timeline, "steady")


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "recovery_after_scale",
        "Crash recovery of a rank that joined by scale-up (issue: scale-up and crash recovery, "
        "items 4 and 8)",
        "2 launch ranks grown to 3 by a joiner (`--moe-a2a-backend nixl`, every expert on "
        "both launch ranks), 2 concurrent clients sending 8-token greedy requests back to "
        f"back, {SETTLE_S:g} s settle after the commit. The joiner is SIGKILLed, then "
        "relaunched with `--ep-join-mode recover` (same `--elastic-ep-join-rank-offset`).",
        r,
        recovery_rows(2, "3-rank steady state", "degraded, slot let go"),
        f"{requests_text(r)} (ended with 503: running on rank 2 when it died).",
    )


if __name__ == "__main__":
    main()

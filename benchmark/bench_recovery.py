"""Crash recovery on the CPU cluster under steady load: fault detection, recovery time, and the
longest gap between completed requests while degraded and recovering vs steady state.

One 2-node cluster (one EP rank per node, NIXL EP data plane, every expert replicated on both
ranks). Node 1 is SIGKILLed under load, then relaunched with ``--ep-join-mode recover``.
Writes docs/benchmarks.md section ``recovery``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import Row, requests_text, run_under_load, write_table  # noqa: E402
from _scenario import (  # noqa: E402
    REPLICATED,
    Timeline,
    logged,
    tiny_spec,
    under_load,
    weights_loaded,
)

from sglang_elastic_ep_testbed.cluster import LocalCluster, ServerProcess  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import wait_rank_state  # noqa: E402

# The replacement's log line once its own start-up is done and it waits for the survivors.
LAUNCH_TIME_READY = "waits for the survivors to take it back"
SCALE_JOINED_READY = "registered its cohort"


def crash_and_recover(timeline: Timeline, rank: int, kill: Callable[[], object],
                      relaunch: Callable[[], ServerProcess], steady_s: float,
                      active_timeout_s: float, ready_text: str) -> None:
    """Under load: ``steady_s``, ``kill`` the server of ``rank``, ``steady_s`` degraded,
    ``relaunch`` it in recover mode, ``steady_s`` once it is back. Marks ``kill``, ``failed``,
    ``launch``, ``loaded``, ``ready`` (its log shows ``ready_text``), ``active``, ``end``; the
    status and the log are polled often since the moments are measured."""
    timeline.hold(steady_s, then="kill")
    kill()
    wait_rank_state(timeline.url, rank, "failed", 120, poll_s=0.2)
    timeline.mark("failed")
    timeline.hold(steady_s, then="launch")
    replacement = relaunch()
    weights_loaded(replacement, 300)
    timeline.mark("loaded")
    logged(replacement, ready_text, 300)
    timeline.mark("ready")
    wait_rank_state(timeline.url, rank, "active", active_timeout_s, poll_s=0.2)
    timeline.mark("active")
    timeline.hold(steady_s, then="end")


def recovery_figures(timeline: Timeline, steady_from: str) -> dict[str, float]:
    """What :func:`crash_and_recover` measured; the steady window runs ``steady_from`` -> kill."""
    return timeline.figures(
        spans={"detect_s": ("kill", "failed"), "launch_to_loaded_s": ("launch", "loaded"),
               "loaded_to_full_s": ("loaded", "active"), "ready_to_full_s": ("ready", "active"),
               "launch_to_full_s": ("launch", "active")},
        gaps={"gap_steady_s": (steady_from, "kill"), "gap_fault_s": ("kill", "launch"),
              "gap_recover_s": ("launch", "end")},
    )


def recovery_rows(rank: int, steady: str, degraded: str) -> list[Row]:
    """The table of :func:`recovery_figures`; the labels name the rank and both windows."""
    return [
        (f"kill -> rank {rank} `failed` in status (fault detection)", "detect_s", ".1f"),
        ("relaunch -> replacement loaded its weights", "launch_to_loaded_s", ".1f"),
        ("replacement loaded -> full size (`serving_recovered`)", "loaded_to_full_s", ".1f"),
        ("replacement ready (waits for the survivors) -> full size", "ready_to_full_s", ".1f"),
        ("relaunch -> full size", "launch_to_full_s", ".1f"),
        (f"longest gap between completed requests, {steady}", "gap_steady_s", ".2f"),
        (f"longest gap, kill -> relaunch ({degraded})", "gap_fault_s", ".2f"),
        ("longest gap, relaunch -> full size and after", "gap_recover_s", ".2f"),
    ]


def run(steady_s: float) -> dict[str, float]:
    with LocalCluster(tiny_spec(nodes=2, extra_args=REPLICATED)) as cluster, \
            under_load(cluster) as timeline:
        crash_and_recover(timeline, 1, lambda: cluster.kill_node(1),
                          lambda: cluster.start_node(1, recover=True), steady_s, 300,
                          LAUNCH_TIME_READY)
    steady = [r.finished - r.started for r in timeline.results
              if r.ok and r.finished < timeline.marks["kill"]]
    return {
        **recovery_figures(timeline, "warm"),
        "latency_p50_s": statistics.median(steady) if steady else float("nan"),
    }


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "recovery",
        "Crash recovery under load (issue: scale-up and crash recovery, item 8)",
        "Two nodes of one EP rank each (`--moe-a2a-backend nixl`, every expert on both ranks), "
        "2 concurrent clients sending 8-token greedy requests back to back. Node 1 is "
        "SIGKILLed, then relaunched with `--ep-join-mode recover`.",
        r,
        recovery_rows(1, "steady state", "degraded"),
        f"{requests_text(r)} (ended with 503: running on node 1 when it died); steady-state "
        f"request latency p50 {r['latency_p50_s']:.2f} s.",
    )


if __name__ == "__main__":
    main()

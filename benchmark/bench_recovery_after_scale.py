"""Crash recovery of a rank that joined by scale-up, on the CPU cluster, under steady load and
with the load paused.

2 ranks (NIXL EP, every expert on both) grow to 3 with a joiner; after a settle period the
joiner is SIGKILLed, the survivors let go of its slot, and a replacement launched with
``--ep-join-mode recover`` (same join offset) is re-admitted. Upstream answers
``recovery_unsupported`` here. Then the same again with no load: three busy ranks on two cores
stretch every step of the first run, and the second shows the same steps without that. Writes
docs/benchmarks.md section ``recovery_after_scale``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import (  # noqa: E402
    REPLICATED,
    grow_by_joiner,
    logged,
    tiny_spec,
    under_load,
    weights_loaded,
)
from bench_recovery import (  # noqa: E402
    SCALE_JOINED_READY,
    crash_and_recover,
    recovery_figures,
    recovery_rows,
)

from sglang_elastic_ep_testbed.cluster import LocalCluster, ServerProcess  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import wait_rank_state  # noqa: E402

SETTLE_S = 45.0  # three ranks on two cores are slow for a while after a commit
RUNS = ("under load", "load paused")
LOG_TIME = "%Y-%m-%d %H:%M:%S.%f"


def readmission_pause_s(primary_log: Path) -> float:
    """Rank 0's pause for the last re-admission: from entering it to its commit, from its own
    log (``SGLANG_LOG_MS=1``)."""
    lines = primary_log.read_text(errors="replace").splitlines()
    start = max(i for i, line in enumerate(lines) if "rank 0 enters the scale-up" in line)
    end = next(line for line in lines[start:] if "Scale completed" in line)
    return (datetime.strptime(end[1:24], LOG_TIME)
            - datetime.strptime(lines[start][1:24], LOG_TIME)).total_seconds()


def recover_without_load(cluster: LocalCluster, rank: int, server: ServerProcess,
                         relaunch: Callable[[], ServerProcess]) -> dict[str, float]:
    """Kill ``server`` (rank ``rank``'s) with no load running and relaunch it; the spans of
    :func:`recovery_figures` (no gaps: nothing is sent)."""
    marks = {"kill": time.monotonic()}
    cluster.kill_server(server)
    wait_rank_state(cluster.url, rank, "failed", 120, poll_s=0.2)
    marks["failed"] = marks["launch"] = time.monotonic()
    replacement = relaunch()
    weights_loaded(replacement, 300)
    marks["loaded"] = time.monotonic()
    logged(replacement, SCALE_JOINED_READY, 300)
    marks["ready"] = time.monotonic()
    wait_rank_state(cluster.url, rank, "active", 420, poll_s=0.2)
    marks["active"] = time.monotonic()
    return {"detect_s": marks["failed"] - marks["kill"],
            "launch_to_loaded_s": marks["loaded"] - marks["launch"],
            "loaded_to_full_s": marks["active"] - marks["loaded"],
            "ready_to_full_s": marks["active"] - marks["ready"],
            "launch_to_full_s": marks["active"] - marks["launch"]}


def run(steady_s: float) -> dict[str, float]:
    os.environ["SGLANG_LOG_MS"] = "1"  # the pause is read from log lines
    replacements: list[ServerProcess] = []

    def relaunch() -> ServerProcess:
        replacements.append(cluster.start_joiner("recover", rank_offset=2))
        return replacements[-1]

    with LocalCluster(tiny_spec(extra_args=REPLICATED)) as cluster:
        joiner = grow_by_joiner(cluster, "grow")
        with under_load(cluster) as timeline:
            timeline.hold(SETTLE_S, then="steady")
            crash_and_recover(timeline, 2, lambda: cluster.kill_server(joiner), relaunch,
                              steady_s, 420, SCALE_JOINED_READY)
        loaded = recovery_figures(timeline, "steady")
        loaded["pause_s"] = readmission_pause_s(cluster.primary.log_path)
        time.sleep(steady_s)  # the load's last requests drain
        paused = recover_without_load(cluster, 2, replacements[-1], relaunch)
        paused["pause_s"] = readmission_pause_s(cluster.primary.log_path)
    return ({f"{RUNS[0]}:{k}": v for k, v in loaded.items()}
            | {f"{RUNS[1]}:{k}": v for k, v in paused.items()})


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "recovery_after_scale",
        "Crash recovery of a rank that joined by scale-up (issue: scale-up and crash recovery, "
        "items 4 and 8)",
        "2 launch ranks grown to 3 by a joiner (`--moe-a2a-backend nixl`, every expert on "
        "both launch ranks), 2 concurrent clients sending 8-token greedy requests back to "
        f"back, {SETTLE_S:g} s settle after the commit. The joiner is SIGKILLed, then "
        "relaunched with `--ep-join-mode recover` (same `--elastic-ep-join-rank-offset`); then "
        "the replacement is killed and relaunched once more with the load stopped.",
        r,
        [*recovery_rows(2, "3-rank steady state", "degraded, slot let go"),
         ("serving ranks' pause: re-admission -> commit (rank 0's log)", "pause_s", ".2f")],
        f"Under load: {requests_text(r, RUNS[0])} (ended with 503: running on rank 2 when it "
        "died).",
        runs=RUNS,
    )


if __name__ == "__main__":
    main()

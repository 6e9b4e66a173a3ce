"""Runtime scale-up 2 -> 3 on the CPU cluster: a joiner that prepares before it registers (the
default) against one in upstream's start-up order (``SGLANG_EEP_JOINER_PREPARE=0``), side by
side on one cluster, under load and with the load paused.

Each cycle launches a scale joiner for rank 2, POSTs 3, waits for the commit, lets the 3 ranks
serve, then POSTs 2 (the joiner exits) so the next cycle starts from the same 2 ranks. "Ready"
is the joiner registering its cohort: from then on the serving ranks can admit it, and from
their admission to the commit they stop serving (the pause, read from rank 0's log). Both ends
of the control-plane latency are the servers' own stamps, not the moments a poll saw them: the
joiner's log line (``SGLANG_LOG_MS=1``) and the operation's ``finished_at`` in the status.
Writes docs/benchmarks.md section ``scale_up``.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, write_table  # noqa: E402
from _scenario import (  # noqa: E402
    LOG_MS_TIME,
    WARM_UP_S,
    logged,
    operation_succeeded,
    tiny_spec,
)

from sglang_elastic_ep_testbed.cluster import LoadClient, LocalCluster, ServerProcess  # noqa: E402
from sglang_elastic_ep_testbed.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402
from sglang_elastic_ep_testbed.cluster.waits import wait_until  # noqa: E402

MODES = {"prepared": {}, "upstream order": {"SGLANG_EEP_JOINER_PREPARE": "0"}}
RIGHT_AFTER_S = 5.0  # the window right after the commit; the 3-rank steady state follows it


def _log_time(line: str) -> datetime:
    return datetime.strptime(line[1:24], LOG_MS_TIME)


def _monotonic_of(wall_s: float) -> float:
    """A wall-clock moment (``time.time``) on this run's clock (``time.monotonic``)."""
    return time.monotonic() - (time.time() - wall_s)


def logged_at(server: ServerProcess, text: str, timeout_s: float) -> float:
    """Wait until ``server``'s log has ``text``; the moment its first such line was written
    (its own millisecond stamp, local time as the log writes it) on this run's clock."""
    logged(server, text, timeout_s)
    line = next(line for line in server.log_path.read_text(errors="replace").splitlines()
                if text in line)
    return _monotonic_of(_log_time(line).timestamp())


def serving_pause_s(primary_log: Path, operation_id: str) -> float:
    """Rank 0's pause: from entering the scale-up (its admission begins) to its commit, from
    its own log (``SGLANG_LOG_MS=1``)."""
    lines = primary_log.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines)
                 if f"[op {operation_id}]" in line and "rank 0 enters the scale-up" in line)
    end = next(line for line in lines[start:] if "Scale completed" in line)
    return (_log_time(end) - _log_time(lines[start])).total_seconds()


def grow_then_shrink(cluster: LocalCluster, run: str, env: dict[str, str],
                     steady_s: float) -> dict[str, float]:
    """One cycle, after ``steady_s`` at 2 ranks; its moments (monotonic seconds) and the
    pause."""
    marks = {"before": time.monotonic()}
    time.sleep(steady_s)
    marks["launch"] = time.monotonic()
    joiner = cluster.start_joiner("scale", rank_offset=2, env=env)
    operation = "bench-" + "".join(c if c.isalnum() else "-" for c in run)
    post_scale(cluster.url, 3, operation)
    marks["registered"] = logged_at(joiner, "registered its cohort", 300)
    finished_at = operation_succeeded(cluster.url, operation, 420)["finished_at"]
    marks["committed"] = _monotonic_of(finished_at)
    time.sleep(RIGHT_AFTER_S)
    marks["settled"] = time.monotonic()
    time.sleep(steady_s)
    marks["end"] = time.monotonic()
    post_scale(cluster.url, 2, operation + "-down")
    operation_succeeded(cluster.url, operation + "-down", 300)
    wait_until(lambda: not joiner.alive(), 120, f"{joiner.log_path.name} exited", poll_s=0.5)
    marks["pause_s"] = serving_pause_s(cluster.primary.log_path, operation)
    return marks


def run(steady_s: float, rounds: int, paused_rounds: int) -> tuple[dict[str, float], list[str]]:
    os.environ["SGLANG_LOG_MS"] = "1"  # the pause is read from log lines
    cycles: dict[str, dict[str, float]] = {}
    with LocalCluster(tiny_spec()) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(WARM_UP_S)
            for n in range(1, rounds + 1):  # the modes alternate: drift hits both alike
                for mode, env in MODES.items():
                    name = f"{mode}, under load ({n})"
                    cycles[name] = grow_then_shrink(cluster, name, env, steady_s)
        finally:
            results = load.stop()
        for n in range(1, paused_rounds + 1):
            for mode, env in MODES.items():
                name = f"{mode}, load paused ({n})"
                cycles[name] = grow_then_shrink(cluster, name, env, 0.0)
    figures: dict[str, float] = {}
    for name, m in cycles.items():
        f = {"registered_s": m["registered"] - m["launch"],
             "ready_to_committed_s": m["committed"] - m["registered"],
             "pause_s": m["pause_s"]}
        if "under load" in name:
            f |= {"gap_steady2_s": longest_gap(results, m["before"], m["launch"]),
                  "gap_scale_s": longest_gap(results, m["launch"], m["committed"]),
                  "gap_start_s": longest_gap(results, m["launch"], m["registered"]),
                  "gap_commit_s": longest_gap(results, m["registered"], m["committed"]),
                  "gap_after_s": longest_gap(results, m["committed"], m["settled"]),
                  "gap_steady3_s": longest_gap(results, m["settled"], m["end"])}
        figures |= {f"{name}:{key}": value for key, value in f.items()}
    figures["requests"] = float(len(results))
    figures["failed"] = float(sum(not r.ok for r in results))
    return figures, list(cycles)


ROWS = [
    ("joiner launched -> registered its cohort (ready)", "registered_s", ".1f"),
    ("ready -> `serving_expanded` (control-plane latency)", "ready_to_committed_s", ".2f"),
    ("serving ranks' pause: admission -> commit (rank 0's log)", "pause_s", ".2f"),
    ("longest gap between completed requests, 2 ranks before", "gap_steady2_s", ".2f"),
    ("longest gap, joiner launch -> committed", "gap_scale_s", ".2f"),
    ("of which: launch -> ready (the joiner starts beside the serving ranks)", "gap_start_s",
     ".2f"),
    ("of which: ready -> committed (the change itself)", "gap_commit_s", ".2f"),
    (f"longest gap, the first {RIGHT_AFTER_S:g} s after the commit", "gap_after_s", ".2f"),
    ("longest gap, 3-rank steady state after that", "gap_steady3_s", ".2f"),
]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steady-seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2, help="cycles per mode under load")
    parser.add_argument("--paused-rounds", type=int, default=2,
                        help="cycles per mode with the load paused, after those under load")
    args = parser.parse_args()
    figures, runs = run(args.steady_seconds, args.rounds, args.paused_rounds)
    print(figures, flush=True)
    write_table(
        "scale_up", "Runtime scale-up 2 -> 3: a prepared joiner against upstream's order",
        "Primary with 2 EP ranks (`--moe-a2a-backend nixl`, `--max-ep-size 4`), 2 concurrent "
        "clients sending 8-token greedy requests back to back (stopped for the last "
        f"{2 * args.paused_rounds} cycles); each cycle serves at 2 ranks, grows to 3 with a "
        "scale joiner, serves, and shrinks back to 2; the two modes alternate. `upstream "
        "order`: the joiner was started with `SGLANG_EEP_JOINER_PREPARE=0`. Ready -> "
        "`serving_expanded` runs from the joiner's log stamp to the operation's "
        "`finished_at`.",
        figures, ROWS, f"Under load: {requests_text(figures)}.", runs=runs,
    )


if __name__ == "__main__":
    main()

"""Removing a live launch-time rank where it is vs shrinking the tail, side by side on one CPU
cluster under steady load.

Three launch nodes, one rank each, every rank holding every expert. ``remove``:
``{"remove_ranks": [1]}`` with rank 1 serving: its shard drains, every rank lets it go on one
agreed pass, its server exits 0, and the slot is a hole; a scale-up to 3 and node 1's relaunch
in recover mode then refill it. ``tail``: ``new_ep_size: 2`` on the same cluster, which lets
rank 2 go the same way. Measured: POST -> committed, committed -> the leaving server exited, the
refill (relaunch -> full size), and the longest gap between completed requests before, during
and after each. Writes docs/benchmarks.md section ``rank_removal``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import requests_text, run_under_load, write_table  # noqa: E402
from _scenario import Timeline, operation_succeeded, tiny_spec, under_load  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess  # noqa: E402
from sglang_elastic_ep_testbed.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_NUM_EXPERTS  # noqa: E402

GAPS = {"gap_steady_s": ("steady", "post"), "gap_change_s": ("post", "committed"),
        "gap_after_s": ("committed", "end")}
RUNS = ("remove", "tail")
EXIT_S = 120
CHANGE_S = 420


Windows = dict[str, tuple[float, float]]  # figure key -> (from, to) moments


def leave(timeline: Timeline, server: ServerProcess, body: dict, steady_s: float,
          run: str) -> tuple[dict[str, float], Windows]:
    """One change (``body`` POSTed) after a steady window, until the leaving server exited 0
    and the load ran ``steady_s`` more: its spans, and the moments of its gap windows (the
    gaps are read once the load stopped), keyed ``run:``."""
    timeline.hold(steady_s, then="steady")
    timeline.hold(steady_s)
    timeline.mark("post")
    httpx.post(timeline.url + "/scale_elastic_ep", json=body, timeout=60).raise_for_status()
    operation_succeeded(timeline.url, body["operation_id"], CHANGE_S)
    timeline.mark("committed")
    if server.wait_exit(EXIT_S) != 0:
        raise RuntimeError(f"the leaving server {server.name} did not exit with code 0")
    timeline.mark("exit")
    timeline.hold(steady_s, then="end")
    marks = timeline.marks
    spans = {f"{run}:post_to_committed_s": marks["committed"] - marks["post"],
             f"{run}:committed_to_exit_s": marks["exit"] - marks["committed"]}
    return spans, {f"{run}:{name}": (marks[a], marks[b]) for name, (a, b) in GAPS.items()}


def run(steady_s: float) -> dict[str, float]:
    spec = tiny_spec(3, nodes=3, extra_args=["--ep-num-redundant-experts",
                                             str(DEFAULT_NUM_EXPERTS * 2)])
    out: dict[str, float] = {}
    windows: Windows = {}
    with LocalCluster(spec) as cluster, under_load(cluster) as timeline:
        spans, gaps = leave(timeline, cluster.followers[1],
                            {"remove_ranks": [1], "operation_id": "bench-remove"}, steady_s,
                            "remove")
        out.update(spans)
        windows.update(gaps)
        # The hole is refilled: a scale-up into it, then node 1's relaunch in recover mode.
        post_scale(timeline.url, 3, "bench-refill")
        relaunched = timeline.mark("relaunch")
        cluster.start_node(1, recover=True)
        operation_succeeded(timeline.url, "bench-refill", CHANGE_S)
        out["remove:relaunch_to_full_s"] = timeline.mark("full") - relaunched
        spans, gaps = leave(timeline, cluster.followers[2],
                            {"new_ep_size": 2, "operation_id": "bench-tail"}, steady_s, "tail")
        out.update(spans)
        windows.update(gaps)
    for key, (start, end) in windows.items():
        out[key] = longest_gap(timeline.results, start, end)
    out["requests"] = float(len(timeline.results))
    out["failed"] = float(sum(not r.ok for r in timeline.results))
    return out


def main() -> None:
    r = run_under_load(__doc__, run)
    write_table(
        "rank_removal",
        "Removing a live launch-time rank where it is vs shrinking the tail (3 -> 2 ranks)",
        "3 launch nodes, one rank each, every rank holding every expert "
        f"(`--ep-num-redundant-experts {DEFAULT_NUM_EXPERTS * 2}`, `--moe-a2a-backend nixl`), "
        "2 concurrent clients sending 8-token greedy requests back to back on one cluster. "
        "`remove`: `{\"remove_ranks\": [1]}`, then its hole refilled (`new_ep_size: 3` and node "
        "1 relaunched with `--ep-join-mode recover`); `tail`: then `new_ep_size: 2`. Each after "
        "a steady window (`--steady-seconds`).",
        r,
        [
            ("POST -> committed (`safe_to_terminate`)", "post_to_committed_s", ".1f"),
            ("committed -> the leaving node's server exited (code 0)", "committed_to_exit_s",
             ".1f"),
            ("relaunch of the removed node -> full size again", "relaunch_to_full_s", ".1f"),
            ("longest gap between completed requests, steady state (3 ranks)", "gap_steady_s",
             ".2f"),
            ("longest gap, POST -> committed", "gap_change_s", ".2f"),
            ("longest gap, after the commit (2 ranks)", "gap_after_s", ".2f"),
        ],
        f"{requests_text(r)} over both runs (one cluster, one load). A removal moves no "
        "expert and keeps the expert map and DP attention as they are (the removed rank's slots "
        "are skipped while it is out); a tail shrink cuts the map to the staying ranks' slots.",
        runs=RUNS,
    )


if __name__ == "__main__":
    main()

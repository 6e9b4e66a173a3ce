"""Restart vs elastic, side by side in one run: going 2 -> 3 -> 2 ranks under the same client
load, (a) the status quo: stop the server and start one of the new size, the clients switched
to it once it answers (what a router in front would do); (b) elastic: a scale joiner and
``POST /scale_elastic_ep``, then a scale-down, on one running server.

For each change, over a fixed window from the moment it starts (the stop, or the joiner's
launch with the POST): the longest time with no completed request, the requests that failed
(the clients retry after 50 ms, so a down server fails many), and the requests served.
Writes docs/benchmarks.md section ``restart_vs_elastic``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402
from _scenario import WARM_UP_S, operation_succeeded, tiny_spec  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402

# 16 experts: 8 slots per rank at 2 ranks; a 3-rank server needs 24 slots (8 redundant), the
# size an elastic 2 -> 3 reaches too.
SLOTS_FOR = {2: (), 3: ("--ep-num-redundant-experts", "8")}


def window_figures(load: LoadClient, start: float, window_s: float) -> dict[str, float]:
    """Over [start, start + window_s]: the longest gap with no completed request (from the
    window's start), failed and served requests."""
    end = start + window_s
    results = [r for r in load.snapshot() if start <= r.finished <= end]
    served = [r for r in results if r.ok]
    first = min((r.finished for r in served), default=end)
    gap = max(first - start, longest_gap(results, start, end))
    return {"no_completion_s": gap, "failed": float(sum(not r.ok for r in results)),
            "served": float(len(served))}


def hold_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def elastic(steady_s: float, window_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    with LocalCluster(tiny_spec(2)) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(WARM_UP_S + steady_s)
            start = time.monotonic()
            cluster.start_joiner("scale", rank_offset=2)
            post_scale(cluster.url, 3, "bench-elastic-grow")
            operation_succeeded(cluster.url, "bench-elastic-grow", 420)
            out["up:change_s"] = time.monotonic() - start
            hold_until(start + window_s)
            out.update({f"up:{k}": v for k, v in window_figures(load, start, window_s).items()})
            start = time.monotonic()
            post_scale(cluster.url, 2, "bench-elastic-shrink")
            operation_succeeded(cluster.url, "bench-elastic-shrink", 420)
            out["down:change_s"] = time.monotonic() - start
            hold_until(start + window_s)
            out.update({f"down:{k}": v for k, v in window_figures(load, start, window_s).items()})
        finally:
            load.stop()
    return out


def restart(steady_s: float, window_s: float) -> dict[str, float]:
    out: dict[str, float] = {}
    cluster = LocalCluster(tiny_spec(2, extra_args=SLOTS_FOR[2])).start()
    load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
    try:
        time.sleep(WARM_UP_S + steady_s)
        for name, size in (("up", 3), ("down", 2)):
            start = time.monotonic()
            cluster.stop()
            cluster = LocalCluster(tiny_spec(size, extra_args=SLOTS_FOR[size])).start()
            load.url = cluster.url  # the router's switch
            out[f"{name}:change_s"] = time.monotonic() - start
            hold_until(start + window_s)
            out.update({f"{name}:{k}": v
                        for k, v in window_figures(load, start, window_s).items()})
    finally:
        load.stop()
        cluster.stop()
    return out


ROWS = [
    ("change started -> serving at the new size (s)", "change_s", ".1f"),
    ("longest time with no completed request (s)", "no_completion_s", ".1f"),
    ("requests failed", "failed", ".0f"),
    ("requests served", "served", ".0f"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steady-seconds", type=float, default=15.0)
    parser.add_argument("--window-seconds", type=float, default=180.0)
    args = parser.parse_args()
    figures = {"elastic": elastic(args.steady_seconds, args.window_seconds),
               "restart": restart(args.steady_seconds, args.window_seconds)}
    print(figures, flush=True)
    lines = [
        *section_head("Restart vs elastic: 2 -> 3 -> 2 under load",
                      f"Tiny model on CPU ranks (`--moe-a2a-backend nixl`, `--max-ep-size 4`), 2 "
                      "clients sending 8-token greedy requests back to back (50 ms apart after "
                      f"a failure). Each figure over {args.window_seconds:.0f} s from the "
                      "change's start: the restart stops the server and starts one of the new "
                      "size (the clients switched to it once it answers); elastic launches a "
                      "scale joiner and POSTs 3, then POSTs 2."),
        "| measure | 2 -> 3 restart | 2 -> 3 elastic | 3 -> 2 restart | 3 -> 2 elastic |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key, fmt in ROWS:
        cells = [format(figures[run][f"{change}:{key}"], fmt)
                 for change in ("up", "down") for run in ("restart", "elastic")]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    write_section("restart_vs_elastic", "\n".join(lines))


if __name__ == "__main__":
    main()

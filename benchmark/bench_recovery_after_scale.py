"""Crash recovery of a rank that joined by scale-up, on the CPU cluster under steady load.

2 ranks (NIXL EP, every expert on both) grow to 3 with a joiner; after a settle period the
joiner is SIGKILLed, the survivors let go of its slot, and a replacement launched with
``--ep-join-mode recover`` (same join offset) is re-admitted. Upstream answers
``recovery_unsupported`` here. Writes docs/benchmarks.md section ``recovery_after_scale``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402
from bench_recovery import scheduler_joined, wait_rank  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import wait_operation  # noqa: E402
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402

SETTLE_S = 45.0  # three ranks on two cores are slow for a while after a commit


def run(steady_s: float) -> dict[str, float]:
    spec = ClusterSpec(
        write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4, moe_a2a_backend="nixl",
        extra_args=["--ep-num-redundant-experts", "16"],
    )
    with LocalCluster(spec) as cluster:
        url = cluster.url
        joiner = cluster.start_joiner("scale", rank_offset=2)
        resp = httpx.post(url + "/scale_elastic_ep",
                          json={"new_ep_size": 3, "operation_id": "grow"}, timeout=60)
        resp.raise_for_status()
        wait_operation(url, "grow", 420)
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(SETTLE_S)
            t_steady = time.monotonic()
            time.sleep(steady_s)
            t_kill = time.monotonic()
            cluster.kill_server(joiner)
            t_failed = wait_rank(url, 2, "failed", 120)
            time.sleep(steady_s)
            t_launch = time.monotonic()
            replacement = cluster.start_joiner("recover", rank_offset=2)
            t_loaded = scheduler_joined(replacement.log_path, 300)
            t_active = wait_rank(url, 2, "active", 420)
            time.sleep(steady_s)
            t_end = time.monotonic()
        finally:
            results = load.stop()
    return {
        "detect_s": t_failed - t_kill,
        "launch_to_loaded_s": t_loaded - t_launch,
        "loaded_to_full_s": t_active - t_loaded,
        "launch_to_full_s": t_active - t_launch,
        "gap_steady_s": longest_gap(results, t_steady, t_kill),
        "gap_fault_s": longest_gap(results, t_kill, t_launch),
        "gap_recover_s": longest_gap(results, t_launch, t_end),
        **load_counts(results),
    }


def main() -> None:
    r = run_under_load(__doc__, run)
    lines = [
        *seconds_table(
            "Crash recovery of a rank that joined by scale-up (issue: scale-up and crash "
            "recovery, items 4 and 8)",
            "2 launch ranks grown to 3 by a joiner (`--moe-a2a-backend nixl`, every expert on "
            "both launch ranks), 2 concurrent clients sending 8-token greedy requests back to "
            f"back, {SETTLE_S:g} s settle after the commit. The joiner is SIGKILLed, then "
            "relaunched with `--ep-join-mode recover` (same `--elastic-ep-join-rank-offset`).",
        ),
        f"| kill -> rank 2 `failed` in status (fault detection) | {r['detect_s']:.1f} |",
        f"| relaunch -> replacement loaded its weights | {r['launch_to_loaded_s']:.1f} |",
        f"| replacement loaded -> full size (`serving_recovered`) | {r['loaded_to_full_s']:.1f} |",
        f"| relaunch -> full size | {r['launch_to_full_s']:.1f} |",
        f"| longest gap between completed requests, 3-rank steady state | "
        f"{r['gap_steady_s']:.2f} |",
        f"| longest gap, kill -> relaunch (degraded, slot let go) | {r['gap_fault_s']:.2f} |",
        f"| longest gap, relaunch -> full size and after | {r['gap_recover_s']:.2f} |",
        "",
        f"{int(r['requests'])} requests, {int(r['failed'])} failed (ended with 503: running on "
        "rank 2 when it died).",
    ]
    write_section("recovery_after_scale", "\n".join(lines))


if __name__ == "__main__":
    main()

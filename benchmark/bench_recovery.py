"""Crash recovery on the CPU cluster under steady load: fault detection, recovery time, and the
longest gap between completed requests while degraded and recovering vs steady state.

One 2-node cluster (one EP rank per node, NIXL EP data plane, every expert replicated on both
ranks). Node 1 is SIGKILLed under load, then relaunched with ``--ep-join-mode recover``.
Writes docs/benchmarks.md section ``recovery``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import load_counts, run_under_load, seconds_table, write_section  # noqa: E402

from sglang_elastic_ep.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep.cluster.load import longest_gap  # noqa: E402
from sglang_elastic_ep.cluster.observe import wait_rank_state  # noqa: E402
from sglang_elastic_ep.cpu.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402


def wait_rank(url: str, rank: int, state: str, timeout_s: float) -> float:
    """When ``rank`` reached ``state`` (status polled every 0.2 s)."""
    wait_rank_state(url, rank, state, timeout_s, poll_s=0.2)
    return time.monotonic()


def scheduler_joined(log: Path, timeout_s: float) -> float:
    """When the replacement's scheduler finished loading (its first line after the load)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "Load weight end" in log.read_text(errors="replace"):
            return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"no 'Load weight end' in {log}")


def run(steady_s: float) -> dict[str, float]:
    spec = ClusterSpec(
        write_tiny_model(DEFAULT_DIR), ep_size=2, max_ep_size=4, moe_a2a_backend="nixl",
        nodes=2, extra_args=["--ep-num-redundant-experts", "16"],
    )
    with LocalCluster(spec) as cluster:
        url = cluster.url
        load = LoadClient(url, concurrency=2, max_new_tokens=8).start()
        try:
            t_steady = time.monotonic()
            time.sleep(steady_s)
            t_kill = time.monotonic()
            cluster.kill_node(1)
            t_failed = wait_rank(url, 1, "failed", 120)
            time.sleep(steady_s)
            t_launch = time.monotonic()
            node = cluster.start_node(1, recover=True)
            t_loaded = scheduler_joined(node.log_path, 300)
            t_active = wait_rank(url, 1, "active", 300)
            time.sleep(steady_s)
            t_end = time.monotonic()
        finally:
            results = load.stop()
    steady = [r.finished - r.started for r in results if r.ok and r.finished < t_kill]
    return {
        "detect_s": t_failed - t_kill,
        "launch_to_loaded_s": t_loaded - t_launch,
        "loaded_to_full_s": t_active - t_loaded,
        "launch_to_full_s": t_active - t_launch,
        "gap_steady_s": longest_gap(results, t_steady + 2.0, t_kill),
        "gap_fault_s": longest_gap(results, t_kill, t_launch),
        "gap_recover_s": longest_gap(results, t_launch, t_end),
        **load_counts(results),
        "latency_p50_s": statistics.median(steady) if steady else float("nan"),
    }


def main() -> None:
    r = run_under_load(__doc__, run)
    lines = [
        *seconds_table(
            "Crash recovery under load (issue: scale-up and crash recovery, item 8)",
            "Two nodes of one EP rank each (`--moe-a2a-backend nixl`, every expert on both ranks), "
            "2 concurrent clients sending 8-token greedy requests back to back. Node 1 is "
            "SIGKILLed, then relaunched with `--ep-join-mode recover`.",
        ),
        f"| kill -> rank 1 `failed` in status (fault detection) | {r['detect_s']:.1f} |",
        f"| relaunch -> replacement loaded its weights | {r['launch_to_loaded_s']:.1f} |",
        f"| replacement loaded -> full size (`serving_recovered`) | {r['loaded_to_full_s']:.1f} |",
        f"| relaunch -> full size | {r['launch_to_full_s']:.1f} |",
        f"| longest gap between completed requests, steady state | {r['gap_steady_s']:.2f} |",
        f"| longest gap, kill -> relaunch (degraded) | {r['gap_fault_s']:.2f} |",
        f"| longest gap, relaunch -> full size and after | {r['gap_recover_s']:.2f} |",
        "",
        f"{int(r['requests'])} requests, {int(r['failed'])} failed (ended with 503: running on "
        f"node 1 when it died); steady-state request latency p50 {r['latency_p50_s']:.2f} s.",
    ]
    write_section("recovery", "\n".join(lines))


if __name__ == "__main__":
    main()

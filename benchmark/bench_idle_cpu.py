"""Idle CPU use of a 2-rank CPU cluster, and first-request latency: upstream's idle loop
against the short-poll idle sleeper that parks Mooncake's spinning worker (cpu/idle.py).

Runs one cluster per setting, one after the other, and writes docs/benchmarks.md section
``idle_cpu``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402
from _scenario import tiny_spec  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.load import generate  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import process_tree  # noqa: E402
from sglang_elastic_ep_testbed.cpu.idle import ENV_IDLE_POLL_MS, ENV_PARK_SPINNERS  # noqa: E402


def tree_cpu_seconds(pid: int) -> float:
    total = 0.0
    for proc in process_tree(pid):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


SETTINGS = (  # label, SGLANG_EEP_IDLE_POLL_MS, SGLANG_EEP_IDLE_PARK_SPINNERS, MoE a2a backend
    ("before: upstream idle loop (poll 0, no parking), dense MoE", "0", "0", "none"),
    ("poll 5 ms + park Mooncake worker, dense MoE", "5", "1", "none"),
    ("poll 50 ms + park Mooncake worker (the default), dense MoE", "50", "1", "none"),
    ("poll 5 ms + park, `--moe-a2a-backend nixl`", "5", "1", "nixl"),
    ("poll 50 ms + park (the default), `--moe-a2a-backend nixl`", "50", "1", "nixl"),
)


def measure(poll_ms: str, park: str, a2a: str, idle_s: float, ranks: int) -> dict[str, float]:
    os.environ[ENV_IDLE_POLL_MS] = poll_ms
    os.environ[ENV_PARK_SPINNERS] = park
    spec = tiny_spec(ranks, a2a=a2a, max_ep_size=None)
    with LocalCluster(spec) as cluster, httpx.Client() as client:
        assert cluster.primary is not None
        for _ in range(3):  # warm every shard
            generate(client, cluster.url, "warm up", 4)
        time.sleep(2.0)
        c0, t0 = tree_cpu_seconds(cluster.primary.pid), time.monotonic()
        time.sleep(idle_s)
        cpu = (tree_cpu_seconds(cluster.primary.pid) - c0) / (time.monotonic() - t0)
        first: list[float] = []
        for _ in range(4):
            time.sleep(2.0)  # idle again, then the first request
            r = generate(client, cluster.url, "the expert rank", 1)
            assert r.ok, r.error
            first.append(r.finished - r.started)
        busy: list[float] = []
        for _ in range(8):
            r = generate(client, cluster.url, "the expert rank", 1)
            busy.append(r.finished - r.started)
    return {
        "cpu_cores": cpu,
        "first_ms": statistics.median(first) * 1e3,
        "busy_ms": statistics.median(busy) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = {}
    for label, poll, park, a2a in SETTINGS:
        rows[label] = measure(poll, park, a2a, args.idle_seconds, args.ranks)
        print(label, rows[label], flush=True)
    lines = [
        *section_head(
            f"Idle CPU of a {args.ranks}-rank CPU cluster (issue: CPU EP data plane, item 6)",
            "CPU = all processes of the server (schedulers, DP controller, detokenizer, HTTP) "
            f"over {args.idle_seconds:.0f} s idle, in cores. Latency = one-token `/generate` "
            "(median of 4 after 2 s idle, or 8 back to back).",
        ),
        "Every setting includes the DP controller fix (it blocks in zmq poll) and "
        "`--enable-dp-attention-local-control-broadcast`. Mooncake PG's worker thread spins one "
        "core per process (`while (running_) { PAUSE(); ... }`); parked while a rank is idle, "
        "what is left is the one all-gather per pass (about 4 ms on Mooncake's TCP transport, "
        "worker unparked) between polls. With NIXL, the progress thread of our CPU EP buffer "
        "waits on UCX's event descriptors instead of spinning (`make_nixl_agent`).",
        "",
        "| setting | idle CPU (cores) | first request after idle (ms) "
        "| back-to-back request (ms) |",
        "|---|---:|---:|---:|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['cpu_cores']:.2f} | {r['first_ms']:.0f} | {r['busy_ms']:.0f} |"
        )
    write_section("idle_cpu", "\n".join(lines))


if __name__ == "__main__":
    main()

"""The cost of elastic mode, side by side in one run: the same 2-rank server (NIXL EP, DP
attention) with elastic EP off, with ``--elastic-ep-backend mooncake --max-ep-size 4``, and
with ``--elastic-ep-backend mooncake`` alone; the same requests (2 clients, 16-token greedy,
back to back). Per configuration: requests/s, latency p50 / p99, and where rank 0's scheduler
spends a pass, from py-spy samples taken during the measured window (the share of samples
inside each kind of collective, inside this plugin, and the rest).

Writes docs/benchmarks.md section ``elastic_overhead``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402
from _scenario import WARM_UP_S  # noqa: E402

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import py_spy  # noqa: E402
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402

CONFIGS: dict[str, dict] = {
    "elastic off": dict(elastic=False, max_ep_size=None, extra_args=["--enable-dp-lm-head"]),
    "mooncake, --max-ep-size 4": dict(elastic=True, max_ep_size=4, extra_args=[]),
    "mooncake": dict(elastic=True, max_ep_size=None, extra_args=["--enable-dp-lm-head"]),
}
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "reduce_scatter",
               "all_to_all", "gather", "scatter", "send", "recv")


def where_time_goes(collapsed: str) -> Counter[str]:
    """Samples per kind from py-spy's collapsed stacks (``frame;frame;... count``): the
    innermost ``torch.distributed`` collective on the stack, else this plugin's code, else
    the rest."""
    kinds: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        kind = "other"
        for frame in reversed(frames):
            if "distributed_c10d.py" in frame:
                name = frame.split(" ", 1)[0].strip("(")
                kind = "collective: " + next((c for c in COLLECTIVES if name.startswith(c)),
                                             name)
                break
        else:
            if any("sglang_elastic_ep" in frame for frame in frames):
                kind = "plugin"
        kinds[kind] += int(count)
    return kinds


def profile(pid: int, seconds: float) -> Counter[str]:
    tool = py_spy()
    if tool is None:
        return Counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        subprocess.run([tool, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                        "--format", "raw", "--output", str(out), "--nonblocking", "--idle"],
                       capture_output=True, timeout=seconds + 120, check=False)
        return where_time_goes(out.read_text()) if out.exists() else Counter()


def measure(name: str, measure_s: float) -> dict:
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, moe_a2a_backend="nixl",
                       **CONFIGS[name])
    with LocalCluster(spec) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=16).start()
        try:
            time.sleep(WARM_UP_S + 5)
            start = time.monotonic()
            assert cluster.primary is not None
            rank0 = cluster.primary.scheduler_pids()[0]
            samples = profile(rank0, measure_s)
            time.sleep(max(0.0, start + measure_s - time.monotonic()))
            end = time.monotonic()
        finally:
            results = load.stop()
    done = [r for r in results if r.ok and start <= r.finished < end]
    latency = sorted((r.finished - r.started) * 1000 for r in done)
    return {
        "req_s": len(done) / (end - start),
        "p50_ms": statistics.median(latency) if latency else float("nan"),
        "p99_ms": statistics.quantiles(latency, n=100)[98] if len(latency) > 1 else float("nan"),
        "failed": sum(not r.ok for r in results),
        "samples": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-seconds", type=float, default=30.0)
    args = parser.parse_args()
    figures = {name: measure(name, args.measure_seconds) for name in CONFIGS}
    print({k: {**v, "samples": dict(v["samples"])} for k, v in figures.items()}, flush=True)
    names = list(CONFIGS)
    lines = [
        *section_head("The cost of elastic mode (2 ranks, same load)",
                      "Tiny model, 2 ranks, `--moe-a2a-backend nixl`, DP attention, 2 clients "
                      "sending 16-token greedy requests back to back; "
                      f"{args.measure_seconds:.0f} s measured after a warm-up. The breakdown "
                      "is py-spy's samples of rank 0's scheduler over the same window."),
        "| measure | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| requests/s | " + " | ".join(f"{figures[n]['req_s']:.2f}" for n in names) + " |",
        "| latency p50 (ms) | " + " | ".join(f"{figures[n]['p50_ms']:.0f}" for n in names)
        + " |",
        "| latency p99 (ms) | " + " | ".join(f"{figures[n]['p99_ms']:.0f}" for n in names)
        + " |",
        "| failed requests | " + " | ".join(str(figures[n]["failed"]) for n in names) + " |",
    ]
    kinds = sorted({k for n in names for k in figures[n]["samples"]})
    for kind in kinds:
        cells = []
        for n in names:
            total = sum(figures[n]["samples"].values()) or 1
            cells.append(f"{100 * figures[n]['samples'][kind] / total:.0f} %")
        lines.append(f"| rank 0 samples: {kind} | " + " | ".join(cells) + " |")
    write_section("elastic_overhead", "\n".join(lines))


if __name__ == "__main__":
    main()

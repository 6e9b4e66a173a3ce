"""The cost of elastic mode, side by side in one run: the same 2-rank server (NIXL EP, DP
attention) with elastic EP off, with ``--elastic-ep-backend mooncake --max-ep-size 4`` (with
Mooncake's worker parked through each forward pass, the CPU bed's default, and without), and
with ``--elastic-ep-backend mooncake`` alone; the same requests (2 clients, 16-token greedy,
back to back). The configurations take turns, ``--rounds`` times. Per configuration and round:
requests/s, latency p50 / p99, and rank 0's passes and decode step time (from its log: every
server logs each prefill and decode pass, ``--decode-log-interval 1``, with milliseconds); from
the first round, the cores rank 0's scheduler threads used and where its scheduler thread spends
its time, from py-spy samples taken during the measured window (the share of samples in each
kind of work, by the innermost Python frame), also as milliseconds per pass.

Writes docs/benchmarks.md section ``elastic_overhead``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402
from _scenario import LOG_MS_TIME, WARM_UP_S  # noqa: E402

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import py_spy  # noqa: E402
from sglang_elastic_ep_testbed.cpu.idle import ENV_PARK_SPINNERS_IN_FORWARD  # noqa: E402
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model  # noqa: E402

# Every pass logged, with milliseconds: rank 0's passes and decode step time come from its log.
LOG_EVERY_PASS = ["--decode-log-interval", "1"]
CONFIGS: dict[str, dict] = {
    "elastic off": dict(elastic=False, max_ep_size=None,
                        extra_args=["--enable-dp-lm-head", *LOG_EVERY_PASS]),
    "mooncake, --max-ep-size 4": dict(elastic=True, max_ep_size=4, extra_args=LOG_EVERY_PASS),
    "mooncake, --max-ep-size 4, worker spinning through the pass": dict(
        elastic=True, max_ep_size=4, extra_args=LOG_EVERY_PASS,
        env={ENV_PARK_SPINNERS_IN_FORWARD: "0"}),
    "mooncake": dict(elastic=True, max_ep_size=None,
                     extra_args=["--enable-dp-lm-head", *LOG_EVERY_PASS]),
}
# Rank 0's log line for one pass: its stamp and whether it prefilled or decoded.
RANK0_PASS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) DP0 TP0[^\]]*\] "
                        r"(Prefill|Decode) batch")
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "barrier", "reduce_scatter",
               "all_to_all", "gather", "scatter", "send", "recv")
# The scheduler's own thread; py-spy also samples its idle helper threads (watchdog, tqdm).
SCHEDULER_THREAD = "run_scheduler_process"


def kind_of(frames: list[str]) -> str:
    """What a scheduler-thread sample was doing, from its innermost Python frame (its self
    time): a ``torch.distributed`` collective, the CPU bed's NIXL data plane (MoE dispatch and
    combine, waiting on the peers' writes), this plugin, waiting for requests, other model
    compute, or the rest of the scheduler."""
    leaf = frames[-1]
    if "distributed_c10d.py" in leaf:
        name = leaf.split(" ", 1)[0].strip("(")
        return "collective: " + next((c for c in COLLECTIVES if name.startswith(c)), name)
    if "nixl_cpu/" in leaf or "nixl_cu12/" in leaf:
        return "MoE dispatch/combine (NIXL, CPU bed)"
    if "sglang_elastic_ep/" in leaf:
        return "plugin"
    if "cpu/idle.py" in leaf or "zmq/" in leaf:
        return "waiting for requests"
    if any("ModelRunner.forward" in frame for frame in frames):
        return "model compute (rest)"
    return "scheduler (rest)"


def where_time_goes(collapsed: str) -> Counter[str]:
    """Samples per kind (``kind_of``) of the scheduler's thread, from py-spy's collapsed
    stacks (``frame;frame;... count``)."""
    kinds: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit() and SCHEDULER_THREAD in stack:
            kinds[kind_of(stack.split(";"))] += int(count)
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


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) so far of each thread of ``pid``."""
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.NoSuchProcess:
        return {}


def cpu_shares(pid: int, before: dict[int, float], seconds: float) -> dict[str, float]:
    """Cores used over the window by the scheduler's main thread (tid == pid), by its busiest
    other thread, and by all its other threads."""
    after = thread_cpu(pid)
    used = {tid: (after[tid] - before.get(tid, 0.0)) / seconds for tid in after}
    others = [v for tid, v in used.items() if tid != pid]
    return {"main thread": used.get(pid, 0.0), "busiest other thread": max(others, default=0.0),
            "all other threads": sum(others)}


def rank0_passes(log: str, start_wall: float, end_wall: float) -> dict[str, float]:
    """Rank 0's logged passes (prefill or decode) within the window, and the median time of a
    decode pass: from one logged pass to a decode pass logged right after it."""
    passes: list[tuple[float, str]] = []
    for line in log.splitlines():
        if m := RANK0_PASS.match(line):
            at = datetime.strptime(m.group(1), LOG_MS_TIME).timestamp()
            if start_wall <= at <= end_wall:
                passes.append((at, m.group(2)))
    steps = [(b - a) * 1000 for (a, _), (b, kind) in zip(passes, passes[1:], strict=False)
             if kind == "Decode"]
    return {"passes": float(len(passes)),
            "decode_step_ms": statistics.median(steps) if steps else float("nan")}


def measure(name: str, measure_s: float) -> dict:
    config = dict(CONFIGS[name])
    env = {"SGLANG_LOG_MS": "1", **config.pop("env", {})}
    spec = ClusterSpec(write_tiny_model(DEFAULT_DIR), ep_size=2, moe_a2a_backend="nixl",
                       **config)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the servers inherit this process's environment
    try:
        return measure_cluster(spec, measure_s)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def measure_cluster(spec: ClusterSpec, measure_s: float) -> dict:
    with LocalCluster(spec) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=16).start()
        try:
            time.sleep(WARM_UP_S + 5)
            start, start_wall = time.monotonic(), time.time()
            assert cluster.primary is not None
            rank0 = cluster.primary.scheduler_pids()[0]
            cpu_before = thread_cpu(rank0)
            samples = profile(rank0, measure_s)
            time.sleep(max(0.0, start + measure_s - time.monotonic()))
            end = time.monotonic()
            cpu = cpu_shares(rank0, cpu_before, end - start)
            passes = rank0_passes(cluster.primary.log_path.read_text(errors="replace"),
                                  start_wall, start_wall + (end - start))
        finally:
            results = load.stop()
    done = [r for r in results if r.ok and start <= r.finished < end]
    latency = sorted((r.finished - r.started) * 1000 for r in done)
    return {
        "req_s": len(done) / (end - start),
        "p50_ms": statistics.median(latency) if latency else float("nan"),
        "p99_ms": statistics.quantiles(latency, n=100)[98] if len(latency) > 1 else float("nan"),
        "failed": sum(not r.ok for r in results),
        "passes_s": passes["passes"] / (end - start),
        "decode_step_ms": passes["decode_step_ms"],
        "samples": samples,
        "cpu": cpu,
    }


def per_round(rounds: list[dict], key: str, fmt: str) -> str:
    """One table cell: the figure of each round, in order."""
    return " / ".join(format(r[key], fmt) for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each configuration is measured, taking turns")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = list(CONFIGS)
    figures: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            figures[name].append(measure(name, args.measure_seconds))
    print({k: [{**r, "samples": dict(r["samples"])} for r in v] for k, v in figures.items()},
          flush=True)
    rounds = " / ".join(f"round {i + 1}" for i in range(args.rounds))
    lines = [
        *section_head("The cost of elastic mode (2 ranks, same load)",
                      "Tiny model, 2 ranks, `--moe-a2a-backend nixl`, DP attention, 2 clients "
                      "sending 16-token greedy requests back to back; "
                      f"{args.measure_seconds:.0f} s measured after a warm-up, the "
                      f"configurations taking turns ({rounds}). The cores used and the "
                      "breakdown are from the first round: py-spy's samples of rank 0's "
                      "scheduler thread over the same window, by the innermost Python frame "
                      "(a collective's own time is its wait)."),
        "| measure | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| requests/s | " + " | ".join(per_round(figures[n], "req_s", ".2f") for n in names)
        + " |",
        "| latency p50 (ms) | " + " | ".join(per_round(figures[n], "p50_ms", ".0f")
                                           for n in names) + " |",
        "| latency p99 (ms) | " + " | ".join(per_round(figures[n], "p99_ms", ".0f")
                                           for n in names) + " |",
        "| failed requests | " + " | ".join(per_round(figures[n], "failed", "d") for n in names)
        + " |",
        "| rank 0 passes/s (logged prefill and decode passes) | "
        + " | ".join(per_round(figures[n], "passes_s", ".1f") for n in names) + " |",
        "| rank 0 decode step p50 (ms) | "
        + " | ".join(per_round(figures[n], "decode_step_ms", ".1f") for n in names) + " |",
    ]
    first = {n: figures[n][0] for n in names}
    for part in ("main thread", "busiest other thread", "all other threads"):
        lines.append(f"| rank 0 scheduler, cores used: {part} | "
                     + " | ".join(f"{first[n]['cpu'][part]:.2f}" for n in names) + " |")
    shares = {n: {k: 100 * v / (sum(first[n]["samples"].values()) or 1)
                  for k, v in first[n]["samples"].items()} for n in names}
    kinds = sorted({k for n in names for k, share in shares[n].items() if share >= 0.5})
    for kind in kinds:
        lines.append(f"| rank 0 samples: {kind} | "
                     + " | ".join(f"{shares[n].get(kind, 0.0):.0f} %" for n in names) + " |")
    # The same shares as time per pass: 1 % of the samples is 10 ms of each second, shared by
    # that second's passes.
    per_pass = {n: 10 / first[n]["passes_s"] if first[n]["passes_s"] else float("nan")
                for n in names}
    for kind in kinds:
        lines.append(f"| rank 0 per logged pass (ms): {kind} | "
                     + " | ".join(f"{shares[n].get(kind, 0.0) * per_pass[n]:.1f}" for n in names)
                     + " |")
    write_section("elastic_overhead", "\n".join(lines))


if __name__ == "__main__":
    main()

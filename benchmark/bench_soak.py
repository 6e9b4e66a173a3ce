"""Soak: N cycles of 2 -> 3 -> 2 under steady load on one CPU cluster; after each cycle, what
the staying ranks hold (RSS per rank, open fds and among them TCP sockets left in CLOSE_WAIT,
threads, listening ports of the primary's processes, shared-memory segments and among them
named semaphores, the keys in the two TCPStores rank 0's scheduler hosts) and the request
latency p50 / p99 of the cycle.

Each cycle launches a scale joiner for rank 2, POSTs 3, waits for the commit, POSTs 2 and waits
for the joiner's server to exit 0. Nothing may grow cycle over cycle: the section states the
growth from the first cycle to the last and the largest step between two cycles. With
``--heap-snapshots`` it also lists the Python allocations rank 0's scheduler made from the end
of cycle 2 to the last and still holds (tracemalloc, started at the end of cycle 1: the
cycles after that run traced, so slower). With ``--malloc-stats`` each cycle also reads what
the C heap of each staying rank's scheduler holds (glibc's ``mallinfo2``: in use, and taken
from the system), and after the last cycle has them return their free heap (``malloc_trim``):
whether a rank's growth is live allocations or free memory malloc kept. Writes
docs/benchmarks.md section ``soak``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import section_head, write_section  # noqa: E402
from _scenario import REPLICATED, grow_by_joiner, operation_succeeded, tiny_spec  # noqa: E402

from sglang_elastic_ep_testbed.cluster import LoadClient, LocalCluster  # noqa: E402
from sglang_elastic_ep_testbed.cluster.observe import post_scale  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import process_tree  # noqa: E402
from sglang_elastic_ep_testbed.cluster.waits import wait_until  # noqa: E402
from sglang_elastic_ep_testbed.cpu.heap_snapshots import (  # noqa: E402
    ENV_SNAPSHOT_DIR,
    ENV_TRACE_PYTHON,
    malloc_path,
    snapshot_path,
    trim_request_path,
)

SHM = Path("/dev/shm")
# The mappings of rank 0's scheduler whose RSS changed most between the first cycle and the
# last: where its growth lives (the malloc heap, anonymous mappings, or a file).
TOP_MAPPINGS = 8
SNAPSHOT_DIR = Path(__file__).resolve().parents[1] / ".cluster" / "heap-snapshots"
TOP_ALLOCATIONS = 10  # the source lines whose live allocations grew most


class HeapSnapshots:
    """SIGUSR2 heap figures of one scheduler (``cpu/heap_snapshots.py``): each signal writes
    its C heap's figures, and with Python tracing on, first the next tracemalloc snapshot (the
    first signal starts the tracing)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.taken = pid, 0

    def take(self, trim: bool = False) -> tuple[Path, dict[str, dict[str, float]]]:
        """The tracemalloc snapshot's path (written only with tracing on) and the C heap's
        figures; ``trim``: the scheduler returns its free heap first (``malloc_trim``)."""
        if trim:
            trim_request_path(SNAPSHOT_DIR, self.pid).touch()
        figures = malloc_path(SNAPSHOT_DIR, self.pid, self.taken)
        os.kill(self.pid, signal.SIGUSR2)
        wait_until(figures.exists, 300, f"heap figures {figures.name}")  # written last
        self.taken += 1
        return (snapshot_path(SNAPSHOT_DIR, self.pid, self.taken - 1),
                json.loads(figures.read_text()))


def heap_growth(before: Path, after: Path) -> list[str]:
    """Markdown rows: the source lines whose live Python allocations grew most from ``before``
    to ``after``, then the call stack of the largest."""
    old, new = tracemalloc.Snapshot.load(str(before)), tracemalloc.Snapshot.load(str(after))
    rows = ["| allocated at | growth (KiB) | blocks | live after (KiB) |", "|---|---:|---:|---:|"]
    for stat in new.compare_to(old, "lineno")[:TOP_ALLOCATIONS]:
        frame = stat.traceback[0]
        rows.append(f"| `{_short(frame.filename)}:{frame.lineno}` | {stat.size_diff / 1024:+.0f} "
                    f"| {stat.count_diff:+d} | {stat.size / 1024:.0f} |")
    total = sum(s.size_diff for s in new.compare_to(old, "filename"))
    rows += ["", f"All traced Python allocations: {total / 2**20:+.1f} MiB between the two."]
    largest = new.compare_to(old, "traceback")[:1]
    if largest:
        rows += ["", "The call stack of the largest growth (innermost last):", "", "```",
                 *(f"{_short(f.filename)}:{f.lineno}" for f in largest[0].traceback), "```"]
    return rows


# What comes before a source file's package: site-packages, the standard library, the checkout.
_PACKAGE_PREFIX = re.compile(r"^.*?site-packages/|^.*?(?:lib/python3\.\d+|python|testbed)/")


def _short(filename: str) -> str:
    """A path from its package on."""
    return _PACKAGE_PREFIX.sub("", filename, count=1)


def rss_by_mapping(pid: int) -> dict[str, float]:
    """RSS (KiB) of process ``pid`` per mapping name from /proc/PID/smaps: a file's path,
    ``[heap]``, ``[stack]``, or ``[anon]`` for anonymous mappings (malloc's arenas and large
    blocks, Python's arenas, torch's allocations)."""
    rss: dict[str, float] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's header line
            fields = rest.split(None, 4)
            name = fields[4].strip() if len(fields) == 5 else "[anon]"
        elif head == "Rss:":
            rss[name] = rss.get(name, 0.0) + float(rest.split()[0])
    return rss


def mapping_growth(before: dict[str, float], after: dict[str, float]
                   ) -> list[tuple[str, float, float]]:
    """(mapping, KiB before, KiB after) for the mappings whose RSS changed most (none that
    kept its size)."""
    names = [n for n in set(before) | set(after) if after.get(n, 0.0) != before.get(n, 0.0)]
    changed = sorted(names, key=lambda n: -abs(after.get(n, 0.0) - before.get(n, 0.0)))
    return [(n, before.get(n, 0.0), after.get(n, 0.0)) for n in changed[:TOP_MAPPINGS]]


def held(cluster: LocalCluster) -> dict[str, float]:
    """What the primary's processes hold now: RSS (MiB) of each rank's scheduler, fds,
    threads and listening ports over its whole tree, and /dev/shm entries."""
    assert cluster.primary is not None
    out: dict[str, float] = {}
    for rank, pid in sorted(cluster.primary.scheduler_pids().items()):
        memory = psutil.Process(pid).memory_full_info()
        out[f"rss_rank{rank}_mib"] = memory.rss / 2**20
        out[f"uss_rank{rank}_mib"] = memory.uss / 2**20  # pages of its own, shared ones out
    fds = threads = close_wait = 0
    ports: set[int] = set()
    for proc in process_tree(cluster.primary.pid):
        try:
            fds += proc.num_fds()
            threads += proc.num_threads()
            connections = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        # Sockets whose peer hung up and that their owner never closed.
        close_wait += sum(c.status == psutil.CONN_CLOSE_WAIT for c in connections)
    shm = list(SHM.iterdir()) if SHM.exists() else []
    out.update(fds=fds, close_wait_sockets=close_wait, threads=threads,
               listening_ports=len(ports), shm_segments=len(shm),
               shm_semaphores=sum(p.name.startswith("sem.") for p in shm),
               rendezvous_keys=store_keys(cluster.dist_port),
               nixl_store_keys=store_keys(int(cluster.env["SGLANG_TCP_STORE_PORT"])))
    return out


def store_keys(port: int) -> float:
    """How many keys the TCPStore on ``port`` holds (it lives in rank 0's scheduler, so every
    key stays in that process until the server stops); NaN when it cannot be reached."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        return float(store.num_keys())
    except Exception:  # a figure of the report, not a reason to stop the soak
        return float("nan")


def latency_ms(load: LoadClient, since: float, until: float) -> tuple[float, float]:
    """p50 and p99 (ms) of the requests that completed in [since, until)."""
    done = sorted((r.finished - r.started) * 1000 for r in load.snapshot()
                  if r.ok and since <= r.finished < until)
    if not done:
        return float("nan"), float("nan")
    p99 = statistics.quantiles(done, n=100)[98] if len(done) > 1 else done[0]
    return statistics.median(done), p99


def heap_figures(heaps: dict[int, HeapSnapshots], trim: bool = False
                 ) -> dict[int, dict[str, float]]:
    """Staying rank -> its scheduler's C heap figures in KiB (``cpu/heap_snapshots.py``);
    with ``trim``, those after it returned its free heap."""
    side = "after_trim" if trim else "before_trim"
    return {rank: heap.take(trim=trim)[1][side] for rank, heap in sorted(heaps.items())}


def malloc_columns(figures: dict[int, dict[str, float]]) -> dict[str, float]:
    """The table's columns: MiB each rank's C heap has in use and holds from the system."""
    return {f"malloc_{name}_rank{rank}_mib": kib[f"{name}_kib"] / 1024
            for rank, kib in figures.items() for name in ("in_use", "held")}


def run(cycles: int, settle_s: float, heap: bool = False, malloc: bool = False
        ) -> tuple[list[dict[str, float]], int, int, list[tuple[str, float, float]], list[str],
                   dict[int, dict[str, float]]]:
    """The per-cycle figures (cycle 0: before the first), requests, failed requests, the
    mappings of rank 0's scheduler that grew most from cycle 1 to the last, (``heap``) its
    Python heap's growth from cycle 2 to the last (:func:`heap_growth`), and (``malloc``) the
    staying ranks' C heap figures after they returned their free heap at the end (not both:
    the tracing slows the schedulers several times over)."""
    rows: list[dict[str, float]] = []
    first_maps: dict[str, float] = {}
    last_maps: dict[str, float] = {}
    snapshots: list[Path] = []
    heaps: dict[int, HeapSnapshots] = {}
    trimmed: dict[int, dict[str, float]] = {}
    if heap or malloc:
        shutil.rmtree(SNAPSHOT_DIR, ignore_errors=True)
        SNAPSHOT_DIR.mkdir(parents=True)
        os.environ[ENV_SNAPSHOT_DIR] = str(SNAPSHOT_DIR)  # the servers inherit it
        os.environ[ENV_TRACE_PYTHON] = "1" if heap else "0"
    # The configuration of the scale-up once seen hanging in its commit (docs/design.md).
    with LocalCluster(tiny_spec(extra_args=REPLICATED)) as cluster:
        load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
        try:
            time.sleep(settle_s)
            start = time.monotonic()
            if heap or malloc:
                heaps = {rank: HeapSnapshots(pid)
                         for rank, pid in cluster.primary.scheduler_pids().items()}
            rows.append({"cycle": 0, **held(cluster), **dict(zip(
                ("p50_ms", "p99_ms"), latency_ms(load, 0.0, start), strict=True))})
            if malloc:
                rows[-1].update(malloc_columns(heap_figures(heaps)))
            for cycle in range(1, cycles + 1):
                joiner = grow_by_joiner(cluster, f"soak-{cycle}-grow")
                post_scale(cluster.url, 2, f"soak-{cycle}-shrink")
                operation_succeeded(cluster.url, f"soak-{cycle}-shrink", 420)
                code = joiner.wait_exit(120)
                if code != 0:
                    raise RuntimeError(f"cycle {cycle}: the joiner exited with {code}, not 0")
                time.sleep(settle_s)  # released resources are let go asynchronously
                end = time.monotonic()
                p50, p99 = latency_ms(load, start, end)
                rows.append({"cycle": cycle, **held(cluster), "p50_ms": p50, "p99_ms": p99})
                last_maps = rss_by_mapping(cluster.primary.scheduler_pids()[0])
                first_maps = first_maps or last_maps
                if malloc:
                    rows[-1].update(malloc_columns(heap_figures(heaps)))
                if heap and (cycle <= 2 or cycle == cycles):
                    snapshots.append(heaps[0].take()[0])  # cycle 1: the tracing starts
                print(rows[-1], flush=True)
                start = end
            if malloc:
                trimmed = heap_figures(heaps, trim=True)
        finally:
            results = load.stop()
    growth_rows = heap_growth(snapshots[1], snapshots[-1]) if len(snapshots) >= 3 else []
    return (rows, len(results), sum(not r.ok for r in results),
            mapping_growth(first_maps, last_maps), growth_rows, trimmed)


def growth(rows: list[dict[str, float]], key: str) -> tuple[float, float]:
    """From cycle 1 to the last, and the largest rise between consecutive cycles from 1 on
    (cycle 0, before any scale, has not loaded what the first joiner brings)."""
    values = [r[key] for r in rows[1:]]
    steps = [b - a for a, b in zip(values, values[1:], strict=False)] or [0.0]
    return values[-1] - values[0], max(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--settle-seconds", type=float, default=10.0)
    parser.add_argument("--heap-snapshots", action="store_true",
                        help="trace rank 0's Python heap from cycle 1 on (3 cycles at least)")
    parser.add_argument("--malloc-stats", action="store_true",
                        help="read the staying ranks' C heap figures each cycle, and have them "
                             "return their free heap after the last")
    args = parser.parse_args()
    if args.heap_snapshots and args.malloc_stats:
        parser.error("--heap-snapshots slows the schedulers several times over: run "
                     "--malloc-stats on its own")
    rows, requests, failed, mappings, heap_rows, trimmed = run(
        args.cycles, args.settle_seconds, args.heap_snapshots, args.malloc_stats)
    keys = [k for k in rows[0] if k != "cycle"]
    lines = [
        *section_head(f"Soak: {args.cycles} cycles of 2 -> 3 -> 2 under load",
                      "A 2-rank primary (`--moe-a2a-backend nixl`, `--max-ep-size 4`, "
                      "`--ep-num-redundant-experts 16`: the scale-up once seen hanging), 2 "
                      "clients sending 8-token greedy requests back to back throughout; each "
                      "cycle a scale joiner for rank 2, `new_ep_size: 3`, then `2` (the joiner "
                      "exits 0). Measured after each cycle and `--settle-seconds`; cycle 0 is "
                      "before the first."),
        "| cycle | " + " | ".join(keys) + " |",
        "|---:|" + "---:|" * len(keys),
    ]
    for row in rows:
        lines.append(f"| {int(row['cycle'])} | "
                     + " | ".join(f"{row[k]:.1f}" if k.endswith("_mib") else f"{row[k]:.0f}"
                                  for k in keys) + " |")
    lines += ["", "| held by the staying ranks | cycle 1 -> last | largest rise between two "
              "cycles |", "|---|---:|---:|"]
    for key in keys:
        if key.endswith("_ms"):
            continue
        total, step = growth(rows, key)
        digits = 1 if key.endswith("_mib") else 0
        lines.append(f"| {key} | {total:+.{digits}f} | {step:+.{digits}f} |")
    lines += ["", "Rank 0's scheduler, RSS by mapping (/proc/PID/smaps), the mappings that "
              "changed most from cycle 1 to the last:", "",
              "| mapping | cycle 1 (KiB) | last (KiB) | change (KiB) |", "|---|---:|---:|---:|"]
    lines += [f"| `{name}` | {a:.0f} | {b:.0f} | {b - a:+.0f} |" for name, a, b in mappings]
    if heap_rows:
        lines += ["", f"Rank 0's scheduler, live Python allocations (tracemalloc) from the end of "
                  f"cycle 2 to the end of cycle {args.cycles}, by source line:", "", *heap_rows]
    if trimmed:
        lines += ["", "After the last cycle each staying rank's scheduler returned its free C "
                  "heap (`malloc_trim(0)`), MiB:", "",
                  "| rank | RSS before | RSS after | C heap held before | held after | "
                  "in use after |", "|---:|---:|---:|---:|---:|---:|"]
        last = rows[-1]
        for rank, after in sorted(trimmed.items()):
            lines.append(
                f"| {rank} | {last[f'rss_rank{rank}_mib']:.1f} | {after['rss_kib'] / 1024:.1f} "
                f"| {last[f'malloc_held_rank{rank}_mib']:.1f} "
                f"| {after['held_kib'] / 1024:.1f} | {after['in_use_kib'] / 1024:.1f} |")
    lines += ["", f"{requests} requests, {failed} failed."]
    write_section("soak", "\n".join(lines))


if __name__ == "__main__":
    main()

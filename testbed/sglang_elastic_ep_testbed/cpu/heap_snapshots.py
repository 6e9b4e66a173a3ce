"""Heap figures of a running scheduler on demand, for the soak's memory question.

With ``SGLANG_EEP_HEAP_SNAPSHOT_DIR`` set, each SIGUSR2 to a scheduler process writes what its
C heap holds (glibc's ``mallinfo2``: bytes in use and bytes taken from the system, and the RSS)
to ``<dir>/<pid>-<n>.malloc.json``. Native code (Mooncake, NIXL/UCX, torch's CPU allocator)
allocates there, and so does Python for its arenas. When ``<dir>/<pid>.trim`` exists, the
process then also returns the free heap to the system (``malloc_trim(0)``) and records the
figures again: what ``malloc_trim`` gives back was free memory malloc kept, not a live object.

With ``SGLANG_EEP_HEAP_SNAPSHOT_PYTHON=1`` each signal first writes a ``tracemalloc`` snapshot
to ``<dir>/<pid>-<n>.tracemalloc`` as well. The first signal starts the tracing (nothing is
traced, and nothing costs, before it), so the snapshots compare what a process allocated after
the first signal and still holds. The tracing slows the scheduler several times over.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sglang_elastic_ep_testbed.cpu.idle import env_flag

ENV_SNAPSHOT_DIR = "SGLANG_EEP_HEAP_SNAPSHOT_DIR"
ENV_TRACE_PYTHON = "SGLANG_EEP_HEAP_SNAPSHOT_PYTHON"
TRACEBACK_FRAMES = 8  # enough to tell which caller keeps an allocation


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later), summed over every arena."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def snapshot_path(directory: Path, pid: int, index: int) -> Path:
    return directory / f"{pid}-{index}.tracemalloc"


def malloc_path(directory: Path, pid: int, index: int) -> Path:
    return directory / f"{pid}-{index}.malloc.json"


def trim_request_path(directory: Path, pid: int) -> Path:
    return directory / f"{pid}.trim"


def rss_kib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def malloc_figures(libc: ctypes.CDLL) -> dict[str, float]:
    """KiB: what malloc hands out now (small blocks plus mmapped large ones), what it holds
    from the system, and the process's RSS."""
    info = libc.mallinfo2()
    return {"in_use_kib": (info.uordblks + info.hblkhd) / 1024,
            "held_kib": (info.arena + info.hblkhd) / 1024, "rss_kib": rss_kib()}


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(path.name + ".partial")
    write(tmp)
    tmp.rename(path)  # the reader waits for the final name: never half a file


def install_heap_snapshot_on_signal(result: Any, scheduler: Any, *args: Any,
                                    **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_request_dispatcher`` (once, in the scheduler's main thread)."""
    directory = os.environ.get(ENV_SNAPSHOT_DIR)
    if not directory:
        return
    trace_python = env_flag(ENV_TRACE_PYTHON, default=False)
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    counter = itertools.count()

    def snapshot(signum: int, frame: Any) -> None:
        index, pid = next(counter), os.getpid()
        if trace_python:
            if not tracemalloc.is_tracing():
                tracemalloc.start(TRACEBACK_FRAMES)
            write_atomically(snapshot_path(Path(directory), pid, index),
                             lambda tmp: tracemalloc.take_snapshot().dump(str(tmp)))
        figures: dict[str, Any] = {"before_trim": malloc_figures(libc)}
        if trim_request_path(Path(directory), pid).exists():
            libc.malloc_trim(0)
            figures["after_trim"] = malloc_figures(libc)
        write_atomically(malloc_path(Path(directory), pid, index),
                         lambda tmp: tmp.write_text(json.dumps(figures)))

    signal.signal(signal.SIGUSR2, snapshot)

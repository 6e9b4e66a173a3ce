"""Python heap snapshots of a running scheduler on demand, for the soak's memory question.

With ``SGLANG_EEP_HEAP_SNAPSHOT_DIR`` set, SIGUSR2 to a scheduler process writes a
``tracemalloc`` snapshot of it to ``<dir>/<pid>-<n>.tracemalloc``. The first signal starts the
tracing (nothing is traced, and nothing costs, before it), so the snapshots compare what a
process allocated after the first signal and still holds. Only Python's allocators are seen:
memory that native code (Mooncake, torch, NIXL) takes with malloc is not in a snapshot.
"""

from __future__ import annotations

import itertools
import os
import signal
import tracemalloc
from pathlib import Path
from typing import Any

ENV_SNAPSHOT_DIR = "SGLANG_EEP_HEAP_SNAPSHOT_DIR"
TRACEBACK_FRAMES = 8  # enough to tell which caller keeps an allocation


def snapshot_path(directory: Path, pid: int, index: int) -> Path:
    return directory / f"{pid}-{index}.tracemalloc"


def install_heap_snapshot_on_signal(result: Any, scheduler: Any, *args: Any,
                                    **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_request_dispatcher`` (once, in the scheduler's main thread)."""
    directory = os.environ.get(ENV_SNAPSHOT_DIR)
    if not directory:
        return
    counter = itertools.count()

    def snapshot(signum: int, frame: Any) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(TRACEBACK_FRAMES)
        path = snapshot_path(Path(directory), os.getpid(), next(counter))
        tmp = path.with_suffix(".partial")
        tracemalloc.take_snapshot().dump(str(tmp))
        tmp.rename(path)  # the reader waits for the final name: never half a file

    signal.signal(signal.SIGUSR2, snapshot)

"""The signals a CPU scheduler answers for tests and benchmarks, installed once in its main
thread: SIGUSR1 stops it for a while (:mod:`.fault_injection`), SIGUSR2 writes its heap
figures when ``SGLANG_EEP_HEAP_SNAPSHOT_DIR`` is set (:mod:`.heap_snapshots`)."""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep_testbed.cpu.fault_injection import install_stall_on_signal
from sglang_elastic_ep_testbed.cpu.heap_snapshots import install_heap_snapshot_on_signal


def install_scheduler_signals(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_request_dispatcher`` (once, in the scheduler's main thread)."""
    install_stall_on_signal(result, scheduler, *args, **kwargs)
    install_heap_snapshot_on_signal(result, scheduler, *args, **kwargs)

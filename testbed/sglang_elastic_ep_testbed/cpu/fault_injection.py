"""A stuck scheduler on demand: SIGUSR1 makes a scheduler's main thread stop for a while.

What a rank that never enters a collective looks like to the others (a peer that never comes):
its process stays alive (Mooncake's worker threads keep answering heartbeats) while the other
ranks wait for it in the pass's DP gather. The e2e stall test sends the signal to one rank.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

ENV_STALL_S = "SGLANG_EEP_TEST_STALL_S"  # how long the main thread stops (read at start-up)
DEFAULT_STALL_S = 30.0


def install_stall_on_signal(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_request_dispatcher`` (once, in the scheduler's main thread)."""
    seconds = float(os.environ.get(ENV_STALL_S, DEFAULT_STALL_S))

    def stall(signum: int, frame: Any) -> None:
        time.sleep(seconds)

    signal.signal(signal.SIGUSR1, stall)

"""Whether serving has stalled: requests wait and no scheduler has answered for a while.

A scheduler stuck in a collective (a peer that never arrives) stops every rank's passes: no
token reaches the HTTP process, while the status may still read "waiting" or "serving". The
HTTP process sees only that: requests in flight and the time of the last answer from the
schedulers. The stall clock starts at the later of that answer and the moment requests began
to wait (an idle server's last answer may be an hour old).
"""

from __future__ import annotations

import math


class StallDetector:
    """Fed once per check; says since when serving is stalled, or None."""

    def __init__(self, threshold_s: float) -> None:
        if not threshold_s > 0:
            raise ValueError(f"the stall threshold must be > 0 seconds, got {threshold_s}")
        self.threshold_s = threshold_s
        self._waiting_since: float | None = None

    def observe(self, now: float, waiting_requests: int,
                last_answer_at: float | None) -> float | None:
        """``now`` and ``last_answer_at`` on one clock; the time the stall began, or None."""
        if waiting_requests <= 0:
            self._waiting_since = None
            return None
        if self._waiting_since is None:
            self._waiting_since = now
        since = max(self._waiting_since,
                    last_answer_at if last_answer_at is not None else -math.inf)
        return since if now - since > self.threshold_s else None

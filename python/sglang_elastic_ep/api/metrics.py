"""Prometheus metrics of elastic EP, shown on SGLang's ``/metrics``.

SGLang serves ``/metrics`` from a fresh ``CollectorRegistry`` fed only by
``prometheus_client.multiprocess.MultiProcessCollector`` over ``PROMETHEUS_MULTIPROC_DIR``
(``sglang.srt.utils.common.add_prometheus_middleware``). A metric shows up there when the
process that updates it has imported ``prometheus_client`` *after* that variable was set:
the client picks its file-backed value class at import. So this module imports
``prometheus_client`` only when ``ElasticEPMetrics`` is built (never at plugin load, which
would also break SGLang's own metrics), and gauges declare ``multiprocess_mode``.

Names follow SGLang's ``sglang:`` prefix:

| metric | type | labels |
|---|---|---|
| ``sglang:elastic_ep_effective_size`` | gauge | |
| ``sglang:elastic_ep_max_size`` | gauge | |
| ``sglang:elastic_ep_active_ranks`` | gauge | |
| ``sglang:elastic_ep_failed_ranks`` | gauge | |
| ``sglang:elastic_ep_operation_running`` | gauge | |
| ``sglang:elastic_ep_operations_total`` | counter | ``kind``, ``result`` |
| ``sglang:elastic_ep_phase_duration_seconds`` | histogram | ``kind``, ``phase`` |
| ``sglang:elastic_ep_degraded_seconds_total`` | counter | |
| ``sglang:elastic_ep_stalled_seconds`` | gauge | |
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sglang_elastic_ep.core.api_models import (
    OperationResult,
    OperationStatus,
    RankState,
    StatusResponse,
)

PREFIX = "sglang:elastic_ep_"
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                 1800.0)


class ElasticEPMetrics:
    """Owns the metric objects; ``update_from_status`` and ``observe_operation`` feed them."""

    def __init__(
        self,
        registry: Any = "default",
        *,
        clock: Callable[[], float] = time.monotonic,
        seen_capacity: int = 1024,
    ) -> None:
        # Imported here, not at module import: see the module docstring.
        import prometheus_client as prom

        kw: dict[str, Any] = {}
        if registry != "default":
            kw["registry"] = registry  # None: not registered (multiprocess files only)
        self._clock = clock
        self._lock = threading.Lock()
        self._degraded_since: float | None = None
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._seen_capacity = seen_capacity

        def gauge(name: str, doc: str) -> Any:
            return prom.Gauge(PREFIX + name, doc, multiprocess_mode="mostrecent", **kw)

        self.effective_size = gauge(
            "effective_size",
            "EP ranks managed now (serving, or failed in place; removed ranks' holes not counted)",
        )
        self.max_size = gauge("max_size", "--max-ep-size: the most EP ranks this server can use")
        self.active_ranks = gauge("active_ranks", "EP ranks serving now")
        self.failed_ranks = gauge("failed_ranks", "EP ranks failed inside the managed size")
        self.operation_running = gauge(
            "operation_running", "1 while a scale operation runs, else 0"
        )
        self.operations = prom.Counter(
            PREFIX + "operations",
            "Finished scale operations by kind (scale_up, scale_down, noop) and result",
            ["kind", "result"],
            **kw,
        )
        self.phase_duration = prom.Histogram(
            PREFIX + "phase_duration_seconds",
            "Time finished operations spent in each phase",
            ["kind", "phase"],
            buckets=PHASE_BUCKETS,
            **kw,
        )
        self.stalled_seconds = gauge(
            "stalled_seconds",
            "How long serving has been stalled (passes no longer complete; the status's "
            "stalled_s), 0 while it runs",
        )
        self.degraded_seconds = prom.Counter(
            PREFIX + "degraded_seconds",
            "Seconds spent serving with at least one failed EP rank",
            **kw,
        )

    def update_from_status(self, status: StatusResponse) -> None:
        """Set the gauges from a status snapshot; accrue degraded time since the last call."""
        failed = sum(1 for r in status.ranks if r.state is RankState.FAILED)
        active = sum(
            1 for r in status.ranks if r.state in (RankState.ACTIVE, RankState.LEAVING)
        )
        self.effective_size.set(status.effective_ep_size)
        self.max_size.set(status.max_ep_size)
        self.active_ranks.set(active)
        self.failed_ranks.set(failed)
        self.operation_running.set(1 if status.current_operation is not None else 0)
        self.stalled_seconds.set(status.stalled.stalled_s if status.stalled is not None else 0)
        now = self._clock()
        with self._lock:
            if self._degraded_since is not None:
                self.degraded_seconds.inc(max(0.0, now - self._degraded_since))
            self._degraded_since = now if failed else None

    def observe_operation(self, op: OperationStatus) -> bool:
        """Count a finished operation and its phase durations once; False if already seen."""
        if op.result is OperationResult.RUNNING:
            return False
        with self._lock:
            if op.operation_id in self._seen:
                return False
            self._seen[op.operation_id] = None
            while len(self._seen) > self._seen_capacity:
                self._seen.popitem(last=False)
        kind = op.kind.value
        self.operations.labels(kind=kind, result=op.result.value).inc()
        stamps = op.phase_timestamps
        for here, nxt in zip(stamps, stamps[1:], strict=False):
            self.phase_duration.labels(kind=kind, phase=here.phase.value).observe(
                max(0.0, nxt.at - here.at)
            )
        return True


_default: ElasticEPMetrics | None = None
_default_lock = threading.Lock()


def get_metrics() -> ElasticEPMetrics:
    """The process-wide instance on prometheus_client's default registry (created once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ElasticEPMetrics()
        return _default

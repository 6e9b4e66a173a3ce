"""Background work of the HTTP server process: the expert health poller, the stall watch, the
metrics refresher and the refill deadline, each on its own daemon thread (``run_every``)
started by ``server_mount.mount_on_server``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.core.api_models import RankPosition, RankState
from sglang_elastic_ep.core.stall import positions_from_reports, stuck_in_a_pass
from sglang_elastic_ep.sglang.pass_progress import READ_TIMEOUT_S, read_reports
from sglang_elastic_ep.sglang.world_registration import KeyValueStore, rendezvous_store

logger = logging.getLogger(__name__)

HEALTH_ANSWER_TIMEOUT_S = 10.0
METRICS_REFRESH_S = 5.0


class ExpertHealthPoller:
    """Health checks from rank 0's gathered expert timings (sglang/expert_health.py): the
    monitor marks slow experts and hard-blocks a rank after enough slow checks
    (``recovery_required``); such a rank is then blocked in the data plane, where every expert
    it serves has a replica on another serving rank."""

    def __init__(self, tokenizer_manager: Any, plane: InProcessControlPlane) -> None:
        self._tm = tokenizer_manager
        self._plane = plane
        # Ranks already warned about (slow, but holding an expert's last replica): warn once.
        self._cannot_block: set[int] = set()

    async def poll(self) -> None:
        """One health check."""
        from sglang.srt.managers.io_struct import SetInternalStateReq

        from sglang_elastic_ep.core.health import ExpertTimings, blockable_ranks
        from sglang_elastic_ep.core.placement import experts_per_rank, slots_per_rank
        from sglang_elastic_ep.sglang.expert_health import BLOCKED_RANKS_KEY, REPORT_KEY

        tm = self._tm
        plane = self._plane
        states = await asyncio.wait_for(tm.get_internal_state(), HEALTH_ANSWER_TIMEOUT_S)
        report = next((s[REPORT_KEY] for s in states if isinstance(s, dict) and REPORT_KEY in s),
                      None)
        if report is None or not report.get("local_slots"):
            return
        timings = ExpertTimings(local_slots=int(report["local_slots"]),
                                ns_per_row=tuple(report["ns_per_row"]),
                                rows=tuple(report["rows"]))
        plane.report_expert_placement(
            experts_per_rank(report["physical_to_logical"], timings.local_slots),
            slots_per_rank(report["physical_to_logical"], timings.local_slots),
            report.get("eplb_rebalances", ()),
        )
        m = plane.membership
        ranks = [r for r in m.managed_ranks() if r not in m.leaving]
        serving = [r for r in ranks if r not in m.failed]
        latency, owner = timings.for_monitor(ranks)
        plane.observe_health(alive={r: r not in m.failed for r in ranks},
                             expert_latency=latency, expert_rank=owner)
        slow = [r.rank for r in plane.health().ranks if r.hard_blocked and r.rank in serving]
        blocked, kept = blockable_ranks(slow, report["physical_to_logical"],
                                        timings.local_slots, serving)
        for rank, experts in kept.items():
            if rank not in self._cannot_block:
                self._cannot_block.add(rank)
                logger.warning("elastic EP: rank %d has slow experts but stays in use: logical "
                               "experts %s have no replica on another serving rank", rank, experts)
        mask = sum(1 << r for r in blocked)
        if mask != int(report.get("blocked_ranks_mask", 0)):
            await asyncio.wait_for(
                tm.set_internal_state(SetInternalStateReq(server_args={BLOCKED_RANKS_KEY: mask})),
                HEALTH_ANSWER_TIMEOUT_S,
            )
            logger.warning("elastic EP: ranks %s blocked for slow experts (data plane)",
                           sorted(blocked))

    def start(self, interval_s: float) -> None:
        """Polls on the tokenizer's event loop (where its communicators live), from a thread."""
        tokenizer_manager = self._tm

        def check() -> None:
            loop = getattr(tokenizer_manager, "event_loop", None)
            if loop is None:
                return  # the first request creates it
            asyncio.run_coroutine_threadsafe(self.poll(), loop).result(
                timeout=3 * HEALTH_ANSWER_TIMEOUT_S
            )

        run_every(interval_s, "elastic-ep-health", "expert health poll", check)


class StallWatch:
    """Reports a stall (``core.stall``) to the plane, with where each scheduler is (the reports
    they publish, ``pass_progress``): requests in the tokenizer's table and no answer from any
    scheduler for ``threshold_s``; or, while no request waits, a serving scheduler in one step
    of a pass for ``threshold_s``. Reads two attributes of the tokenizer from its own thread,
    never its event loop (a stalled server's loop is busy waiting too)."""

    def __init__(self, tokenizer_manager: Any, plane: InProcessControlPlane,
                 threshold_s: float, count_out_s: float | None = None) -> None:
        from sglang_elastic_ep.core.stall import StallDetector

        self._tm = tokenizer_manager
        self._plane = plane
        self._detector = StallDetector(threshold_s)
        self._count_out_s = count_out_s  # core.stall.mooncake_count_out_s of the deployment
        self._store: KeyValueStore | None = None
        # The store's reads run here, bounded by READ_TIMEOUT_S: a store whose host (rank 0)
        # is stopped accepts the connection and never answers.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="elastic-ep-stall-read")
        self._reading: Future[list[dict[str, Any]]] | None = None

    def check(self) -> None:
        waiting = len(getattr(self._tm, "rid_to_state", {}) or {})
        last = getattr(self._tm, "last_receive_tstamp", None)
        now = time.time()
        since = self._detector.observe(now, waiting, last)
        positions = self.positions(now) if since is not None or waiting == 0 else None
        if since is None and positions is not None:
            serving = [r.rank for r in self._plane.status().ranks
                       if r.state in (RankState.ACTIVE, RankState.LEAVING)]
            stuck_s = stuck_in_a_pass(positions, serving, self._detector.threshold_s)
            since = None if stuck_s is None else now - stuck_s
        self._plane.observe_stall(since, waiting, positions, self._count_out_s)

    def positions(self, now: float) -> list[RankPosition]:
        """Where the schedulers of the current size are (empty when unreadable in time)."""
        addr = getattr(getattr(self._tm, "server_args", None), "dist_init_addr", None)
        if not addr:
            return []
        if self._reading is None or self._reading.done():
            ranks = range(self._plane.status().effective_ep_size)
            self._reading = self._reader.submit(self._read, f"tcp://{addr}", ranks)
        try:
            return positions_from_reports(self._reading.result(timeout=READ_TIMEOUT_S), now)
        except Exception:  # rank 0, which hosts the store, may be the one that is stopped
            logger.debug("elastic EP: the schedulers' progress reports are unreadable",
                         exc_info=True)
            return []

    def _read(self, init_method: str, ranks: range) -> list[dict[str, Any]]:
        try:
            self._store = self._store or rendezvous_store(init_method, READ_TIMEOUT_S)
            return [] if self._store is None else read_reports(self._store, ranks)
        except Exception:
            self._store = None
            raise

    def start(self, interval_s: float) -> None:
        run_every(interval_s, "elastic-ep-stall-watch", "stall check", self.check)


def run_every(interval_s: float, name: str, what: str, step: Callable[[], object]) -> None:
    """Run ``step`` every ``interval_s`` on daemon thread ``name``; a failure (logged as
    ``what``) is retried at the next interval and never stops the thread."""

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                step()
            except Exception:
                logger.debug("elastic EP: %s failed", what, exc_info=True)

    threading.Thread(target=run, name=name, daemon=True).start()


def start_metrics_refresher(plane: InProcessControlPlane) -> None:
    """Gauges follow every change already; time spent degraded also grows between changes."""
    run_every(METRICS_REFRESH_S, "elastic-ep-metrics", "metrics refresh", plane.refresh_metrics)


def start_refill_deadline_watch(plane: InProcessControlPlane, interval_s: float = 1.0) -> None:
    """A refill of removed ranks' holes waits for relaunches that may never come: its timeout
    is checked here, since no scheduler step runs for it."""
    run_every(interval_s, "elastic-ep-refill-deadline", "refill deadline check",
              plane.expire_overdue_refill)

"""Where each scheduler is, readable while it is stuck: the step of its pass and since when.

A stalled server's schedulers answer nothing, so the HTTP process alone cannot say which rank
waits where. Each scheduler records the step it enters (the DP-attention gather every pass
starts with, the forward, idle, an agreed membership step) in a small object kept on upstream's
per-process ``ElasticEPState``: one attribute write per step, nothing on the device. A daemon
thread publishes it once a second into the deployment's rendezvous store (the TCPStore behind
``--dist-init-addr``, hosted by rank 0 and reachable from every node), and keeps doing so while
the main thread waits in a collective. The HTTP process reads the reports only when it reports
a stall (``background_pollers.StallWatch``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state
from sglang_elastic_ep.sglang.world_registration import KeyValueStore, rendezvous_store

logger = get_logger(__name__)

PUBLISH_INTERVAL_S = 1.0
READ_TIMEOUT_S = 2.0  # the HTTP process's reads: rank 0, which hosts the store, may be stopped
_KEY = "sglang_eep/pass_progress/{rank}"


def report_key(rank: int) -> str:
    return _KEY.format(rank=rank)


@dataclass
class PassProgress:
    """This scheduler's current step; written by its main thread, read by the publisher."""

    rank: int
    step: str = "starting"
    since: float = field(default_factory=time.time)
    passes: int = 0
    # The token count of each DP rank as this rank's last gather left them (after any repair):
    # whether the pass runs a forward. Two survivors that decide a pass differently wait for
    # each other; their reports then say which row they saw differently.
    tokens: list[int] | None = None
    connect: Callable[[], KeyValueStore | None] | None = None  # set once it publishes

    @property
    def publishing(self) -> bool:
        return self.connect is not None

    def now_in(self, step: str) -> None:
        if step != self.step:
            self.step, self.since = step, time.time()

    def gathered(self) -> None:
        """A pass's DP gather is about to run."""
        self.passes += 1
        self.now_in("gather")

    def took_tokens(self, tokens: list[int] | None) -> None:
        """The gather of the current pass is done: each DP rank's token count as taken."""
        self.tokens = tokens

    def report(self, now: float) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "since": self.since,
                "passes": self.passes, "tokens": self.tokens, "at": now}

    def publish_forever(self, connect: Callable[[], KeyValueStore | None],
                        interval_s: float = PUBLISH_INTERVAL_S) -> None:
        """Start the publisher thread (once)."""
        if self.publishing:
            return
        self.connect = connect

        def run() -> None:
            store: KeyValueStore | None = None
            while True:
                try:
                    store = store or connect()
                    if store is not None:
                        store.set(report_key(self.rank), json.dumps(self.report(time.time())))
                except Exception:  # the store is back at the next beat, or the process ends
                    store = None
                    logger.debug("[elastic-ep] pass progress not published", exc_info=True)
                time.sleep(interval_s)

        threading.Thread(target=run, name="elastic-ep-pass-progress", daemon=True).start()

    def log_last_reports(self, ranks: Sequence[int]) -> threading.Thread | None:
        """Log, from a thread of its own (the store's host may be among ``ranks``), the last
        report of each of ``ranks`` that this rank just took for failed. A live rank publishes
        every second: a report still fresh long after its step began says that rank is alive
        and stuck in that step (a peer that stopped answering, not a dead one); a report about
        as old as its step, that the rank stopped there."""
        connect = self.connect
        if connect is None or not ranks:
            return None

        def run() -> None:
            try:
                store = connect()
                reports = [] if store is None else read_reports(store, ranks)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: say why, never raise
                logger.info("[elastic-ep] rank %d: no progress report of ranks %s readable "
                            "(%s)", self.rank, list(ranks), exc)
                return
            logger.info("[elastic-ep] rank %d took ranks %s for failed; their last progress "
                        "reports: %s; this rank's last gather's tokens: %s", self.rank,
                        list(ranks), describe_reports(reports, ranks, time.time()),
                        self.tokens)

        thread = threading.Thread(target=run, name="elastic-ep-peer-reports", daemon=True)
        thread.start()
        return thread


_ATTR = "_elastic_ep_pass_progress"


def pass_progress(state: Any) -> PassProgress | None:
    """This process's progress record, once the scheduler loop started it (None before)."""
    return getattr(state, _ATTR, None)


def start_pass_progress(state: Any, scheduler: Any) -> PassProgress | None:
    """The progress record on ``state``, built and published on the scheduler loop's first
    iteration (when ``--dist-init-addr`` names the rendezvous store); None outside a
    distributed run. Later iterations read it with ``pass_progress``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    progress = attached_state(state, _ATTR, lambda: PassProgress(rank=dist.get_rank()))
    addr = getattr(getattr(scheduler, "server_args", None), "dist_init_addr", None)
    if addr and not progress.publishing:
        progress.publish_forever(lambda: rendezvous_store(f"tcp://{addr}", READ_TIMEOUT_S))
    return progress


def enter_step(state: Any, step: str) -> None:
    progress = pass_progress(state)
    if progress is not None:
        progress.now_in(step)


def read_reports(store: KeyValueStore, ranks: Iterable[int]) -> list[dict[str, Any]]:
    """The reports the schedulers of ``ranks`` published (ranks that never did are left out)."""
    reports = []
    for rank in ranks:
        key = report_key(rank)
        if store.check([key]):
            reports.append(json.loads(store.get(key).decode()))
    return reports


def describe_reports(reports: Sequence[dict[str, Any]], ranks: Iterable[int],
                     now: float) -> str:
    """One phrase per rank: its step, for how long, the token counts its last gather took,
    and how old the report is."""
    by_rank = {int(r["rank"]): r for r in reports}
    parts = []
    for rank in ranks:
        report = by_rank.get(rank)
        if report is None:
            parts.append(f"rank {rank}: none")
            continue
        tokens = report.get("tokens")
        gathered = "" if tokens is None else f", its last gather's tokens {tokens}"
        parts.append(f"rank {rank}: in {report['step']} for {now - report['since']:.1f} s "
                     f"(pass {report['passes']}{gathered}), reported "
                     f"{now - report['at']:.1f} s ago")
    return "; ".join(parts)

"""What the under-load scenarios share: the tiny-model CPU cluster, a steady client load on it,
the run's named moments on one clock, the figures taken from them (seconds between moments,
the longest gap between completed requests in a window), and the waits their steps need."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from sglang_elastic_ep_testbed.cluster import (
    ClusterSpec,
    LoadClient,
    LocalCluster,
    RequestResult,
    ServerProcess,
)
from sglang_elastic_ep_testbed.cluster.load import longest_gap
from sglang_elastic_ep_testbed.cluster.observe import post_scale, wait_operation
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model

# A server's log stamp with ``SGLANG_LOG_MS=1`` (local time, as its log writes it).
LOG_MS_TIME = "%Y-%m-%d %H:%M:%S.%f"

# The first completions come a while after the load starts; a steady window that opens with the
# load starts this much later, so that wait does not count as a gap in serving.
WARM_UP_S = 2.0

Window = tuple[str, str]  # from moment, to moment

REPLICATED = ("--ep-num-redundant-experts", "16")  # 2 launch ranks: every expert on both


def tiny_spec(
    ep_size: int = 2,
    *,
    nodes: int = 1,
    extra_args: Sequence[str] = (),
    a2a: str = "nixl",
    max_ep_size: int | None = 4,
) -> ClusterSpec:
    """The tiny model on ``ep_size`` CPU ranks; by default NIXL EP with room to grow to 4."""
    return ClusterSpec(
        write_tiny_model(DEFAULT_DIR), ep_size=ep_size, max_ep_size=max_ep_size,
        moe_a2a_backend=a2a, nodes=nodes, extra_args=list(extra_args),
    )


class Timeline:
    """One run under load: named moments (``time.monotonic``), and the load's results once it
    stopped. Starts with ``warm``: ``WARM_UP_S`` after the load started."""

    def __init__(self, cluster: LocalCluster, load: LoadClient) -> None:
        self.cluster = cluster
        self.url = cluster.url
        self.load = load
        self.results: list[RequestResult] = []
        self.marks: dict[str, float] = {"warm": time.monotonic() + WARM_UP_S}

    def mark(self, name: str) -> float:
        self.marks[name] = time.monotonic()
        return self.marks[name]

    def hold(self, seconds: float, then: str | None = None) -> None:
        """Let the load run ``seconds`` untouched; then mark ``then``."""
        time.sleep(seconds)
        if then is not None:
            self.mark(then)

    def completed(self) -> int:
        """Requests finished so far (the load still running)."""
        return len(self.load.snapshot())

    def scale(self, size: int, operation_id: str, timeout_s: float) -> None:
        """Mark ``post``, POST the scale to ``size``, mark ``committed`` once it succeeded."""
        self.mark("post")
        post_scale(self.url, size, operation_id)
        operation_succeeded(self.url, operation_id, timeout_s)
        self.mark("committed")

    def figures(
        self, spans: Mapping[str, Window], gaps: Mapping[str, Window]
    ) -> dict[str, float]:
        """After the load stopped: seconds from moment to moment for each of ``spans``, the
        longest gap between successful completions in each of ``gaps``, then how many requests
        finished (``requests``) and how many of those failed (``failed``)."""
        out = {name: self.marks[end] - self.marks[start] for name, (start, end) in spans.items()}
        for name, (start, end) in gaps.items():
            out[name] = longest_gap(self.results, self.marks[start], self.marks[end])
        out["requests"] = float(len(self.results))
        out["failed"] = float(sum(not r.ok for r in self.results))
        return out


@contextmanager
def under_load(cluster: LocalCluster) -> Iterator[Timeline]:
    """2 clients sending 8-token greedy requests back to back (what every section's set-up
    says) for the block; the load is stopped and its results kept on the way out, also when a
    step raised."""
    load = LoadClient(cluster.url, concurrency=2, max_new_tokens=8).start()
    timeline = Timeline(cluster, load)
    try:
        yield timeline
    finally:
        timeline.results = load.stop()


def operation_succeeded(url: str, operation_id: str, timeout_s: float) -> dict:
    """Wait for ``operation_id`` to finish; its status entry, or raise unless it succeeded."""
    operation = wait_operation(url, operation_id, timeout_s)
    if operation["result"] != "succeeded":
        raise RuntimeError(f"operation {operation_id} failed: {operation}")
    return operation


def grow_by_joiner(
    cluster: LocalCluster, operation_id: str, timeout_s: float = 420
) -> ServerProcess:
    """Scale the launch ranks up by one: a joiner for the next rank, the POST, its success; the
    joiner's server."""
    size = cluster.spec.ep_size
    joiner = cluster.start_joiner("scale", rank_offset=size)
    post_scale(cluster.url, size + 1, operation_id)
    operation_succeeded(cluster.url, operation_id, timeout_s)
    return joiner


def logged(server: ServerProcess, text: str, timeout_s: float) -> None:
    """Wait until ``server``'s log has ``text`` (polled often: the moment is a measured
    figure)."""
    wait_until(lambda: text in server.log_path.read_text(errors="replace"),
               timeout_s, f"{text!r} in {server.log_path}", poll_s=0.2)


def weights_loaded(server: ServerProcess, timeout_s: float) -> None:
    """Wait until ``server``'s scheduler logged that it finished loading its weights."""
    logged(server, "Load weight end", timeout_s)

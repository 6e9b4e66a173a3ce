"""Mounts the orchestrator contract on SGLang's FastAPI app (HTTP server process only).

The control plane (operation ids, status, events, health) is built here; the engine beneath is
SGLang's own tokenizer -> scheduler path (``upstream_engine``). Mounting builds the process's
one ``HttpAdapterState`` and keeps it on the tokenizer manager, where the tokenizer hooks find
it (``tokenizer_hooks``), and starts the background pollers (``background_pollers``).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.core.health import HealthConfig
from sglang_elastic_ep.core.stall import mooncake_count_out_s
from sglang_elastic_ep.core.validation import ScaleTopology
from sglang_elastic_ep.sglang.args import declared_max_ep_size
from sglang_elastic_ep.sglang.background_pollers import (
    ExpertHealthPoller,
    StallWatch,
    start_metrics_refresher,
    start_refill_deadline_watch,
)
from sglang_elastic_ep.sglang.http_state import (
    HttpAdapterState,
    adapter_state,
    attach_adapter_state,
)
from sglang_elastic_ep.sglang.upstream_engine import UpstreamEngine

logger = logging.getLogger(__name__)


def topology_from_args(
    server_args: Any, replica_size: int | None = None
) -> tuple[ScaleTopology, int]:
    """(topology, launch EP size): with DP attention one EP rank per TP rank, split evenly
    over ``--nnodes`` launch servers.

    ``replica_size`` is the tokenizer manager's own ``attn_replica_size`` (attn TP x attn CP,
    what upstream's scale validation uses) when known: the HTTP process's server args do not
    always carry the resolved attention-DP degree (seen: 2-rank DP attention read as one
    2-rank replica, refusing 2 -> 3)."""
    ep_size = int(server_args.tp_size)
    if replica_size is None:
        # 0.5.23 keeps the attention-DP degree in attn_dp_size (--dp is a deprecated alias).
        attn_dp = int(getattr(server_args, "attn_dp_size", None) or server_args.dp_size or 1)
        replica_size = max(1, ep_size // attn_dp)
    replica = int(replica_size)
    max_ep = int(declared_max_ep_size(server_args) or ep_size)
    nnodes = max(1, int(getattr(server_args, "nnodes", 1) or 1))
    return ScaleTopology(max_ep_size=max_ep, attn_replica_size=replica, launch_size=ep_size,
                         ranks_per_node=max(1, ep_size // nnodes)), ep_size


def mount_on_server(result: Any, global_state: Any) -> None:
    """AFTER ``http_server.set_global_state``: build the control plane and mount the routes."""
    tm = global_state.tokenizer_manager
    server_args = tm.server_args
    if getattr(server_args, "elastic_ep_backend", None) is None \
            or adapter_state(tm) is not None:
        return
    from sglang.srt.entrypoints import http_server

    from sglang_elastic_ep.api.routes import mount_elastic_ep

    topology, ep_size = topology_from_args(server_args, getattr(tm, "attn_replica_size", None))
    metrics = None
    if getattr(server_args, "enable_metrics", False):
        from sglang_elastic_ep.api.metrics import ElasticEPMetrics

        metrics = ElasticEPMetrics()
    adapter = HttpAdapterState()
    engine = UpstreamEngine(tm, adapter)
    plane = InProcessControlPlane(
        topology=topology, initial_ep_size=ep_size, engine=engine, canceller=engine.cancel,
        metrics=metrics,
        health_config=HealthConfig(
            latency_threshold=float(getattr(server_args, "elastic_ep_slow_expert_threshold",
                                            3.0)),
            persistence_threshold=int(getattr(server_args, "elastic_ep_slow_expert_checks", 10)),
        ),
        # Upstream's bound on a pending scale (0: none) bounds a refill too.
        refill_timeout_s=float(getattr(server_args, "elastic_ep_scale_timeout", 0) or 0) or None,
    )
    adapter.plane = plane
    if metrics is not None:
        start_metrics_refresher(plane)
    start_refill_deadline_watch(plane)
    stall_timeout = float(getattr(server_args, "elastic_ep_stall_timeout", 60.0))
    if stall_timeout > 0:
        count_out_s = mooncake_count_out_s(
            getattr(server_args, "elastic_ep_collective_timeout", None),
            getattr(server_args, "elastic_ep_fault_window", None))
        StallWatch(tm, plane, stall_timeout, count_out_s).start(min(1.0, stall_timeout / 4))
    interval = float(getattr(server_args, "elastic_ep_health_interval", 2.0))
    if interval > 0:
        ExpertHealthPoller(tm, plane).start(interval)
    mount_elastic_ep(
        http_server.app,
        plane,
        api_key=getattr(server_args, "api_key", None),
        admin_api_key=getattr(server_args, "admin_api_key", None),
    )
    url = getattr(server_args, "elastic_ep_webhook_url", None)
    if url:
        from sglang_elastic_ep.api.webhook import WebhookSender

        WebhookSender(plane.events, url).start()
    # Last: the tokenizer hooks start acting only once the routes are up.
    attach_adapter_state(tm, adapter)
    logger.info(
        "elastic EP API mounted: instance %s, ep size %d (max %d)",
        plane.instance_id, ep_size, topology.max_ep_size,
    )

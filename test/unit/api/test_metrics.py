"""Prometheus metrics: values, once-only counting, and visibility on SGLang's /metrics."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from eep_api_helpers import UP_PHASES, Clock, FakeEngine, make_plane
from prometheus_client import CollectorRegistry

from sglang_elastic_ep.api.metrics import ElasticEPMetrics
from sglang_elastic_ep.core.api_models import ScaleRequest

P = "sglang:elastic_ep_"
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(P + name, labels or None)


async def scale(plane, target: int, op: str):
    return await plane.request_scale(ScaleRequest(new_ep_size=target, operation_id=op))


@pytest.mark.anyio
async def test_control_plane_keeps_gauges_and_counters_current(
    registry: CollectorRegistry,
) -> None:
    clock = Clock(100.0)
    mono = Clock(0.0)
    metrics = ElasticEPMetrics(registry, clock=mono)
    plane = make_plane(engine=FakeEngine(), initial=2, clock=clock, metrics=metrics)
    assert value(registry, "effective_size") == 2
    assert value(registry, "max_size") == 8
    assert value(registry, "active_ranks") == 2
    assert value(registry, "operation_running") == 0

    await scale(plane, 4, "up")
    assert value(registry, "operation_running") == 1
    for i, phase in enumerate(UP_PHASES, start=1):
        clock.t = 100.0 + i
        plane.record_phase("up", phase)
    clock.t = 110.0
    plane.finish_operation("up")
    assert value(registry, "effective_size") == 4
    assert value(registry, "active_ranks") == 4
    assert value(registry, "operation_running") == 0
    assert value(registry, "operations_total", kind="scale_up", result="succeeded") == 1
    # waiting_for_cohort 100->101, then 1 s per phase, syncing_new_world 104->110.
    assert value(registry, "phase_duration_seconds_sum", kind="scale_up",
                 phase="waiting_for_cohort") == 1.0
    assert value(registry, "phase_duration_seconds_sum", kind="scale_up",
                 phase="syncing_new_world") == 6.0
    assert value(registry, "phase_duration_seconds_count", kind="scale_up",
                 phase="serving_expanded") is None  # the terminal phase has no duration

    await scale(plane, 2, "down")
    assert value(registry, "active_ranks") == 4  # leaving ranks still serve until released
    plane.finish_operation("down", error="drain timed out")
    assert value(registry, "operations_total", kind="scale_down", result="failed") == 1
    assert value(registry, "effective_size") == 4


@pytest.mark.anyio
async def test_degraded_seconds_accrue_only_while_a_rank_is_failed(
    registry: CollectorRegistry,
) -> None:
    mono = Clock(0.0)
    metrics = ElasticEPMetrics(registry, clock=mono)
    plane = make_plane(engine=FakeEngine(), initial=4, metrics=metrics)
    mono.t = 50.0
    plane.refresh_metrics()
    assert value(registry, "degraded_seconds_total") == 0
    plane.report_rank_failed([3], "heartbeat lost")  # degraded from t=50
    assert value(registry, "failed_ranks") == 1
    assert value(registry, "active_ranks") == 3
    mono.t = 57.5
    plane.refresh_metrics()
    assert value(registry, "degraded_seconds_total") == 7.5
    mono.t = 60.0
    plane.report_rank_recovered([3])  # accrues up to 60, then stops
    mono.t = 100.0
    plane.refresh_metrics()
    assert value(registry, "degraded_seconds_total") == 10.0
    assert value(registry, "failed_ranks") == 0


def test_the_stall_gauge_follows_the_stall_watch_and_returns_to_0(
    registry: CollectorRegistry,
) -> None:
    clock = Clock(1000.0)
    plane = make_plane(engine=FakeEngine(), initial=2, clock=clock,
                       metrics=ElasticEPMetrics(registry))
    assert value(registry, "stalled_seconds") == 0
    clock.t = 1075.0
    plane.observe_stall(1000.0, waiting_requests=3)
    assert value(registry, "stalled_seconds") == 75.0
    clock.t = 1090.0
    plane.observe_stall(1000.0, waiting_requests=3)
    assert value(registry, "stalled_seconds") == 90.0
    plane.observe_stall(None, waiting_requests=0)  # the schedulers answered again
    assert value(registry, "stalled_seconds") == 0


@pytest.mark.anyio
async def test_each_operation_is_counted_once(registry: CollectorRegistry) -> None:
    metrics = ElasticEPMetrics(registry)
    plane = make_plane(engine=FakeEngine(), metrics=metrics)
    await scale(plane, 4, "once")
    assert not metrics.observe_operation(plane.status().current_operation)  # running: no
    plane.finish_operation("once")
    finished = plane.status().recent_operations[0]
    assert not metrics.observe_operation(finished)  # already counted by finish_operation
    assert value(registry, "operations_total", kind="scale_up", result="succeeded") == 1
    assert value(registry, "phase_duration_seconds_count", kind="scale_up",
                 phase="waiting_for_cohort") == 1


def test_importing_the_adapters_does_not_import_prometheus_client() -> None:
    # prometheus_client picks its multiprocess value class at import: importing it before
    # SGLang sets PROMETHEUS_MULTIPROC_DIR would hide every metric from /metrics.
    code = (
        "import sys\n"
        "import sglang_elastic_ep.api.routes, sglang_elastic_ep.api.webhook\n"
        "import sglang_elastic_ep.api.metrics, sglang_elastic_ep.cli.main\n"
        "print(sorted(m for m in ('prometheus_client', 'sglang', 'torch') if m in sys.modules))"
    )
    # Without the CPU engine: its interpreter-start bootstrap (a .pth line) imports torch.
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO, env=env)
    assert out.stdout.strip() == "[]"


def test_metrics_show_on_sglangs_multiprocess_metrics_endpoint(tmp_path: Path) -> None:
    """In a fresh process set up like SGLang's HTTP server: our values reach /metrics."""
    script = textwrap.dedent(
        f"""
        import asyncio, os
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        from sglang_elastic_ep.api.control_plane import InProcessControlPlane
        from sglang_elastic_ep.api.metrics import get_metrics
        from sglang_elastic_ep.core.api_models import ScaleRequest
        from sglang_elastic_ep.core.validation import ScaleTopology

        plane = InProcessControlPlane(topology=ScaleTopology(max_ep_size=8),
                                      initial_ep_size=2, metrics=get_metrics())
        asyncio.run(plane.request_scale(ScaleRequest(new_ep_size=4, operation_id="m")))
        plane.finish_operation("m")

        from fastapi import FastAPI
        from fastapi.testclient import TestClient
        try:
            from sglang.srt.utils.common import add_prometheus_middleware
            print("# exposed by sglang.srt.utils.common.add_prometheus_middleware")
        except ImportError:
            # Same three lines as sglang.srt.utils.common.add_prometheus_middleware.
            from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess
            from starlette.routing import Mount
            def add_prometheus_middleware(app):
                registry = CollectorRegistry()
                multiprocess.MultiProcessCollector(registry)
                app.routes.append(Mount("/metrics", make_asgi_app(registry=registry)))
        app = FastAPI()
        add_prometheus_middleware(app)
        print(TestClient(app).get("/metrics").text)
        """
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = set(out.stdout.splitlines())
    if importlib.util.find_spec("sglang") is not None:
        assert "# exposed by sglang.srt.utils.common.add_prometheus_middleware" in lines
    assert f"{P}effective_size 4.0" in lines
    assert f"{P}active_ranks 4.0" in lines
    assert f'{P}operations_total{{kind="scale_up",result="succeeded"}} 1.0' in lines
    assert any(line.startswith(f"{P}phase_duration_seconds_bucket{{") for line in lines)
    assert f"{P}degraded_seconds_total 0.0" in lines


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


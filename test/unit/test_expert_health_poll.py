"""The HTTP process's expert-latency health check against a fake tokenizer manager."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.core.health import HealthConfig
from sglang_elastic_ep.core.validation import ScaleTopology
from sglang_elastic_ep.sglang.background_pollers import ExpertHealthPoller
from sglang_elastic_ep.sglang.expert_health import BLOCKED_RANKS_KEY, REPORT_KEY

FAST_NS, SLOW_NS = 100_000, 3_000_000


pytestmark = pytest.mark.usefixtures("fake_io_struct")


class FakeTokenizerManager:
    """Rank 0's internal state carries the gathered timings of 3 ranks x 2 slots."""

    def __init__(self, p2l: list[int]) -> None:
        self.report = {
            "local_slots": 2,
            "ns_per_row": [FAST_NS] * 4 + [SLOW_NS] * 2,  # rank 2's experts are slow
            "rows": [8] * 6,
            "physical_to_logical": p2l,
            "blocked_ranks_mask": 0,
        }
        self.sent: list[dict] = []

    async def get_internal_state(self) -> list[dict]:
        return [{"other": 1, REPORT_KEY: dict(self.report)}]

    async def set_internal_state(self, obj: object) -> list[bool]:
        self.sent.append(dict(obj.server_args))
        self.report["blocked_ranks_mask"] = obj.server_args[BLOCKED_RANKS_KEY]
        return [True]


def _plane(checks: int) -> InProcessControlPlane:
    return InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=3,
        health_config=HealthConfig(persistence_threshold=checks),
    )


def _poll(tm: FakeTokenizerManager, plane: InProcessControlPlane, times: int) -> None:
    poller = ExpertHealthPoller(tm, plane)

    async def run() -> None:
        for _ in range(times):
            await poller.poll()

    asyncio.run(run())


def test_a_persistently_slow_rank_is_reported_then_blocked_once() -> None:
    plane = _plane(checks=3)
    tm = FakeTokenizerManager(p2l=[0, 1, 0, 1, 0, 1])
    _poll(tm, plane, 2)
    health = plane.health()
    assert [e.healthy for e in health.experts] == [True] * 4 + [False] * 2
    assert health.ranks[2].consecutive_unhealthy_checks == 2 and not health.ranks[2].hard_blocked
    assert tm.sent == []
    _poll(tm, plane, 3)  # the third slow check blocks it; later checks send nothing again
    assert plane.health().ranks[2].hard_blocked is True
    assert plane.health().ranks[2].alive is True
    assert tm.sent == [{BLOCKED_RANKS_KEY: 0b100}]
    assert [r.experts for r in plane.status().ranks] == [[0, 1], [0, 1], [0, 1], None]
    events = [e for e in plane.events.since(0).events if e.type == "recovery_required"]
    assert [e.ranks for e in events] == [[2]]
    assert "slow experts" in events[0].reason


def test_a_slow_rank_with_the_last_replica_is_reported_but_not_blocked() -> None:
    plane = _plane(checks=1)
    tm = FakeTokenizerManager(p2l=[0, 1, 0, 1, 2, 3])
    _poll(tm, plane, 2)
    assert plane.health().ranks[2].hard_blocked is True  # the orchestrator hears of it
    assert tm.sent == []  # but tokens keep going there: experts 2, 3 live nowhere else


def test_no_report_means_no_check() -> None:
    plane = _plane(checks=1)
    tm = SimpleNamespace(get_internal_state=lambda: _async([{"x": 1}]))
    asyncio.run(ExpertHealthPoller(tm, plane).poll())
    assert plane.health().checks == 0


async def _async(value: object) -> object:
    return value

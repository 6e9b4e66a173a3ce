"""Per-expert timing on the CPU engine and the blocked-rank mask of the expert dispatch."""

from __future__ import annotations

import pytest
import torch

from sglang_elastic_ep.sglang.expert_timing import ExpertTimer, slowdown_for
from sglang_elastic_ep_testbed.nixl_cpu.moe_runner import run_packed_experts


def test_timer_keeps_a_moving_average_per_row_and_counts_rows() -> None:
    timer = ExpertTimer()
    timer.record(1, rows=4, seconds=0.004)  # 1 ms per row
    assert timer.snapshot(3) == ([0, 1_000_000, 0], [0, 4, 0])
    timer.record(1, rows=1, seconds=0.006)  # 6 ms per row: 0.8 * 1 + 0.2 * 6 = 2 ms
    ns, rows = timer.snapshot(2)
    assert ns[1] == pytest.approx(2_000_000, rel=1e-6) and rows == [0, 5]


def test_injected_slowdown_really_takes_longer() -> None:
    timer = ExpertTimer(slowdown=3.0)
    timer.record(0, rows=1, seconds=0.01)  # sleeps the other 0.02 s
    assert timer.snapshot(1)[0][0] == pytest.approx(30_000_000, rel=1e-6)


@pytest.mark.parametrize("spec, rank, factor", [
    (None, 0, 1.0), ("2:20", 2, 20.0), ("2:20", 1, 1.0), ("0:1.5", 0, 1.5),
])
def test_slowdown_spec(spec: str | None, rank: int, factor: float) -> None:
    assert slowdown_for(spec, rank) == factor


def test_slowdown_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="factor must be >= 1"):
        slowdown_for("0:0.5", 0)


def test_runner_reports_each_expert_that_had_rows() -> None:
    torch.manual_seed(0)
    e, m, hidden, inter = 3, 4, 8, 4
    calls: list[tuple[int, int]] = []
    run_packed_experts(
        torch.randn(e, m, hidden), torch.tensor([2, 0, 4]),
        torch.randn(e, 2 * inter, hidden), torch.randn(e, hidden, inter),
        on_expert_done=lambda expert, rows, seconds: calls.append((expert, rows)),
    )
    assert calls == [(0, 2), (2, 4)]


def test_blocked_ranks_are_cleared_from_the_routing_mask() -> None:
    from sglang_elastic_ep.sglang.expert_health import ExpertHealthState

    active = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    health = ExpertHealthState()
    assert health.routable_ranks(active) is active  # nothing blocked: no extra op
    assert health.block(0b0100) and not health.block(0b0100)  # a repeat changes nothing
    assert health.routable_ranks(active).tolist() == [1, 1, 0, 0]
    assert health.blocked_ranks() == [2]
    assert health.block(0) and health.routable_ranks(active) is active


def test_one_expert_health_state_per_elastic_ep_state() -> None:
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang.expert_health import expert_health_state

    state = SimpleNamespace()
    assert expert_health_state(state) is expert_health_state(state)
    assert expert_health_state(SimpleNamespace()) is not expert_health_state(state)

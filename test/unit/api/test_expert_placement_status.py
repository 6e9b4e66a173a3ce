"""The status shows each rank's experts only from a report that describes the current size."""

from __future__ import annotations

import asyncio

from eep_api_helpers import AutoEngine, make_plane

from sglang_elastic_ep.core.api_models import ScaleRequest
from sglang_elastic_ep_testbed.cluster.waits import wait_until


def experts(plane) -> list[list[int] | None]:  # noqa: ANN001
    return [r.experts for r in plane.status().ranks]


def test_a_report_for_another_size_is_stale_until_the_engine_reports_again() -> None:
    engine = AutoEngine(step_s=0.0)
    plane = make_plane(max_ep_size=4, initial=3, engine=engine)
    plane.report_expert_placement({0: [0, 1], 1: [2, 3], 2: [0, 3]})
    assert experts(plane) == [[0, 1], [2, 3], [0, 3], None]

    async def shrink() -> None:
        await plane.request_scale(ScaleRequest(new_ep_size=1, operation_id="to-1"))
        # Polled from a thread: the engine walks the operation on this loop meanwhile.
        await asyncio.to_thread(wait_until, lambda: plane.status().current_operation is None,
                                60, "the shrink finished", 0.01)

    asyncio.run(shrink())
    assert plane.status().effective_ep_size == 1
    assert experts(plane) == [None, None, None, None]  # the 3-rank report no longer holds
    plane.report_expert_placement({0: [0, 1, 2, 3]})
    assert experts(plane) == [[0, 1, 2, 3], None, None, None]

"""A stall shows in the status and the health report, with the phase it happened in, and
clears when the schedulers answer again."""

from __future__ import annotations

import pytest
from eep_api_helpers import Clock, FakeEngine, make_app, make_plane
from fastapi.testclient import TestClient


def test_a_stall_is_reported_with_its_phase_and_cleared() -> None:
    clock = Clock(1000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock)
    client = TestClient(make_app(plane))
    client.post("/scale_elastic_ep", json={"new_ep_size": 3, "operation_id": "grow"})
    assert client.get("/elastic_ep/status").json()["stalled"] is None
    clock.t = 1075.0
    plane.observe_stall(1000.0, waiting_requests=4)
    status = client.get("/elastic_ep/status").json()
    stalled = status["stalled"]
    assert stalled["since"] == 1000.0 and stalled["stalled_s"] == 75.0
    assert stalled["waiting_requests"] == 4 and stalled["phase"] == "waiting_for_cohort"
    assert "no scheduler has answered for 75 s" in stalled["message"]
    assert client.get("/elastic_ep/health").json()["stalled"]["waiting_requests"] == 4
    plane.observe_stall(None, waiting_requests=0)
    assert client.get("/elastic_ep/status").json()["stalled"] is None
    assert client.get("/elastic_ep/health").json()["stalled"] is None


def test_the_stall_watch_reads_the_tokenizers_table_and_last_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import background_pollers
    from sglang_elastic_ep.sglang.background_pollers import StallWatch

    now = [2000.0]
    monkeypatch.setattr(background_pollers.time, "time", lambda: now[0])
    clock = Clock(2000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock)
    tm = SimpleNamespace(rid_to_state={"a": object(), "b": object()}, last_receive_tstamp=1990.0)
    watch = StallWatch(tm, plane, threshold_s=5.0)
    watch.check()  # requests wait from now on
    assert plane.status().stalled is None
    now[0] = clock.t = 2006.0
    watch.check()
    stalled = plane.status().stalled
    assert stalled is not None and stalled.since == 2000.0 and stalled.waiting_requests == 2
    tm.last_receive_tstamp = 2006.5  # a scheduler answered
    now[0] = clock.t = 2007.0
    watch.check()
    assert plane.status().stalled is None


def test_a_stall_lists_where_each_scheduler_is() -> None:
    from sglang_elastic_ep.core.api_models import RankPosition

    clock = Clock(1000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock)
    client = TestClient(make_app(plane))
    positions = [RankPosition(rank=0, step="gather", in_step_s=70.0, passes=9, report_age_s=0.4),
                 RankPosition(rank=1, step="forward", in_step_s=70.0, passes=8, report_age_s=0.6)]
    clock.t = 1075.0
    plane.observe_stall(1000.0, waiting_requests=2, positions=positions)
    stalled = client.get("/elastic_ep/status").json()["stalled"]
    assert [(r["rank"], r["step"]) for r in stalled["ranks"]] == [(0, "gather"), (1, "forward")]
    assert "ranks [0] in step 'gather' for 70 s; ranks [1] in step 'forward'" in \
        stalled["message"]


def test_a_store_that_never_answers_leaves_the_positions_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 hosts the store; stopped, it accepts connections and never answers. The stall is
    still reported, without positions, and the watch does not wait on it."""
    import threading
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import background_pollers
    from sglang_elastic_ep.sglang.background_pollers import StallWatch

    release = threading.Event()

    class SilentStore:
        def check(self, keys: list[str]) -> bool:
            release.wait(30)
            return False

    monkeypatch.setattr(background_pollers, "READ_TIMEOUT_S", 0.2)
    monkeypatch.setattr(background_pollers, "rendezvous_store", lambda *a: SilentStore())
    plane = make_plane(engine=FakeEngine(), clock=Clock(0.0))
    tm = SimpleNamespace(rid_to_state={"a": object()}, last_receive_tstamp=None,
                         server_args=SimpleNamespace(dist_init_addr="127.0.0.1:1"))
    watch = StallWatch(tm, plane, threshold_s=5.0)
    try:
        assert watch.positions(100.0) == []
        assert watch.positions(101.0) == []  # the first read still hangs: no second one
    finally:
        release.set()

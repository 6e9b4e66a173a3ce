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


def test_an_idle_server_stuck_in_a_pass_is_reported_from_the_schedulers_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No request waits, so no answer is due; rank 0 sitting in the gather past the threshold
    is the stall. It clears once rank 0 rests again."""
    import json
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import background_pollers
    from sglang_elastic_ep.sglang.background_pollers import StallWatch
    from sglang_elastic_ep.sglang.pass_progress import report_key

    class Store:
        def __init__(self) -> None:
            self.reports: dict[str, bytes] = {}

        def publish(self, rank: int, step: str, since: float, at: float) -> None:
            report = {"rank": rank, "step": step, "since": since, "passes": 40, "at": at}
            self.reports[report_key(rank)] = json.dumps(report).encode()

        def check(self, keys: list[str]) -> bool:
            return all(k in self.reports for k in keys)

        def get(self, key: str) -> bytes:
            return self.reports[key]

    store = Store()
    now = [3000.0]
    monkeypatch.setattr(background_pollers.time, "time", lambda: now[0])
    monkeypatch.setattr(background_pollers, "rendezvous_store", lambda *a: store)
    clock = Clock(3000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock)
    client = TestClient(make_app(plane))
    tm = SimpleNamespace(rid_to_state={}, last_receive_tstamp=100.0,
                         server_args=SimpleNamespace(dist_init_addr="127.0.0.1:1"))
    watch = StallWatch(tm, plane, threshold_s=5.0)

    store.publish(0, "gather", since=2997.0, at=2999.5)
    store.publish(1, "idle", since=2000.0, at=2999.5)  # resting for long: not stuck
    watch.check()
    assert plane.status().stalled is None  # 3 s in the gather: below the threshold

    now[0] = clock.t = 3010.0
    store.publish(0, "gather", since=2997.0, at=3009.5)
    store.publish(1, "idle", since=2000.0, at=3009.5)
    watch.check()
    stalled = client.get("/elastic_ep/status").json()["stalled"]
    assert stalled is not None and stalled["since"] == 2997.0 and stalled["stalled_s"] == 13.0
    assert stalled["waiting_requests"] == 0
    assert "no request waits, but a scheduler has been in one step of a pass for 13 s" in \
        stalled["message"]
    assert "ranks [0] in step 'gather' for 13 s" in stalled["message"]
    assert client.get("/elastic_ep/health").json()["stalled"]["waiting_requests"] == 0

    now[0] = clock.t = 3011.0
    store.publish(0, "idle", since=3010.8, at=3010.9)
    watch.check()
    assert plane.status().stalled is None


def test_an_idle_server_whose_rank_died_in_a_gather_is_not_stalled_by_that_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead rank's last report stays in the store, in the gather it died in: stopped, which
    the failure handling covers, not a stuck scheduler."""
    import json
    from types import SimpleNamespace

    from sglang_elastic_ep.sglang import background_pollers
    from sglang_elastic_ep.sglang.background_pollers import StallWatch
    from sglang_elastic_ep.sglang.pass_progress import report_key

    reports = {report_key(1): json.dumps({"rank": 1, "step": "gather", "since": 3000.0,
                                          "passes": 9, "at": 3000.5}).encode()}
    store = SimpleNamespace(check=lambda keys: all(k in reports for k in keys),
                            get=lambda key: reports[key])
    monkeypatch.setattr(background_pollers.time, "time", lambda: 3100.0)
    monkeypatch.setattr(background_pollers, "rendezvous_store", lambda *a: store)
    plane = make_plane(engine=FakeEngine(), clock=Clock(3100.0))
    tm = SimpleNamespace(rid_to_state={}, last_receive_tstamp=100.0,
                         server_args=SimpleNamespace(dist_init_addr="127.0.0.1:1"))
    StallWatch(tm, plane, threshold_s=5.0).check()
    assert plane.status().stalled is None


def test_a_stall_names_the_ranks_to_relaunch_once_mooncake_counted_the_silent_one_out() -> None:
    """Rank 2 died and ranks 0 and 1 wait on each other in one collective: until Mooncake
    has counted rank 2 out, rank 2 is the one named; past that, rank 1 too (its end frees
    rank 0), and the message says to relaunch them, not to restart."""
    from sglang_elastic_ep.core.api_models import RankPosition

    clock = Clock(1000.0)
    plane = make_plane(engine=FakeEngine(), clock=clock, initial=3)
    client = TestClient(make_app(plane))
    positions = [RankPosition(rank=0, step="gather", in_step_s=61.0, passes=9, report_age_s=0.4),
                 RankPosition(rank=1, step="gather", in_step_s=61.0, passes=9, report_age_s=0.6),
                 RankPosition(rank=2, step="forward", in_step_s=70.0, passes=9,
                              report_age_s=61.0)]
    clock.t = 1061.0
    plane.observe_stall(1000.0, waiting_requests=2, positions=positions, count_out_s=67.0)
    early = client.get("/elastic_ep/status").json()["stalled"]
    assert early["ranks_to_relaunch"] == [2] and early["count_out_s"] == 67.0
    assert "end rank(s) [2]" in early["message"] and "restart" not in early["message"]
    clock.t = 1080.0
    plane.observe_stall(1000.0, waiting_requests=2, positions=positions, count_out_s=67.0)
    late = client.get("/elastic_ep/status").json()["stalled"]
    assert late["ranks_to_relaunch"] == [1, 2]
    assert "end rank(s) [1, 2]" in late["message"]
    assert "--ep-join-mode recover" in late["message"]

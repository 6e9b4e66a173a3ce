"""The wait for Mooncake to apply an admission's view before the next collective."""

from __future__ import annotations

from sglang_elastic_ep.sglang.world_view import wait_for_local_view


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_applied_view_costs_no_wait() -> None:
    clock = FakeClock()
    waited = wait_for_local_view(lambda: [1, 1, 1, 0], [2], clock=clock, sleep=clock.sleep)
    assert waited == 0.0


def test_waits_until_the_view_shows_every_admitted_rank() -> None:
    clock = FakeClock()
    views = iter([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    waited = wait_for_local_view(lambda: next(views), [3], poll_s=0.5, clock=clock,
                                 sleep=clock.sleep)
    assert waited == 1.0


def test_a_view_that_never_comes_times_out() -> None:
    clock = FakeClock()
    waited = wait_for_local_view(lambda: [1, 1, 0, 0], [2, 3], timeout_s=2.0, poll_s=0.5,
                                 clock=clock, sleep=clock.sleep)
    assert waited is None
    assert clock.now == 2.0


def test_a_rank_beyond_the_view_is_not_active() -> None:
    clock = FakeClock()
    assert wait_for_local_view(lambda: [1, 1], [2], timeout_s=0.0, clock=clock,
                               sleep=clock.sleep) is None

"""``run_every``: the loop every background check of the HTTP process runs on."""

from __future__ import annotations

import threading

from sglang_elastic_ep.sglang.background_pollers import run_every


def test_a_failing_step_is_retried_at_the_next_interval() -> None:
    calls: list[int] = []
    twice = threading.Event()

    def step() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("first check fails")
        twice.set()

    run_every(0.01, "test-run-every", "test step", step)
    assert twice.wait(timeout=30), calls
    assert calls[:2] == [0, 1]
    assert any(t.name == "test-run-every" and t.daemon for t in threading.enumerate())

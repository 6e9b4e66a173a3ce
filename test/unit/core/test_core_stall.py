"""The stall verdict: requests wait and no scheduler answered for longer than the threshold."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.stall import StallDetector


def test_waiting_requests_without_answers_stall_after_the_threshold() -> None:
    d = StallDetector(10.0)
    assert d.observe(100.0, 2, last_answer_at=99.0) is None  # waiting seen from 100 on
    assert d.observe(110.0, 2, last_answer_at=99.0) is None  # 10 s: not yet
    assert d.observe(110.5, 2, last_answer_at=99.0) == 100.0
    assert d.observe(111.0, 2, last_answer_at=110.8) is None  # an answer came: not stalled
    assert d.observe(121.0, 2, last_answer_at=110.8) == 110.8


def test_an_idle_server_with_an_old_last_answer_counts_from_when_requests_began_to_wait() -> None:
    d = StallDetector(10.0)
    assert d.observe(5000.0, 0, last_answer_at=1000.0) is None
    assert d.observe(5001.0, 1, last_answer_at=1000.0) is None
    assert d.observe(5010.0, 1, last_answer_at=1000.0) is None
    assert d.observe(5012.0, 1, last_answer_at=1000.0) == 5001.0
    # Nothing waits any more: the clock restarts with the next request.
    assert d.observe(5013.0, 0, last_answer_at=1000.0) is None
    assert d.observe(5014.0, 1, last_answer_at=1000.0) is None


def test_no_answer_ever_counts_from_the_first_wait() -> None:
    d = StallDetector(1.0)
    assert d.observe(10.0, 3, last_answer_at=None) is None
    assert d.observe(11.5, 3, last_answer_at=None) == 10.0


@pytest.mark.parametrize("threshold", [0.0, -1.0])
def test_a_threshold_must_be_positive(threshold: float) -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        StallDetector(threshold)

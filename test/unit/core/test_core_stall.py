"""The stall verdicts: requests wait and no scheduler answered for longer than the threshold; or
no request waits and a serving scheduler has sat in one step of a pass for that long."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.api_models import RankPosition
from sglang_elastic_ep.core.stall import (
    StallDetector,
    mooncake_count_out_s,
    ranks_to_end,
    stall_action,
    stuck_in_a_pass,
)


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


def _at(rank: int, step: str, in_step_s: float, report_age_s: float = 0.5,
        passes: int = 7) -> RankPosition:
    return RankPosition(rank=rank, step=step, in_step_s=in_step_s, passes=passes,
                        report_age_s=report_age_s)


def test_an_idle_server_is_stuck_when_a_live_serving_rank_outstays_the_threshold_in_a_pass(
) -> None:
    ranks = [0, 1, 2]
    # Resting between passes, however long, is not stuck; nor is a short step.
    assert stuck_in_a_pass([_at(0, "idle", 900.0), _at(1, "gather", 9.0)], ranks, 10.0) is None
    assert stuck_in_a_pass([_at(0, "starting", 900.0)], ranks, 10.0) is None
    # The longest-stuck rank gives the duration; a membership step counts like the gather.
    stuck = [_at(0, "gather", 42.0), _at(1, "scale-down to 2", 12.0), _at(2, "idle", 50.0)]
    assert stuck_in_a_pass(stuck, ranks, 10.0) == 42.0
    assert stuck_in_a_pass([_at(1, "forward", 11.0)], ranks, 10.0) == 11.0


def test_a_stopped_or_not_serving_rank_is_not_counted_as_stuck() -> None:
    # A dead rank's last report stays in the store: old, so it is stopped, not stuck.
    dead = _at(2, "gather", 300.0, report_age_s=290.0)
    assert stuck_in_a_pass([dead], [0, 1, 2], 10.0) is None
    # A rank outside the serving set (removed, released) is not looked at.
    assert stuck_in_a_pass([_at(3, "gather", 300.0)], [0, 1, 2], 10.0) is None


def test_the_rank_to_end_is_the_one_holding_the_others_up_when_an_orchestrator_owns_it() -> None:
    active = [0, 1, 2, 3]
    # One stopped reporting: it is the one (the others wait for it in the gather).
    stopped = [_at(0, "gather", 80.0), _at(1, "gather", 80.0), _at(2, "forward", 95.0, 30.0),
               _at(3, "gather", 80.0)]
    assert list(ranks_to_end(stopped, active, own_from=2)) == [2]
    assert "stopped reporting 30 s ago" in ranks_to_end(stopped, active, own_from=2)[2]
    # One a pass behind the rest.
    behind = [_at(0, "gather", 80.0, passes=9), _at(1, "gather", 80.0, passes=9),
              _at(2, "gather", 80.0, passes=9), _at(3, "gather", 81.0, passes=8)]
    assert list(ranks_to_end(behind, active, own_from=2)) == [3]
    assert "a pass behind" in ranks_to_end(behind, active, own_from=2)[3]
    # All in one step of one pass: each is named.
    together = [_at(r, "scale-up to 4", 70.0) for r in active]
    assert list(ranks_to_end(together, active, own_from=2)) == [2, 3]


def test_when_a_launch_time_rank_holds_the_others_up_the_highest_own_peer_is_ended() -> None:
    # Rank 0's collective never completes a pass behind; rank 2 waits for it in the next
    # one. Ending rank 2 frees rank 0's collective (its peer's liveness probe fails).
    stuck = [_at(0, "gather", 97.0, passes=40), _at(1, "gather", 97.0, passes=41),
             _at(2, "gather", 97.0, passes=41)]
    chosen = ranks_to_end(stuck, [0, 1, 2], own_from=2)
    assert list(chosen) == [2] and "waits with rank(s) [0]" in chosen[2]
    # No rank an orchestrator owns: the launch-time ones holding the others up are named.
    assert list(ranks_to_end(stuck, [0, 1, 2], own_from=3)) == [0]


def test_no_rank_to_end_without_positions_or_a_stuck_scheduler() -> None:
    assert ranks_to_end([], [0, 1, 2], own_from=2) == {}
    resting = [_at(0, "idle", 90.0), _at(1, "idle", 90.0), _at(2, "idle", 90.0)]
    assert ranks_to_end(resting, [0, 1, 2], own_from=2) == {}
    # A rank no longer active (failed, removed) is not ended again.
    gone = [_at(0, "gather", 90.0), _at(2, "forward", 95.0, 40.0)]
    assert list(ranks_to_end(gone, [0, 1], own_from=2)) == [0]


def test_mooncake_counts_a_silent_member_out_after_its_heartbeat_window_and_timeout() -> None:
    assert mooncake_count_out_s(None, None) == 30.0 + 30.0 + 10.0  # Mooncake's defaults
    assert mooncake_count_out_s(2.0, 35.0) == 67.0


def test_once_counted_out_the_live_ranks_waiting_on_each_other_are_the_ones_to_end() -> None:
    """Rank 2 died; ranks 0 and 1 sit in one collective of one pass, each waiting for a flag
    the other never writes (Mooncake counted their collective differently). Relaunching the
    dead rank frees nothing; ending rank 1 does."""
    stuck = [_at(0, "gather", 90.0), _at(1, "gather", 90.0), _at(2, "forward", 95.0, 90.0)]
    assert list(ranks_to_end(stuck, [0, 1, 2], own_from=1)) == [2]  # the silent one, first
    counted = ranks_to_end(stuck, [0, 1, 2], own_from=1, counted_out=True)
    assert list(counted) == [1, 2]
    assert "past the time Mooncake takes to count a silent member out" in counted[1]
    assert "stopped reporting 90 s ago" in counted[2]
    # An orchestrator that owns only rank 2 has no live rank of its own to end: the
    # launch-time ones are named with the silent one.
    assert list(ranks_to_end(stuck, [0, 1, 2], own_from=2, counted_out=True)) == [0, 1, 2]
    # A rank a pass ahead waits for the two: ending it frees them.
    ahead = [_at(0, "gather", 90.0, passes=7), _at(1, "gather", 90.0, passes=7),
             _at(2, "gather", 90.0, passes=8), _at(3, "forward", 95.0, 90.0)]
    chosen = ranks_to_end(ahead, [0, 1, 2, 3], own_from=2, counted_out=True)
    assert list(chosen) == [2, 3] and "waits with rank(s) [0, 1]" in chosen[2]


def test_the_stall_action_names_ranks_to_relaunch_and_a_restart_only_for_rank_0s_server(
) -> None:
    relaunch = stall_action({1: "stuck in step 'gather' for 90 s", 2: "stopped reporting"})
    assert "end rank(s) [1, 2]" in relaunch and "--ep-join-mode recover" in relaunch
    assert "restart" not in relaunch
    alone = stall_action({0: "stuck in step 'gather' for 90 s"})
    assert "restart the deployment: rank(s) [0]" in alone
    # Ranks 0 and 1 share rank 0's server: only a restart brings them back, and the dead
    # joiner is named beside them.
    shared = stall_action({0: "stuck", 1: "stuck", 2: "stopped reporting"}, first_apart=2)
    assert "restart the deployment: rank(s) [0, 1]" in shared
    assert "rank(s) [2] (rank 2 stopped reporting) need a relaunch as well" in shared
    assert "restart the deployment" in stall_action({})

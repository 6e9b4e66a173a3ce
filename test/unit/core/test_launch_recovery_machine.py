"""A survivor's side of taking back failed launch-time ranks after a scale: every phase, a
rejoin Mooncake went back on, the dead process still reported, a second failure meanwhile."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.core.launch_recovery_machine import LaunchRecoveryMachine, ReplacementMachine
from sglang_elastic_ep.core.phases import IllegalTransition, Phase


def test_waits_for_the_replacement_then_rejoins_on_the_agreed_pass() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    assert machine.phase is Phase.SERVING_DEGRADED
    assert machine.replacements_ready([False]) is False  # the dead process is gone
    assert machine.replacements_ready([True]) is True  # its replacement registered
    machine.entered(5.0)
    assert machine.phase is Phase.REJOINING
    assert machine.replacements_ready([True]) is False  # not ready twice for one rejoin
    machine.rejoined(5.5)
    assert machine.phase is Phase.SERVING_RECOVERED and machine.done
    assert [s.phase for s in machine.phase_stamps] == [
        Phase.SERVING_DEGRADED, Phase.REJOINING, Phase.SERVING_RECOVERED]


def test_the_dead_process_still_reported_does_not_count_as_its_replacement() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    assert machine.replacements_ready([True]) is False  # the pass right after the kill


def test_a_rejoin_mooncake_went_back_on_waits_for_the_next_replacement() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    machine.replacements_ready([False])
    machine.replacements_ready([True])
    machine.entered(1.0)
    machine.rejoin_failed(1.1)
    assert machine.phase is Phase.SERVING_DEGRADED and not machine.done
    assert machine.replacements_ready([False]) is False
    assert machine.replacements_ready([True]) is True


def test_a_rejoin_a_survivor_left_is_entered_again_with_the_same_replacement() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    machine.replacements_ready([False])
    machine.replacements_ready([True])
    machine.entered(1.0)
    machine.rejoin_failed(21.0)  # a survivor never reached the change: none was made
    assert machine.phase is Phase.SERVING_DEGRADED and not machine.done
    assert machine.replacements_ready([True]) is True  # no second "gone" needed
    machine.entered(21.5)
    machine.rejoined(22.0)
    assert machine.phase is Phase.SERVING_RECOVERED


def test_a_second_failure_keeps_what_was_seen_of_the_first() -> None:
    first = LaunchRecoveryMachine((1,), started_at=0.0)
    first.replacements_ready([False])
    assert first.following((1,), 1.0) is first  # the same failed set: the same machine
    second = first.following((1, 2), 2.0)
    assert second is not first and second.started_at == 2.0
    assert second.replacements_ready([True, True]) is False  # rank 2 never read gone
    assert second.replacements_ready([True, False]) is False
    assert second.seen_gone == {1, 2}
    assert second.replacements_ready([True, True]) is True


def test_a_later_failure_of_a_rejoined_rank_starts_over() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    machine.replacements_ready([False])
    machine.replacements_ready([True])
    machine.entered(1.0)
    machine.rejoined(1.5)
    again = machine.following((1,), 9.0)
    assert again is not machine and again.phase is Phase.SERVING_DEGRADED
    assert again.replacements_ready([True]) is False  # the dead process, still reported


def test_a_rejoin_is_entered_only_from_serving_degraded() -> None:
    machine = LaunchRecoveryMachine((1,), started_at=0.0)
    with pytest.raises(IllegalTransition):
        machine.rejoined(1.0)
    with pytest.raises(IllegalTransition):
        machine.rejoin_failed(1.0)


@pytest.mark.parametrize("ranks", [(), (-1,), (1, 1)])
def test_bad_failed_sets_are_refused(ranks: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="distinct EP ranks"):
        LaunchRecoveryMachine(ranks, started_at=0.0)


def test_peer_state_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="peer state of 2 ranks"):
        LaunchRecoveryMachine((1,), started_at=0.0).replacements_ready([True, True])


# ------------------------------------------------------------------- the replacement's side


def test_a_replacement_rejoins_restores_its_experts_and_serves() -> None:
    machine = ReplacementMachine(1, started_at=0.0)
    assert machine.phase is Phase.REJOINING
    machine.taken_back(4.0)
    assert machine.phase is Phase.RESTORING_EXPERTS
    machine.serving(4.5)
    assert machine.phase is Phase.SERVING_RECOVERED and machine.done
    assert machine.seconds_in_phases() == {Phase.REJOINING: 4.0, Phase.RESTORING_EXPERTS: 0.5}


@pytest.mark.parametrize("steps", [0, 1])
def test_a_replacement_step_that_raises_ends_it_failed(steps: int) -> None:
    machine = ReplacementMachine(1, started_at=0.0)
    if steps:
        machine.taken_back(1.0)
    machine.fail("RuntimeError: reload failed", 2.0)
    assert machine.phase is Phase.FAILED and machine.error == "RuntimeError: reload failed"


def test_a_replacement_cannot_serve_before_it_is_taken_back() -> None:
    with pytest.raises(IllegalTransition):
        ReplacementMachine(1, started_at=0.0).serving(1.0)
    with pytest.raises(ValueError, match="EP rank >= 0"):
        ReplacementMachine(-1, started_at=0.0)

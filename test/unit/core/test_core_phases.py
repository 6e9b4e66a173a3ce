import pytest

from sglang_elastic_ep.core.phases import (
    INITIAL_PHASE,
    TERMINAL_PHASES,
    TRANSITIONS,
    IllegalTransition,
    Phase,
    PhaseTracker,
    Role,
)


def test_tracker_records_a_timestamp_per_phase() -> None:
    t = PhaseTracker(Role.SCALE_DOWN_STAYING, now=1.0)
    t.advance(Phase.MOVING_EXPERTS, 2.0)
    t.advance(Phase.SWITCHING_PLACEMENT, 3.5)
    assert [(s.phase, s.at) for s in t.stamps] == [
        (Phase.DRAINING, 1.0),
        (Phase.MOVING_EXPERTS, 2.0),
        (Phase.SWITCHING_PLACEMENT, 3.5),
    ]
    assert t.entered_at == 3.5 and not t.is_terminal


def test_illegal_transition_names_the_allowed_ones() -> None:
    t = PhaseTracker(Role.SCALE_DOWN_STAYING, now=0.0)
    with pytest.raises(IllegalTransition, match="allowed next phases: failed, moving_experts"):
        t.advance(Phase.SERVING_CONTRACTED, 1.0)
    assert t.phase is Phase.DRAINING


def test_terminal_phases_have_no_way_out() -> None:
    t = PhaseTracker(Role.SCALE_DOWN_LEAVING, now=0.0)
    t.advance(Phase.FAILED, 1.0)
    assert t.is_terminal
    with pytest.raises(IllegalTransition, match="none \\(terminal\\)"):
        t.advance(Phase.DRAINING, 2.0)


def _reachable(role: Role) -> set[Phase]:
    table = TRANSITIONS[role]
    seen, frontier = set(), [INITIAL_PHASE[role]]
    while frontier:
        phase = frontier.pop()
        if phase in seen:
            continue
        seen.add(phase)
        frontier.extend(table.get(phase, ()))
    assert seen <= set(table) | TERMINAL_PHASES
    return seen


@pytest.mark.parametrize("role", [Role.SCALE_DOWN_STAYING, Role.SCALE_DOWN_LEAVING])
def test_a_scale_down_role_reaches_its_success_phase_and_can_fail_before_the_release(
    role: Role,
) -> None:
    assert Phase.FAILED in TRANSITIONS[role][INITIAL_PHASE[role]]
    success = Phase.RELEASED if role is Role.SCALE_DOWN_LEAVING else Phase.SERVING_CONTRACTED
    assert success in _reachable(role)


def test_a_survivor_ends_recovered_or_with_the_failed_slots_removed() -> None:
    reachable = _reachable(Role.RECOVERY_SURVIVOR)
    assert {Phase.SERVING_RECOVERED, Phase.SERVING_CONTRACTED} <= reachable
    assert Phase.FAILED not in reachable  # it serves degraded until one of the two


def test_upstream_phase_names_are_kept() -> None:
    upstream = {
        "idle",
        "waiting_for_cohort",
        "pending",
        "joining",
        "configuring_data_plane",
        "syncing_new_world",
        "serving_expanded",
        "failed",
    }
    assert upstream <= {p.value for p in Phase}

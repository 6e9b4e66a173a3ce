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


@pytest.mark.parametrize("role", list(Role))
def test_every_role_reaches_its_success_phase_and_can_fail_before_the_release(
    role: Role,
) -> None:
    table = TRANSITIONS[role]
    assert Phase.FAILED in table[INITIAL_PHASE[role]]
    seen, frontier = set(), [INITIAL_PHASE[role]]
    while frontier:
        phase = frontier.pop()
        if phase in seen:
            continue
        seen.add(phase)
        frontier.extend(table.get(phase, ()))
    success = Phase.RELEASED if role is Role.SCALE_DOWN_LEAVING else Phase.SERVING_CONTRACTED
    assert success in seen and seen <= set(table) | TERMINAL_PHASES


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

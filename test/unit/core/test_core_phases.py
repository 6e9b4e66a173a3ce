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
    t = PhaseTracker(Role.EXISTING_SCALE_UP, now=1.0)
    t.advance(Phase.PENDING, 2.0)
    t.advance(Phase.JOINING, 3.5)
    assert [(s.phase, s.at) for s in t.stamps] == [
        (Phase.WAITING_FOR_COHORT, 1.0),
        (Phase.PENDING, 2.0),
        (Phase.JOINING, 3.5),
    ]
    assert t.entered_at == 3.5 and not t.is_terminal


def test_illegal_transition_names_the_allowed_ones() -> None:
    t = PhaseTracker(Role.EXISTING_SCALE_UP, now=0.0)
    with pytest.raises(IllegalTransition, match="allowed next phases: failed, pending"):
        t.advance(Phase.SERVING_EXPANDED, 1.0)
    assert t.phase is Phase.WAITING_FOR_COHORT


def test_terminal_phases_have_no_way_out() -> None:
    t = PhaseTracker(Role.SCALE_DOWN_LEAVING, now=0.0)
    t.advance(Phase.FAILED, 1.0)
    assert t.is_terminal
    with pytest.raises(IllegalTransition, match="none \\(terminal\\)"):
        t.advance(Phase.DRAINING, 2.0)


@pytest.mark.parametrize("role", list(Role))
def test_every_role_can_reach_a_success_phase_and_fail_from_every_step(role: Role) -> None:
    table = TRANSITIONS[role]
    assert INITIAL_PHASE[role] in table
    for phase, targets in table.items():
        assert phase not in TERMINAL_PHASES
        assert Phase.FAILED in targets
    seen, frontier = set(), [INITIAL_PHASE[role]]
    while frontier:
        phase = frontier.pop()
        if phase in seen:
            continue
        seen.add(phase)
        frontier.extend(table.get(phase, ()))
    assert seen & (TERMINAL_PHASES - {Phase.FAILED})


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

"""State machines driven like the adapter does: once per lockstep pass, blocking steps run
inline. Ranks are stepped in a random order each pass to mimic skew."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from sglang_elastic_ep.core.agreement import InMemoryKVStore, Intent, RankAgreement
from sglang_elastic_ep.core.phases import IllegalTransition, Phase
from sglang_elastic_ep.core.state_machines import (
    Action,
    ActionKind,
    ExistingRankScaleUp,
    JoinerRank,
    JoinMode,
    Observation,
    Recovery,
    RoleStateMachine,
    ScaleDown,
    StepProtocolError,
)

DT = 0.05
K = ActionKind


def agreements(
    store: InMemoryKVStore, ranks: list[int], step: str, timeout_s: float = 5.0, epoch: int = 0
) -> dict[int, RankAgreement]:
    intent = Intent(step=step, operation_id="op", epoch=epoch)
    return {
        r: RankAgreement(store, rank=r, members=ranks, intent=intent, timeout_s=timeout_s)
        for r in ranks
    }


Log = dict[int, list[tuple[int, Action]]]


def drive(
    machines: dict[int, RoleStateMachine],
    observe: Callable[[int, int], Observation],
    passes: int,
    seed: int = 0,
    fail_on: tuple[int, ActionKind] | None = None,
) -> Log:
    """Step every machine once per pass; run reported actions inline like the adapter."""
    rng = random.Random(seed)
    log: Log = {r: [] for r in machines}
    for p in range(passes):
        order = sorted(machines)
        rng.shuffle(order)
        for r in order:
            m = machines[r]
            obs = observe(r, p)
            action = m.step(obs)
            log[r].append((p, action))
            while action.reported:
                if fail_on == (r, action.kind):
                    done = Observation(now=obs.now, pass_id=p, error="boom")
                else:
                    done = Observation(now=obs.now, pass_id=p, completed=action.kind)
                action = m.step(done)
                log[r].append((p, action))
    return log


def kinds(log: Log, rank: int) -> list[ActionKind]:
    return [a.kind for _, a in log[rank] if a.kind is not K.KEEP_SERVING]


def pass_of(log: Log, rank: int, kind: ActionKind) -> int:
    return next(p for p, a in log[rank] if a.kind is kind)


def first(log: Log, rank: int, kind: ActionKind) -> Action:
    return next(a for _, a in log[rank] if a.kind is kind)


# --- scale-up, existing ranks -------------------------------------------------------------


def scale_up_machines(store: InMemoryKVStore, timeout_s: float = 600.0):
    ags = agreements(store, [0, 1], "admit")
    return {
        r: ExistingRankScaleUp(
            operation_id="op",
            old_size=2,
            new_size=3,
            now=0.0,
            agreement=ags[r],
            timeout_s=timeout_s,
        )
        for r in (0, 1)
    }


@pytest.mark.parametrize("seed", range(20))
def test_scale_up_existing_ranks_commit_together_despite_skew(seed: int) -> None:
    rng = random.Random(seed)
    store = InMemoryKVStore()
    machines = scale_up_machines(store)
    cohort_seen = {r: rng.randint(1, 4) for r in machines}
    peers_seen = {r: cohort_seen[r] + rng.randint(0, 5) for r in machines}

    def observe(r: int, p: int) -> Observation:
        return Observation(
            now=p * DT,
            pass_id=p,
            cohort_target=3 if p >= cohort_seen[r] else None,
            peers_connected=p >= peers_seen[r],
        )

    log = drive(machines, observe, passes=30, seed=seed)
    for r, m in machines.items():
        assert m.phase is Phase.SERVING_EXPANDED
        assert kinds(log, r) == [K.ADMIT_RANKS, K.CONFIGURE_DATA_PLANE, K.SYNC_NEW_WORLD, K.COMMIT]
        commit = first(log, r, K.COMMIT)
        assert commit.ranks == (2,) and commit.new_size == 3 and commit.rebalance_experts
        # Serving never paused before the agreed pass.
        assert all(a.kind is K.KEEP_SERVING for p, a in log[r] if p < max(peers_seen.values()))
    entry = {pass_of(log, r, K.ADMIT_RANKS) for r in machines}
    assert entry == {max(peers_seen.values()) + 1}
    phases = [s.phase for s in machines[0].phase_stamps]
    assert phases == [
        Phase.WAITING_FOR_COHORT,
        Phase.PENDING,
        Phase.JOINING,
        Phase.CONFIGURING_DATA_PLANE,
        Phase.SYNCING_NEW_WORLD,
        Phase.SERVING_EXPANDED,
    ]


def test_cohort_with_other_target_fails_every_rank() -> None:
    store = InMemoryKVStore()
    machines = scale_up_machines(store)

    def observe(r: int, p: int) -> Observation:
        # Rank 0 sees the cohort (targets 4) at pass 1; rank 1 never reads it.
        seen = r == 0 and p >= 1
        return Observation(now=p * DT, pass_id=p, cohort_target=4 if seen else None)

    log = drive(machines, observe, passes=4)
    rb0 = log[0][1][1]
    assert rb0.kind is K.ROLL_BACK and rb0.failed_in is Phase.WAITING_FOR_COHORT
    assert "targets 4 ranks but this operation targets 3" in (rb0.reason or "")
    assert machines[1].phase is Phase.FAILED  # through the abort key, not its own check
    assert machines[1].error == machines[0].error


def test_cohort_error_fails_with_reason() -> None:
    m = scale_up_machines(InMemoryKVStore())[0]
    a = m.step(Observation(now=0.0, pass_id=0, cohort_error="attn_tp_size 2 != 1"))
    assert a.kind is K.ROLL_BACK and "attn_tp_size 2 != 1" in (a.reason or "")


def test_scale_up_times_out_while_waiting_for_cohort() -> None:
    machines = scale_up_machines(InMemoryKVStore(), timeout_s=1.0)
    log = drive(machines, lambda r, p: Observation(now=p * DT, pass_id=p), passes=30)
    for r, m in machines.items():
        assert m.phase is Phase.FAILED and "timed out after 1s" in (m.error or "")
        assert kinds(log, r) == [K.ROLL_BACK]


def test_rank_that_never_sees_peers_makes_all_abort_through_the_agreement() -> None:
    store = InMemoryKVStore()
    ags = agreements(store, [0, 1], "admit", timeout_s=0.5)
    machines = {
        r: ExistingRankScaleUp(operation_id="op", old_size=2, new_size=3, now=0.0, agreement=ags[r])
        for r in (0, 1)
    }

    def observe(r: int, p: int) -> Observation:
        return Observation(now=p * DT, pass_id=p, cohort_target=3, peers_connected=r == 0)

    drive(machines, observe, passes=20)
    assert all(m.phase is Phase.FAILED for m in machines.values())
    assert machines[0].failed_in is Phase.PENDING
    assert "waiting for rank(s) [1]" in (machines[1].error or "")


def test_error_in_blocking_step_fails_with_phase() -> None:
    machines = scale_up_machines(InMemoryKVStore())
    obs = lambda r, p: Observation(now=p * DT, pass_id=p, cohort_target=3, peers_connected=True)  # noqa: E731
    log = drive(machines, obs, passes=4, fail_on=(1, K.CONFIGURE_DATA_PLANE))
    rollbacks = [a for _, a in log[1] if a.kind is K.ROLL_BACK]
    assert len(rollbacks) == 1 and machines[1].phase is Phase.FAILED
    assert rollbacks[0].failed_in is Phase.CONFIGURING_DATA_PLANE
    assert "configure_data_plane failed: boom" in (rollbacks[0].reason or "")
    assert machines[0].phase is Phase.SERVING_EXPANDED  # rank 0's steps succeeded


def test_cancel_after_publishing_applies_only_where_safe() -> None:
    store = InMemoryKVStore()
    machines = scale_up_machines(store)
    ready = Observation(now=0.0, pass_id=0, cohort_target=3, peers_connected=True)
    assert machines[0].step(ready).kind is K.KEEP_SERVING  # published, WAIT
    machines[0].cancel("orchestrator gave up")
    a = machines[0].step(Observation(now=0.1, pass_id=1, cohort_target=3, peers_connected=True))
    assert a.kind is K.ROLL_BACK and a.reason == "orchestrator gave up"
    b = machines[1].step(Observation(now=0.1, pass_id=1, cohort_target=3, peers_connected=True))
    assert b.kind is K.ROLL_BACK and b.reason == "orchestrator gave up"


def test_cancel_loses_to_an_agreed_entry() -> None:
    store = InMemoryKVStore()
    machines = scale_up_machines(store)
    for r in (0, 1):
        machines[r].step(Observation(now=0.0, pass_id=0, cohort_target=3, peers_connected=True))
    machines[0].cancel("too late")
    # Rank 1 enters at pass 1 first; rank 0 must follow or the collective hangs.
    a1 = machines[1].step(Observation(now=0.1, pass_id=1, peers_connected=True))
    a0 = machines[0].step(Observation(now=0.1, pass_id=1, peers_connected=True))
    assert a1.kind is K.ADMIT_RANKS and a0.kind is K.ADMIT_RANKS


def test_protocol_errors_are_reported() -> None:
    m = scale_up_machines(InMemoryKVStore())[0]
    with pytest.raises(StepProtocolError, match="awaited nothing"):
        m.step(Observation(now=0.0, completed=K.ADMIT_RANKS))
    for p in range(2):
        a = m.step(Observation(now=0.0, pass_id=p, cohort_target=3, peers_connected=True))
    assert a.kind is K.KEEP_SERVING
    solo = ExistingRankScaleUp(
        operation_id="s",
        old_size=1,
        new_size=2,
        now=0.0,
        agreement=agreements(InMemoryKVStore(), [0], "admit")[0],
    )
    ready = Observation(now=0.0, pass_id=0, cohort_target=2, peers_connected=True)
    solo.step(ready)
    assert solo.step(Observation(now=0.0, pass_id=1)).kind is K.ADMIT_RANKS
    with pytest.raises(StepProtocolError, match="awaited admit_ranks but sync_new_world"):
        solo.step(Observation(now=0.0, pass_id=1, completed=K.SYNC_NEW_WORLD))


def test_constructor_rejects_non_growth() -> None:
    ag = agreements(InMemoryKVStore(), [0], "admit")[0]
    with pytest.raises(ValueError):
        ExistingRankScaleUp(operation_id="o", old_size=3, new_size=3, now=0.0, agreement=ag)


def test_illegal_transition_is_raised_by_the_tracker() -> None:
    m = scale_up_machines(InMemoryKVStore())[0]
    with pytest.raises(IllegalTransition):
        m._advance(Phase.SERVING_CONTRACTED, 1.0)


# --- joiner ---------------------------------------------------------------------------------


def run_joiner(m: JoinerRank) -> list[ActionKind]:
    seen = []
    action = m.step(Observation(now=0.0))
    seen.append(action.kind)
    while action.reported:
        action = m.step(Observation(now=1.0, completed=action.kind))
        seen.append(action.kind)
    return seen


def test_scale_joiner_warms_up_before_registering_and_joining() -> None:
    m = JoinerRank(rank=2, mode=JoinMode.SCALE, target_size=3, now=0.0)
    assert run_joiner(m) == [
        K.WARM_UP,
        K.REGISTER_COHORT,
        K.JOIN_GROUPS,
        K.SYNC_NEW_WORLD,
        K.CONFIGURE_DATA_PLANE,
        K.COMMIT,
    ]
    assert m.phase is Phase.SERVING_EXPANDED


def test_recover_joiner_skips_cohort_and_ends_recovered() -> None:
    m = JoinerRank(rank=1, mode=JoinMode.RECOVER, target_size=3, now=0.0)
    kinds_seen = run_joiner(m)
    assert K.REGISTER_COHORT not in kinds_seen and kinds_seen[-1] is K.COMMIT
    assert m.phase is Phase.SERVING_RECOVERED


def test_joiner_polled_while_joining_times_out() -> None:
    m = JoinerRank(rank=2, mode=JoinMode.SCALE, target_size=3, now=0.0, timeout_s=30.0)
    m.step(Observation(now=0.0))
    m.step(Observation(now=100.0, completed=K.WARM_UP))  # warm-up time does not count
    m.step(Observation(now=101.0, completed=K.REGISTER_COHORT))
    assert m.awaiting is K.JOIN_GROUPS
    assert m.step(Observation(now=120.0)).kind is K.KEEP_SERVING
    a = m.step(Observation(now=132.0))
    assert a.kind is K.ROLL_BACK and a.failed_in is Phase.JOINING
    assert "join_groups did not finish within 30s" in (a.reason or "")


def test_joiner_rank_must_be_inside_target() -> None:
    with pytest.raises(ValueError):
        JoinerRank(rank=3, mode=JoinMode.SCALE, target_size=3, now=0.0)


# --- scale-down -----------------------------------------------------------------------------


def scale_down_machines(store: InMemoryKVStore, drain_timeout_s: float = 1.0):
    ags = agreements(store, [0, 1, 2, 3], "scale_down", timeout_s=drain_timeout_s + 5)
    return {
        r: ScaleDown(
            operation_id="op",
            rank=r,
            old_size=4,
            new_size=2,
            now=0.0,
            agreement=ags[r],
            drain_timeout_s=drain_timeout_s,
        )
        for r in range(4)
    }


@pytest.mark.parametrize("seed", range(10))
def test_scale_down_drains_then_all_ranks_switch_together(seed: int) -> None:
    rng = random.Random(seed)
    machines = scale_down_machines(InMemoryKVStore(), drain_timeout_s=60.0)
    drained_at = {2: rng.randint(2, 8), 3: rng.randint(2, 8)}

    def observe(r: int, p: int) -> Observation:
        return Observation(now=p * DT, pass_id=p, drained=r < 2 or p >= drained_at[r])

    log = drive(machines, observe, passes=15, seed=seed)
    for r in (2, 3):
        assert kinds(log, r)[0] is K.STOP_ADMISSION
        assert kinds(log, r)[1:] == [
            K.MOVE_EXPERTS,
            K.SWITCH_PLACEMENT,
            K.RELEASE_RANKS,
            K.SHUT_DOWN,
        ]
        assert machines[r].phase is Phase.RELEASED
    for r in (0, 1):
        assert kinds(log, r) == [K.MOVE_EXPERTS, K.SWITCH_PLACEMENT, K.RELEASE_RANKS, K.COMMIT]
        assert machines[r].phase is Phase.SERVING_CONTRACTED
        assert first(log, r, K.COMMIT).ranks == (2, 3)
    assert {pass_of(log, r, K.MOVE_EXPERTS) for r in range(4)} == {max(drained_at.values()) + 1}


def test_drain_timeout_aborts_remaining_requests_then_proceeds() -> None:
    machines = scale_down_machines(InMemoryKVStore(), drain_timeout_s=0.5)
    aborted: set[int] = set()

    def observe(r: int, p: int) -> Observation:
        # Rank 3 never drains by itself; it is drained once its requests were aborted.
        return Observation(now=p * DT, pass_id=p, drained=r != 3 or 3 in aborted)

    rng_log: Log = {r: [] for r in machines}
    for p in range(20):
        for r in range(4):
            a = machines[r].step(observe(r, p))
            rng_log[r].append((p, a))
            if a.kind is K.ABORT_REQUESTS:
                aborted.add(r)
            while a.reported:
                a = machines[r].step(Observation(now=p * DT, pass_id=p, completed=a.kind))
                rng_log[r].append((p, a))
    abort_pass = pass_of(rng_log, 3, K.ABORT_REQUESTS)
    assert abort_pass == 10  # 0.5 s / 0.05 s per pass
    assert "drain timed out after 0.5s" in (rng_log[3][abort_pass][1].reason or "")
    assert all(m.done and m.phase is not Phase.FAILED for m in machines.values())


def test_scale_down_agreement_must_outlast_the_drain() -> None:
    ag = agreements(InMemoryKVStore(), [0], "d", timeout_s=60.0)[0]
    with pytest.raises(ValueError, match="must exceed the drain timeout"):
        ScaleDown(
            operation_id="o",
            rank=0,
            old_size=2,
            new_size=1,
            now=0.0,
            agreement=ag,
            drain_timeout_s=120.0,
        )


def test_failure_while_moving_experts_rolls_back_with_phase() -> None:
    machines = scale_down_machines(InMemoryKVStore())
    log = drive(
        machines,
        lambda r, p: Observation(now=p * DT, pass_id=p, drained=True),
        passes=4,
        fail_on=(0, K.MOVE_EXPERTS),
    )
    rb = [a for _, a in log[0] if a.kind is K.ROLL_BACK]
    assert len(rb) == 1 and rb[0].failed_in is Phase.MOVING_EXPERTS
    assert rb[0].ranks == (2, 3)


# --- recovery -------------------------------------------------------------------------------


def recovery_machines(store: InMemoryKVStore, survivors: list[int], timeout_s: float = 5.0):
    def factory(rank: int) -> Callable[[int], RankAgreement]:
        return lambda epoch: agreements(store, survivors, "rejoin", timeout_s, epoch)[rank]

    return {
        r: Recovery(operation_id="rec", failed_ranks=(1,), now=0.0, agreement_for_epoch=factory(r))
        for r in survivors
    }


def test_recovery_isolates_serves_degraded_then_readmits() -> None:
    machines = recovery_machines(InMemoryKVStore(), [0, 2])
    connected = {0: 6, 2: 9}

    def observe(r: int, p: int) -> Observation:
        return Observation(now=p * DT, pass_id=p, peers_connected=p >= connected[r])

    log = drive(machines, observe, passes=14)
    for r, m in machines.items():
        assert kinds(log, r) == [K.ISOLATE_RANKS, K.ADMIT_RANKS, K.RESTORE_EXPERTS, K.COMMIT]
        assert m.phase is Phase.SERVING_RECOVERED
        assert pass_of(log, r, K.ADMIT_RANKS) == 10
        commit = first(log, r, K.COMMIT)
        assert commit.rebalance_experts and commit.ranks == (1,)
    assert [s.phase for s in machines[0].phase_stamps] == [
        Phase.ISOLATING_FAULT,
        Phase.SERVING_DEGRADED,
        Phase.REJOINING,
        Phase.RESTORING_EXPERTS,
        Phase.SERVING_RECOVERED,
    ]


def test_aborted_rejoin_returns_to_degraded_and_retries_next_epoch() -> None:
    machines = recovery_machines(InMemoryKVStore(), [0, 2], timeout_s=0.5)

    def observe(r: int, p: int) -> Observation:
        # Rank 2 loses sight of the replacement between passes 3 and 29.
        seen = p >= 3 if r == 0 else p >= 30
        return Observation(now=p * DT, pass_id=p, peers_connected=seen)

    log = drive(machines, observe, passes=40)
    # Rank 0's attempts time out at passes 13 and 24; rank 2 catches up one stale epoch
    # per pass (their abort keys exist) and both enter epoch 2 together.
    for m in machines.values():
        assert m.phase is Phase.SERVING_RECOVERED and m.epoch == 2
        assert Phase.FAILED not in [s.phase for s in m.phase_stamps]
    assert machines[0].rejoin_attempts == 3
    assert "timed out" in (machines[0].last_attempt_error or "")
    assert pass_of(log, 0, K.ADMIT_RANKS) == pass_of(log, 2, K.ADMIT_RANKS) == 33


def test_another_failure_while_degraded_is_isolated_too() -> None:
    m = recovery_machines(InMemoryKVStore(), [0])[0]
    m.step(Observation(now=0.0, pass_id=0))
    m.step(Observation(now=0.0, pass_id=0, completed=K.ISOLATE_RANKS))
    assert m.phase is Phase.SERVING_DEGRADED
    m.add_failed_ranks((3,), now=1.0)
    a = m.step(Observation(now=1.0, pass_id=1))
    assert a.kind is K.ISOLATE_RANKS and a.ranks == (3,)
    m.step(Observation(now=1.0, pass_id=1, completed=K.ISOLATE_RANKS))
    assert m.failed_ranks == (1, 3) and m.phase is Phase.SERVING_DEGRADED


def test_failure_during_rejoin_attempt_abandons_it_then_isolates() -> None:
    m = recovery_machines(InMemoryKVStore(), [0, 2])[0]
    m.step(Observation(now=0.0, pass_id=0))
    m.step(Observation(now=0.0, pass_id=0, completed=K.ISOLATE_RANKS))
    assert m.step(Observation(now=0.0, pass_id=1, peers_connected=True)).kind is K.KEEP_SERVING
    m.add_failed_ranks((2,), now=0.1)
    assert m.step(Observation(now=0.1, pass_id=2, peers_connected=True)).kind is K.KEEP_SERVING
    a = m.step(Observation(now=0.2, pass_id=3))
    assert a.kind is K.ISOLATE_RANKS and a.ranks == (2,)


def test_cancel_while_degraded_fails_recovery() -> None:
    m = recovery_machines(InMemoryKVStore(), [0])[0]
    m.step(Observation(now=0.0, pass_id=0))
    m.step(Observation(now=0.0, pass_id=0, completed=K.ISOLATE_RANKS))
    m.cancel("scaled down instead")
    a = m.step(Observation(now=1.0, pass_id=1))
    assert a.kind is K.ROLL_BACK and m.phase is Phase.FAILED


def test_done_machine_keeps_serving_and_rejects_reports() -> None:
    m = JoinerRank(rank=0, mode=JoinMode.RECOVER, target_size=1, now=0.0)
    run_joiner(m)
    assert m.done and m.step(Observation(now=9.0)).kind is K.KEEP_SERVING
    with pytest.raises(StepProtocolError):
        m.step(Observation(now=9.0, completed=K.COMMIT))


def test_joiner_cancelled_while_join_runs_elsewhere_rolls_back() -> None:
    m = JoinerRank(rank=2, mode=JoinMode.RECOVER, target_size=3, now=0.0)
    m.step(Observation(now=0.0))
    m.step(Observation(now=1.0, completed=K.WARM_UP))
    assert m.awaiting is K.JOIN_GROUPS
    m.cancel("orchestrator deleted the pod")
    a = m.step(Observation(now=2.0))
    assert a.kind is K.ROLL_BACK and a.failed_in is Phase.JOINING and a.ranks == (2,)


def test_error_without_awaited_step_gives_the_operation_up() -> None:
    m = JoinerRank(rank=2, mode=JoinMode.SCALE, target_size=3, now=0.0)
    a = m.step(Observation(now=0.0, error="model files missing"))
    assert a.kind is K.ROLL_BACK and a.reason == "model files missing"


def test_cancel_during_rejoin_attempt_fails_recovery_after_leaving_the_round() -> None:
    store = InMemoryKVStore()
    machines = recovery_machines(store, [0, 2])
    m = machines[0]
    m.step(Observation(now=0.0, pass_id=0))
    m.step(Observation(now=0.0, pass_id=0, completed=K.ISOLATE_RANKS))
    m.step(Observation(now=0.0, pass_id=1, peers_connected=True))  # published, WAIT
    m.cancel("orchestrator chose scale-down")
    a = m.step(Observation(now=0.1, pass_id=2, peers_connected=True))
    assert a.kind is K.ROLL_BACK and m.phase is Phase.FAILED
    other = machines[2]
    other.step(Observation(now=0.0, pass_id=0))
    other.step(Observation(now=0.0, pass_id=0, completed=K.ISOLATE_RANKS))
    other.step(Observation(now=0.2, pass_id=3, peers_connected=True))
    assert other.phase is Phase.SERVING_DEGRADED and other.epoch == 1  # attempt aborted

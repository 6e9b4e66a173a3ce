import math

import pytest

from sglang_elastic_ep.core.health import (
    ExpertTimings,
    HealthConfig,
    RankHealthMonitor,
    blockable_ranks,
    classify_expert_latency,
)

# Four ranks, two physical experts each; the tests slow down rank 1 (experts 2 and 3).
EXPERT_RANK = {e: e // 2 for e in range(8)}
RANKS = [0, 1, 2, 3]


def latencies(slow: set[int], base: float = 0.001, factor: float = 10.0) -> dict[int, float]:
    return {e: base * (factor if e in slow else 1.0) for e in EXPERT_RANK}


def test_classify_relative_to_median() -> None:
    healthy, median = classify_expert_latency(
        {0: 1.0, 1: 1.0, 2: 1.1, 3: 3.5, 4: None, 5: math.nan}, threshold=3.0
    )
    assert median == 1.05
    assert healthy == {0: True, 1: True, 2: True, 3: True, 4: True, 5: True} | {3: False}


def test_classify_without_samples_is_all_healthy() -> None:
    assert classify_expert_latency({0: None}) == ({0: True}, None)


def test_rank_hard_blocked_after_k_consecutive_unhealthy_checks() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=3))
    alive = {0: True, 1: True}
    for _ in range(2):
        assert (
            mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
            is None
        )
    decision = mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    assert decision is not None and decision.ranks == (1,)
    assert "2/2 slow experts" in decision.reason and "for 3 checks" in decision.reason
    assert "--elastic-ep-join-mode recover" in decision.suggested_action
    assert mon.hard_blocked == frozenset({1})
    # Emitted once; stays blocked even when it looks healthy again, until cleared.
    assert (
        mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK) is None
    )
    assert (
        mon.observe(alive=alive, expert_latency=latencies(set()), expert_rank=EXPERT_RANK) is None
    )
    assert mon.hard_blocked == frozenset({1})
    mon.clear(1)
    assert mon.hard_blocked == frozenset()


def test_healthy_check_resets_the_streak() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=2))
    alive = {0: True, 1: True}
    mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    mon.observe(alive=alive, expert_latency=latencies(set()), expert_rank=EXPERT_RANK)
    assert (
        mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK) is None
    )
    snap = {r.rank: r for r in mon.to_response("i").ranks}
    assert snap[1].consecutive_unhealthy_checks == 1 and snap[1].total_unhealthy_checks == 2


def test_ratio_below_threshold_keeps_rank_healthy() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=1, rank_failure_ratio=0.75))
    # One of rank 1's two experts slow: 50% < 75%.
    assert mon.observe(alive={}, expert_latency=latencies({3}), expert_rank=EXPERT_RANK) is None
    snap = {r.rank: r for r in mon.to_response("i").ranks}
    assert snap[1].healthy and snap[1].unhealthy_experts == [3]


def test_dead_rank_is_blocked_at_once_by_default() -> None:
    mon = RankHealthMonitor(RANKS)
    decision = mon.observe(
        alive={0: True, 1: False}, expert_latency=latencies(set()), expert_rank=EXPERT_RANK
    )
    assert decision is not None and decision.ranks == (1,)
    assert "not alive" in decision.reason


def test_health_response_reports_ranks_and_experts() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=5))
    mon.observe(alive={0: True, 1: True}, expert_latency=latencies({3}), expert_rank=EXPERT_RANK)
    resp = mon.to_response("inst")
    assert resp.instance_id == "inst" and resp.checks == 1 and resp.persistence_threshold == 5
    assert resp.median_latency_s == pytest.approx(0.001)
    assert [(e.physical_expert, e.rank, e.healthy) for e in resp.experts] == [
        (e, e // 2, e != 3) for e in range(8)
    ]
    rank1 = resp.ranks[1]
    assert not rank1.healthy and rank1.consecutive_unhealthy_checks == 1
    assert not rank1.hard_blocked


def test_set_ranks_keeps_old_records_and_adds_new() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=9))
    mon.observe(alive={}, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    mon.set_ranks([1, 2])
    ranks = {r.rank: r for r in mon.to_response("i").ranks}
    assert sorted(ranks) == [1, 2] and ranks[1].total_unhealthy_checks == 1
    assert ranks[2].total_unhealthy_checks == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"latency_threshold": 1.0},
        {"rank_failure_ratio": 0.0},
        {"rank_failure_ratio": 1.5},
        {"persistence_threshold": 0},
        {"dead_rank_threshold": 0},
    ],
)
def test_bad_config_is_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HealthConfig(**kwargs)


def test_expert_timings_map_slots_to_ranks_and_skip_unmeasured() -> None:
    timings = ExpertTimings(local_slots=2, ns_per_row=(1000, 0, 3000, 5000, 7000, 9000),
                            rows=(4, 0, 2, 2, 1, 0))
    latency, owner = timings.for_monitor([0, 1])  # rank 2 (slots 4, 5) not asked for
    assert owner == {0: 0, 1: 0, 2: 1, 3: 1}
    assert latency == {0: 1e-6, 1: None, 2: 3e-6, 3: 5e-6}


@pytest.mark.parametrize("kwargs", [
    {"local_slots": 0, "ns_per_row": (), "rows": ()},
    {"local_slots": 2, "ns_per_row": (1, 2), "rows": (1,)},
    {"local_slots": 2, "ns_per_row": (1, 2, 3), "rows": (1, 1, 1)},
])
def test_inconsistent_timings_are_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ExpertTimings(**kwargs)


def test_a_slow_rank_whose_experts_have_replicas_elsewhere_can_be_blocked() -> None:
    # 3 ranks x 2 slots; logical experts 0..1 on every rank
    p2l = [0, 1, 0, 1, 0, 1]
    blocked, kept = blockable_ranks([2], p2l, local_slots=2, serving=[0, 1, 2])
    assert blocked == frozenset({2}) and kept == {}


def test_a_rank_holding_the_last_replica_is_kept_in_use() -> None:
    p2l = [0, 1, 0, 1, 2, 3]  # experts 2 and 3 only on rank 2
    blocked, kept = blockable_ranks([2], p2l, local_slots=2, serving=[0, 1, 2])
    assert blocked == frozenset() and kept == {2: [2, 3]}


def test_blocking_one_rank_narrows_what_the_next_may_rely_on() -> None:
    p2l = [0, 1, 0, 1, 2, 3, 2, 3]  # ranks 0,1: experts 0,1; ranks 2,3: experts 2,3
    blocked, kept = blockable_ranks([1, 0], p2l, local_slots=2, serving=[0, 1, 2, 3])
    assert blocked == frozenset({0}) and kept == {1: [0, 1]}
    # a failed (not serving) rank is not blocked here: the data plane already skips it
    blocked, kept = blockable_ranks([3], p2l, local_slots=2, serving=[0, 1, 2])
    assert blocked == frozenset() and kept == {}


def test_a_check_without_measurements_leaves_the_streak() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(persistence_threshold=3))
    alive = {0: True, 1: True}
    mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    # A liveness-only check, then one where rank 1's experts saw no token: no evidence.
    assert mon.observe(alive=alive, expert_latency={}, expert_rank=EXPERT_RANK) is None
    unmeasured = {e: (None if EXPERT_RANK[e] == 1 else v) for e, v in latencies(set()).items()}
    assert mon.observe(alive=alive, expert_latency=unmeasured, expert_rank=EXPERT_RANK) is None
    snap = {r.rank: r for r in mon.to_response("i").ranks}
    assert snap[1].consecutive_unhealthy_checks == 2 and not snap[1].healthy
    decision = mon.observe(alive=alive, expert_latency=latencies({2, 3}), expert_rank=EXPERT_RANK)
    assert decision is not None and decision.ranks == (1,)


def test_a_rank_alive_again_ends_its_dead_streak_without_measurements() -> None:
    mon = RankHealthMonitor(RANKS, HealthConfig(dead_rank_threshold=3))
    mon.observe(alive={1: False}, expert_latency={}, expert_rank=EXPERT_RANK)
    mon.observe(alive={1: True}, expert_latency={}, expert_rank=EXPERT_RANK)
    snap = {r.rank: r for r in mon.to_response("i").ranks}
    assert snap[1].alive and snap[1].healthy and snap[1].consecutive_unhealthy_checks == 0

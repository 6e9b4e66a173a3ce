from __future__ import annotations

import random

import pytest

from sglang_elastic_ep.core.placement import (
    EMPTY,
    PlacementError,
    PlacementPlan,
    plan_placement,
    replica_table,
    scale_down_map,
)


def check_invariants(
    plan: PlacementPlan,
    *,
    num_experts: int,
    slots: int,
    current: dict[int, list[int]],
    targets: list[int],
    sources: set[int],
) -> None:
    new = plan.placement
    assert sorted(new) == sorted(targets)
    for rank, held in new.items():
        assert len(held) == slots, f"rank {rank} lost its slot count"
        assert all(0 <= e < num_experts for e in held), "empty or bogus slot left"
    assert {e for held in new.values() for e in held} == set(range(num_experts))

    changed = {
        (r, s)
        for r in targets
        for s in range(slots)
        if not (r in current and r in sources and current[r][s] == new[r][s])
    }
    dsts = [(m.dst_rank, m.dst_slot) for m in plan.moves]
    dsts += [(x.dst_rank, x.dst_slot) for x in plan.reloads]
    assert sorted(dsts) == sorted(changed), "moves must cover exactly the changed slots"

    for m in plan.moves:
        assert m.src_rank in sources
        assert current[m.src_rank][m.src_slot] == m.logical_expert, "source lacks expert"
        if m.src_rank in new:  # the source slot must survive the switch
            assert new[m.src_rank][m.src_slot] == m.logical_expert
        assert new[m.dst_rank][m.dst_slot] == m.logical_expert

    # Applying the moves to what stays gives the new placement.
    applied = {
        r: list(current[r]) if r in current and r in sources else [EMPTY] * slots for r in targets
    }
    for m in plan.moves:
        applied[m.dst_rank][m.dst_slot] = current[m.src_rank][m.src_slot]
    for x in plan.reloads:
        applied[x.dst_rank][x.dst_slot] = x.logical_expert
    assert {r: tuple(v) for r, v in applied.items()} == new

    # Minimal: one change per expert without a surviving replica, one per empty slot.
    kept = {e for r in targets if r in current and r in sources for e in current[r] if e != EMPTY}
    empty = sum(
        1
        for r in targets
        for s in range(slots)
        if not (r in current and r in sources) or current[r][s] == EMPTY
    )
    assert plan.changed_slots == max(num_experts - len(kept), empty)


def random_case(rng: random.Random):
    num_experts = rng.randint(1, 24)
    slots = rng.randint(1, 6)
    min_ranks = -(-num_experts // slots)
    n_ranks = rng.randint(min_ranks, min_ranks + 4)
    pool = list(range(num_experts)) + [
        rng.randrange(num_experts) for _ in range(n_ranks * slots - num_experts)
    ]
    rng.shuffle(pool)
    current = {r: pool[r * slots : (r + 1) * slots] for r in range(n_ranks)}
    return num_experts, slots, current


def test_random_scale_downs_keep_every_expert_with_minimal_moves() -> None:
    for seed in range(400):
        rng = random.Random(seed)
        num_experts, slots, current = random_case(rng)
        n = len(current)
        min_ranks = -(-num_experts // slots)
        keep = rng.randint(min_ranks, n)
        targets = list(range(keep))
        load = [rng.random() * 10 for _ in range(num_experts)] if seed % 2 else None
        plan = plan_placement(
            num_logical_experts=num_experts,
            slots_per_rank=slots,
            current=current,
            target_ranks=targets,
            expert_load=load,
        )
        check_invariants(
            plan,
            num_experts=num_experts,
            slots=slots,
            current=current,
            targets=targets,
            sources=set(current),
        )
        assert not plan.reloads


def test_random_scale_ups_fill_new_ranks_from_existing_ones() -> None:
    for seed in range(300):
        rng = random.Random(seed)
        num_experts, slots, current = random_case(rng)
        n = len(current)
        targets = list(range(n + rng.randint(1, 3)))
        plan = plan_placement(
            num_logical_experts=num_experts,
            slots_per_rank=slots,
            current=current,
            target_ranks=targets,
        )
        check_invariants(
            plan,
            num_experts=num_experts,
            slots=slots,
            current=current,
            targets=targets,
            sources=set(current),
        )
        for r in range(n):
            assert list(plan.placement[r]) == current[r], "old ranks must not change"


def test_random_failures_source_only_from_live_ranks() -> None:
    for seed in range(300):
        rng = random.Random(seed)
        num_experts, slots, current = random_case(rng)
        n = len(current)
        failed = set(rng.sample(range(n), rng.randint(1, max(1, n // 2))))
        sources = set(range(n)) - failed
        # Recovery: the failed ranks come back empty (replacements).
        targets = list(range(n))
        plan = plan_placement(
            num_logical_experts=num_experts,
            slots_per_rank=slots,
            current=current,
            target_ranks=targets,
            source_ranks=sources,
            allow_reload=True,
        )
        check_invariants(
            plan,
            num_experts=num_experts,
            slots=slots,
            current=current,
            targets=targets,
            sources=sources,
        )
        live_experts = {e for r in sources for e in current[r]}
        assert {x.logical_expert for x in plan.reloads} == set(range(num_experts)) - live_experts


def test_scale_down_keeps_staying_slots_when_leaving_rank_only_has_replicas() -> None:
    current = {0: [0, 1], 1: [2, 3], 2: [0, 2]}
    plan = plan_placement(
        num_logical_experts=4, slots_per_rank=2, current=current, target_ranks=[0, 1]
    )
    assert plan.placement == {0: (0, 1), 1: (2, 3)} and plan.moves == ()


def test_scale_down_overwrites_the_least_needed_replica() -> None:
    # Expert 3 lives only on the leaving rank 2; expert 0 has two replicas on staying ranks.
    current = {0: [0, 1], 1: [0, 2], 2: [3, 3]}
    load = [1.0, 5.0, 5.0, 5.0]
    plan = plan_placement(
        num_logical_experts=4,
        slots_per_rank=2,
        current=current,
        target_ranks=[0, 1],
        expert_load=load,
    )
    assert sorted(e for held in plan.placement.values() for e in held) == [0, 1, 2, 3]
    [move] = plan.moves
    assert move.logical_expert == 3 and move.src_rank == 2
    assert current[move.dst_rank][move.dst_slot] == 0  # a surplus replica of expert 0


def test_scale_up_adds_replicas_of_the_hottest_experts() -> None:
    current = {0: [0, 1], 1: [2, 3]}
    plan = plan_placement(
        num_logical_experts=4,
        slots_per_rank=2,
        current=current,
        target_ranks=[0, 1, 2],
        expert_load=[1.0, 9.0, 1.0, 8.0],
    )
    assert sorted(plan.placement[2]) == [1, 3]
    assert {(m.src_rank, m.logical_expert) for m in plan.moves} == {(0, 1), (1, 3)}


def test_without_load_new_slots_go_to_experts_with_fewest_replicas() -> None:
    current = {0: [0, 0], 1: [1, 2]}
    plan = plan_placement(
        num_logical_experts=3, slots_per_rank=2, current=current, target_ranks=[0, 1, 2]
    )
    assert sorted(plan.placement[2]) == [1, 2]


def test_new_rank_prefers_distinct_experts() -> None:
    current = {0: [0, 0, 1], 1: [2, 1, 0]}
    plan = plan_placement(
        num_logical_experts=3, slots_per_rank=3, current=current, target_ranks=[0, 1, 2]
    )
    assert sorted(plan.placement[2]) == [0, 1, 2]


def test_sources_are_spread_over_holders() -> None:
    current = {0: [0, 1], 1: [0, 1]}
    plan = plan_placement(
        num_logical_experts=2, slots_per_rank=2, current=current, target_ranks=[0, 1, 2, 3]
    )
    srcs = [m.src_rank for m in plan.moves]
    assert sorted(srcs) == [0, 0, 1, 1]


def test_copy_from_the_same_rank_is_preferred() -> None:
    current = {0: [0, 1, 0], 1: [0, 1, EMPTY]}
    plan = plan_placement(
        num_logical_experts=2, slots_per_rank=3, current=current, target_ranks=[0, 1]
    )
    [move] = plan.moves
    assert (move.logical_expert, move.src_rank, move.dst_rank) == (1, 1, 1)


def test_too_few_slots_is_a_clear_error() -> None:
    with pytest.raises(PlacementError, match="cannot hold 5 experts; keep at least 3 ranks"):
        plan_placement(
            num_logical_experts=5,
            slots_per_rank=2,
            current={0: [0, 1], 1: [2, 3], 2: [4, 0]},
            target_ranks=[0, 1],
        )


def test_expert_without_live_copy_needs_reload_permission() -> None:
    current = {0: [0, 1], 1: [2, 3]}
    with pytest.raises(PlacementError, match="expert 2 has no copy"):
        plan_placement(
            num_logical_experts=4,
            slots_per_rank=2,
            current=current,
            target_ranks=[0, 1],
            source_ranks=[0],
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"current": {0: [0]}, "target_ranks": [0]}, "has 1 slots, expected 2"),
        ({"current": {0: [0, 7]}, "target_ranks": [0]}, "unknown experts \\[7\\]"),
        ({"current": {0: [0, 1]}, "target_ranks": []}, "target_ranks is empty"),
        ({"current": {0: [0, 1]}, "target_ranks": [0, 0]}, "duplicates"),
        ({"current": {0: [0, 1]}, "target_ranks": [0], "expert_load": [1.0]}, "2 experts"),
        ({"current": {0: [0, 1]}, "target_ranks": [0], "expert_load": [1.0, -1]}, "negative"),
    ],
)
def test_bad_inputs_are_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        plan_placement(num_logical_experts=2, slots_per_rank=2, **kwargs)


def test_replica_table_indexes_physical_slots() -> None:
    table = replica_table({0: [0, 1], 1: [1, EMPTY]}, slots_per_rank=2)
    assert table.logical_to_physical == {0: [0], 1: [1, 2]}
    assert table.physical_to_rank == {0: 0, 1: 0, 2: 1, 3: 1}
    assert table.physical_to_logical == {0: 0, 1: 1, 2: 1, 3: EMPTY}
    with pytest.raises(PlacementError):
        replica_table({0: [0]}, slots_per_rank=2)


def test_mapping_load_and_plan_round_trip_through_replica_table() -> None:
    current = {0: [0, 1], 1: [2, 3], 2: [3, 1]}
    plan = plan_placement(
        num_logical_experts=4,
        slots_per_rank=2,
        current=current,
        target_ranks=[0, 1],
        expert_load={1: 3.0},
    )
    table = replica_table(plan.placement, slots_per_rank=2)
    assert set(table.logical_to_physical) == {0, 1, 2, 3}


def test_uncovered_experts_lists_what_the_staying_slots_lack_per_layer() -> None:
    from sglang_elastic_ep.core.placement import uncovered_experts

    # 3 ranks x 2 slots; layer 0: every expert also on ranks 0-1; layer 1: expert 3 only on 2.
    p2l = [[0, 1, 2, 3, 0, 1], [0, 1, 2, 1, 3, 0]]
    assert uncovered_experts(p2l, slots=4) == {1: [3]}
    assert uncovered_experts(p2l, slots=6) == {}
    assert uncovered_experts(p2l, slots=2) == {0: [2, 3], 1: [2, 3]}
    assert uncovered_experts([[0, EMPTY, 1]], slots=1) == {0: [1]}
    with pytest.raises(ValueError, match="slots"):
        uncovered_experts(p2l, slots=-1)


def test_experts_per_rank_from_one_layers_map() -> None:
    from sglang_elastic_ep.core.placement import experts_per_rank

    assert experts_per_rank([3, 1, 1, -1, 0, 2], local_slots=2) == {0: [1, 3], 1: [1], 2: [0, 2]}
    with pytest.raises(ValueError):
        experts_per_rank([0], local_slots=0)


# --- scale_down_map: experts leave the tail before the ranks do ---------------------------


def test_scale_down_map_keeps_a_covered_layout_unchanged() -> None:
    row = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]  # three ranks, every rank holds every expert
    assert scale_down_map([row], 3, 2, 4) == [row]


def test_scale_down_map_moves_only_the_experts_the_tail_alone_holds() -> None:
    # rank 0 holds 0,1 twice; rank 1 holds 2,3 twice: shrinking to one rank needs 2 and 3 in
    # two of rank 0's duplicate slots; rank 1's slots stay as they are (the move's source).
    row = [0, 1, 0, 1, 2, 3, 2, 3]
    [moved] = scale_down_map([row], 2, 1, 4)
    assert sorted(moved[:4]) == [0, 1, 2, 3]
    assert moved[4:] == [2, 3, 2, 3]
    assert sum(a != b for a, b in zip(moved[:4], row[:4], strict=True)) == 2  # the fewest


def test_scale_down_map_plans_each_layer_on_its_own() -> None:
    covered = [0, 1, 2, 3, 0, 1, 2, 3]
    tail_only = [0, 0, 1, 1, 2, 3, 2, 3]
    moved = scale_down_map([covered, tail_only], 2, 1, 4)
    assert moved[0] == covered
    assert sorted(moved[1][:4]) == [0, 1, 2, 3] and moved[1][4:] == [2, 3, 2, 3]


def test_scale_down_map_from_four_to_two_keeps_every_expert_on_the_staying_ranks() -> None:
    rng = random.Random(7)
    for _ in range(50):
        # 4 ranks x 4 slots, 8 experts: the leaving ranks 2..3 hold each expert once, the
        # staying ranks 0..1 any of them (repeats leave some only on the leaving ranks)
        row = [rng.randrange(8) for _ in range(8)] + rng.sample(range(8), 8)
        [moved] = scale_down_map([row], 4, 2, 8)
        assert set(moved[:8]) == set(range(8)), (row, moved)
        assert moved[8:] == row[8:]


def test_scale_down_map_refuses_too_few_staying_slots() -> None:
    with pytest.raises(PlacementError, match="cannot hold"):
        scale_down_map([[0, 1, 2, 3]], 2, 1, 4)  # one rank x 2 slots for 4 experts


def test_scale_down_map_refuses_a_size_that_is_not_a_shrink() -> None:
    with pytest.raises(PlacementError, match="new < old"):
        scale_down_map([[0, 1, 2, 3]], 2, 2, 4)

"""Expert placement for a new rank set with the fewest weight moves.

A placement maps each rank to the logical expert held in each of its physical slots; every
rank has the same fixed number of slots (SGLang fixes local experts per rank at launch).
Physical expert id = rank * slots_per_rank + slot, as in SGLang's expert location metadata.

Rules of ``plan_placement``:
- every target rank gets exactly ``slots_per_rank`` slots, each holding an expert;
- every logical expert ends with at least one replica on the target ranks;
- a slot on a target rank that can be read (a source rank) keeps its expert unless that
  expert still has another replica and its slot is needed for an expert that has none;
- slots are filled, in this order, with experts that have no replica, then with the
  expert with the highest load per replica (no load given: the fewest replicas);
- weights come only from source-rank slots that still hold the expert after the switch
  (leaving ranks keep theirs until released), preferring a copy on the same rank;
- an expert no source rank holds is listed in ``reloads`` (checkpoint or DRAM backup) when
  ``allow_reload``; otherwise the plan fails.

The number of moves is max(#experts without replica, #empty slots), which is the minimum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

EMPTY = -1  # a slot with no expert (a fresh rank, or a failed rank's lost memory)

Placement = Mapping[int, Sequence[int]]  # rank -> logical expert id per slot


class PlacementError(ValueError):
    """No placement satisfies the rules (e.g. fewer slots than experts)."""


@dataclass(frozen=True)
class WeightMove:
    logical_expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


@dataclass(frozen=True)
class ExpertReload:
    """No live rank holds this expert: load it into the slot from the checkpoint or backup."""

    logical_expert: int
    dst_rank: int
    dst_slot: int


@dataclass(frozen=True)
class PlacementPlan:
    placement: dict[int, tuple[int, ...]]  # target rank -> logical expert per slot
    moves: tuple[WeightMove, ...]
    reloads: tuple[ExpertReload, ...] = ()

    @property
    def changed_slots(self) -> int:
        return len(self.moves) + len(self.reloads)


@dataclass(frozen=True)
class ReplicaTable:
    logical_to_physical: dict[int, list[int]]
    physical_to_logical: dict[int, int]
    physical_to_rank: dict[int, int]


def replica_table(placement: Placement, slots_per_rank: int) -> ReplicaTable:
    """Index a placement by logical expert (physical id = rank * slots_per_rank + slot)."""
    logical_to_physical: dict[int, list[int]] = {}
    physical_to_logical: dict[int, int] = {}
    physical_to_rank: dict[int, int] = {}
    for rank in sorted(placement):
        slots = placement[rank]
        if len(slots) != slots_per_rank:
            raise PlacementError(f"rank {rank} has {len(slots)} slots, expected {slots_per_rank}")
        for slot, expert in enumerate(slots):
            physical = rank * slots_per_rank + slot
            physical_to_rank[physical] = rank
            physical_to_logical[physical] = expert
            if expert != EMPTY:
                logical_to_physical.setdefault(expert, []).append(physical)
    return ReplicaTable(logical_to_physical, physical_to_logical, physical_to_rank)


def _loads(
    num_experts: int, expert_load: Sequence[float] | Mapping[int, float] | None
) -> list[float]:
    if expert_load is None:
        return [1.0] * num_experts
    if isinstance(expert_load, Mapping):
        loads = [float(expert_load.get(e, 0.0)) for e in range(num_experts)]
    else:
        if len(expert_load) != num_experts:
            raise PlacementError(
                f"expert_load has {len(expert_load)} entries for {num_experts} experts"
            )
        loads = [float(x) for x in expert_load]
    if any(x < 0 for x in loads):
        raise PlacementError("expert_load must be non-negative")
    return loads


def _validate(
    num_logical_experts: int, slots_per_rank: int, current: Placement, targets: list[int]
) -> None:
    if num_logical_experts < 1 or slots_per_rank < 1:
        raise PlacementError("num_logical_experts and slots_per_rank must be >= 1")
    if not targets:
        raise PlacementError("target_ranks is empty")
    if len(set(targets)) != len(targets):
        raise PlacementError(f"target_ranks has duplicates: {targets}")
    for rank, slots in current.items():
        if len(slots) != slots_per_rank:
            raise PlacementError(f"rank {rank} has {len(slots)} slots, expected {slots_per_rank}")
        bad = [e for e in slots if e != EMPTY and not 0 <= e < num_logical_experts]
        if bad:
            raise PlacementError(
                f"rank {rank} holds unknown experts {bad} (valid: 0..{num_logical_experts - 1})"
            )
    total = slots_per_rank * len(targets)
    if total < num_logical_experts:
        raise PlacementError(
            f"{len(targets)} ranks x {slots_per_rank} slots = {total} slots cannot hold "
            f"{num_logical_experts} experts; keep at least "
            f"{-(-num_logical_experts // slots_per_rank)} ranks"
        )


def plan_placement(
    *,
    num_logical_experts: int,
    slots_per_rank: int,
    current: Placement,
    target_ranks: Iterable[int],
    source_ranks: Iterable[int] | None = None,
    expert_load: Sequence[float] | Mapping[int, float] | None = None,
    allow_reload: bool = False,
) -> PlacementPlan:
    """Place experts on ``target_ranks``, keeping what is already there where possible.

    ``source_ranks`` are the ranks whose weights can be read (default: every rank in
    ``current``); exclude failed ranks. A target rank that is not a source starts empty.
    """
    targets = sorted(target_ranks)
    _validate(num_logical_experts, slots_per_rank, current, targets)
    sources = set(current) if source_ranks is None else set(source_ranks)
    loads = _loads(num_logical_experts, expert_load)

    new: dict[int, list[int]] = {}
    for rank in targets:
        if rank in current and rank in sources:
            new[rank] = list(current[rank])
        else:
            new[rank] = [EMPTY] * slots_per_rank
    kept = {rank: list(slots) for rank, slots in new.items()}  # before any change

    replicas = [0] * num_logical_experts
    for slots in new.values():
        for expert in slots:
            if expert != EMPTY:
                replicas[expert] += 1

    empty = [(rank, slot) for rank in targets for slot, e in enumerate(new[rank]) if e == EMPTY]
    missing = sorted(
        (e for e in range(num_logical_experts) if replicas[e] == 0),
        key=lambda e: (-loads[e], e),
    )

    # 1. Experts without replica: into empty slots first, then over a surplus replica.
    empty_iter = iter(empty)
    for expert in missing:
        spot = next(empty_iter, None)
        if spot is None:
            spot = _evict_surplus_replica(new, replicas, loads)
            replicas[new[spot[0]][spot[1]]] -= 1
        new[spot[0]][spot[1]] = expert
        replicas[expert] += 1

    # 2. Remaining empty slots: more replicas of the most loaded experts per replica.
    for rank, slot in empty_iter:
        on_rank = set(new[rank])
        expert = max(
            range(num_logical_experts),
            key=lambda e: (e not in on_rank, loads[e] / (replicas[e] + 1), -replicas[e], -e),
        )
        new[rank][slot] = expert
        replicas[expert] += 1

    moves, reloads = _source_moves(current, sources, kept, new, allow_reload)
    return PlacementPlan(
        placement={rank: tuple(slots) for rank, slots in new.items()},
        moves=tuple(moves),
        reloads=tuple(reloads),
    )


def _evict_surplus_replica(
    new: dict[int, list[int]], replicas: list[int], loads: list[float]
) -> tuple[int, int]:
    """The slot whose expert loses least by giving up one replica (most replicas, least load)."""
    best: tuple[int, int] | None = None
    best_key: tuple[float, float] | None = None
    for rank in sorted(new):
        for slot, expert in enumerate(new[rank]):
            if expert == EMPTY or replicas[expert] < 2:
                continue
            key = (loads[expert] / replicas[expert], -replicas[expert])
            if best_key is None or key < best_key:
                best, best_key = (rank, slot), key
    if best is None:  # unreachable when total slots >= experts, kept as a guard
        raise PlacementError("no surplus replica to evict; add ranks")
    return best


def _source_moves(
    current: Placement,
    sources: set[int],
    kept: dict[int, list[int]],
    new: dict[int, list[int]],
    allow_reload: bool,
) -> tuple[list[WeightMove], list[ExpertReload]]:
    # Readable copies: source-rank slots whose content does not change in the new placement.
    holders: dict[int, list[tuple[int, int]]] = {}
    for rank in sorted(current):
        if rank not in sources:
            continue
        for slot, expert in enumerate(current[rank]):
            if expert == EMPTY:
                continue
            if rank in new and new[rank][slot] != expert:
                continue  # overwritten by this plan: not a safe source
            holders.setdefault(expert, []).append((rank, slot))

    outgoing: dict[int, int] = {}
    moves: list[WeightMove] = []
    reloads: list[ExpertReload] = []
    for rank in sorted(new):
        for slot, expert in enumerate(new[rank]):
            if kept[rank][slot] == expert:
                continue
            candidates = holders.get(expert, [])
            if not candidates:
                if not allow_reload:
                    raise PlacementError(
                        f"expert {expert} has no copy on any source rank {sorted(sources)}; "
                        "pass allow_reload=True to load it from the checkpoint or backup"
                    )
                reloads.append(ExpertReload(expert, rank, slot))
                continue
            local = [c for c in candidates if c[0] == rank]
            src = local[0] if local else min(candidates, key=lambda c: (outgoing.get(c[0], 0), c))
            outgoing[src[0]] = outgoing.get(src[0], 0) + 1
            moves.append(WeightMove(expert, src[0], src[1], rank, slot))
    return moves, reloads


def uncovered_experts(
    physical_to_logical: Sequence[Sequence[int]], slots: int
) -> dict[int, list[int]]:
    """Per layer, the logical experts with no replica among the first ``slots`` physical slots
    (the staying ranks of a tail scale-down); only layers with such experts are listed.

    ``physical_to_logical`` is SGLang's map, one row per MoE layer; the logical experts of a
    layer are the ones its full row holds."""
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    missing: dict[int, list[int]] = {}
    for layer, row in enumerate(physical_to_logical):
        gone = sorted({e for e in row if e != EMPTY} - set(row[:slots]))
        if gone:
            missing[layer] = gone
    return missing


def experts_per_rank(physical_to_logical: Sequence[int], local_slots: int) -> dict[int, list[int]]:
    """Logical experts with a replica on each rank, from one MoE layer's physical->logical map
    (physical expert ``p`` lives on rank ``p // local_slots``)."""
    if local_slots < 1:
        raise ValueError(f"local_slots must be >= 1, got {local_slots}")
    ranks: dict[int, set[int]] = {}
    for p, logical in enumerate(physical_to_logical):
        held = ranks.setdefault(p // local_slots, set())
        if logical != EMPTY:
            held.add(int(logical))
    return {rank: sorted(held) for rank, held in sorted(ranks.items())}


def slots_per_rank(physical_to_logical: Sequence[int], local_slots: int) -> dict[int, list[int]]:
    """The logical expert in each physical slot, per rank, in slot order (one MoE layer)."""
    if local_slots < 1:
        raise ValueError(f"local_slots must be >= 1, got {local_slots}")
    return {rank: [int(e) for e in physical_to_logical[start:start + local_slots]]
            for rank, start in enumerate(range(0, len(physical_to_logical), local_slots))}


def scale_down_map(
    physical_to_logical: Sequence[Sequence[int]],
    old_ep_size: int,
    new_ep_size: int,
    num_logical_experts: int,
) -> list[list[int]]:
    """SGLang's physical->logical map (one row per layer, still over ``old_ep_size`` ranks)
    after the experts that only the leaving tail ranks hold moved onto the staying ranks.

    Each staying rank keeps its number of slots (layouts stay valid) and keeps every slot
    except the fewest needed, which take over from surplus replicas (``plan_placement``). The
    leaving ranks' slots are unchanged: they are the sources of the moves, and are cut off
    the map only after the weights arrived. Unchanged rows mean no weight moves. Raises
    ``PlacementError`` when the staying ranks have fewer slots than there are experts."""
    if not 1 <= new_ep_size < old_ep_size:
        raise PlacementError(f"a scale-down needs 1 <= new < old, got {old_ep_size} -> "
                             f"{new_ep_size}")
    moved: list[list[int]] = []
    for row in physical_to_logical:
        if len(row) % old_ep_size:
            raise PlacementError(f"{len(row)} physical experts do not split over "
                                 f"{old_ep_size} ranks")
        slots = len(row) // old_ep_size
        current = {r: list(row[r * slots:(r + 1) * slots]) for r in range(old_ep_size)}
        plan = plan_placement(num_logical_experts=num_logical_experts, slots_per_rank=slots,
                              current=current, target_ranks=range(new_ep_size))
        staying = [e for r in range(new_ep_size) for e in plan.placement[r]]
        moved.append(staying + list(row[new_ep_size * slots:]))
    return moved


def spread_replicas(
    physical_to_logical: Sequence[int], slots_per_rank: int, min_ranks: int,
    num_logical_experts: int,
) -> list[int]:
    """One layer's map after each expert has a replica on at least ``min_ranks`` ranks (fewer
    when there are fewer ranks), so that any ``min_ranks - 1`` ranks can fail without an
    expert losing every replica.

    A slot is taken over only from an expert that keeps ``min_ranks`` ranks without it (a
    second replica on the same rank goes first, then the expert with the most replicas), so
    the experts EPLB made hot keep most of their replicas. Raises ``PlacementError`` when the
    slots cannot give every expert ``min_ranks`` ranks."""
    if min_ranks < 1:
        raise PlacementError(f"min_ranks must be >= 1, got {min_ranks}")
    if slots_per_rank < 1 or len(physical_to_logical) % slots_per_rank:
        raise PlacementError(f"{len(physical_to_logical)} physical experts do not split into "
                             f"ranks of {slots_per_rank} slots")
    row = list(physical_to_logical)
    num_ranks = len(row) // slots_per_rank
    want = min(min_ranks, num_ranks)
    if num_logical_experts * want > len(row):
        raise PlacementError(f"{num_logical_experts} experts on {want} ranks each need "
                             f"{num_logical_experts * want} slots, there are {len(row)}")

    def ranks_of(expert: int) -> set[int]:
        return {s // slots_per_rank for s, e in enumerate(row) if e == expert}

    def replicas(expert: int) -> int:
        return sum(1 for e in row if e == expert)

    for expert in range(num_logical_experts):
        while len(held := ranks_of(expert)) < want:
            # A slot on a rank without ``expert`` whose expert can spare it: a same-rank
            # duplicate, or a replica on more ranks than needed; the most replicated first.
            candidates = [
                s for s in range(len(row))
                if s // slots_per_rank not in held and _can_spare(row, s, slots_per_rank, want)
            ]
            if not candidates:
                raise PlacementError(f"no slot can take a replica of expert {expert}: "
                                     "every other slot holds an expert's last needed replica")
            slot = max(candidates,
                       key=lambda s: (_duplicate_on_rank(row, s, slots_per_rank),
                                      replicas(row[s]), s))
            row[slot] = expert
    return row


def _duplicate_on_rank(row: Sequence[int], slot: int, slots_per_rank: int) -> bool:
    start = slot - slot % slots_per_rank
    return row[slot] == EMPTY or sum(
        1 for e in row[start:start + slots_per_rank] if e == row[slot]) > 1


def _can_spare(row: Sequence[int], slot: int, slots_per_rank: int, want: int) -> bool:
    """Whether the expert in ``slot`` still has ``want`` ranks without it."""
    expert = row[slot]
    if expert == EMPTY or _duplicate_on_rank(row, slot, slots_per_rank):
        return True
    ranks = {s // slots_per_rank for s, e in enumerate(row) if e == expert and s != slot}
    return len(ranks) >= want


def launch_slots_per_rank(num_logical_experts: int, num_redundant: int, launch_size: int) -> int:
    """Physical expert slots per rank, fixed at launch for every size the deployment takes:
    (experts + redundant experts) / launch size. Raises ``PlacementError`` when that does not
    divide, naming the redundant counts that would."""
    if num_logical_experts < 1 or num_redundant < 0 or launch_size < 1:
        raise PlacementError(f"need experts >= 1, redundant >= 0, ranks >= 1; got "
                             f"{num_logical_experts}, {num_redundant}, {launch_size}")
    total = num_logical_experts + num_redundant
    if total % launch_size:
        fits = [r for r in range(num_redundant + 1, num_redundant + 2 * launch_size + 1)
                if (num_logical_experts + r) % launch_size == 0][:2]
        below = num_redundant - total % launch_size
        options = ([below] if below >= 0 else []) + fits
        raise PlacementError(
            f"{num_logical_experts} experts + {num_redundant} redundant = {total} physical "
            f"expert slots do not split over the {launch_size} launch ranks: use "
            f"--ep-num-redundant-experts {' or '.join(str(r) for r in options)}")
    return total // launch_size


def size_refusal(num_logical_experts: int, slots_per_rank: int, new_size: int) -> str | None:
    """Why ``new_size`` ranks cannot hold every expert (each rank keeps its launch slots), or
    None. A scale-up always fits: the new ranks' slots only add replicas."""
    if new_size * slots_per_rank >= num_logical_experts:
        return None
    need = -(-num_logical_experts // slots_per_rank)
    return (f"{new_size} ranks x {slots_per_rank} expert slots hold fewer than the "
            f"{num_logical_experts} experts: keep at least {need} ranks, or launch with more "
            "--ep-num-redundant-experts")

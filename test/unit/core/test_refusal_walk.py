"""Every refusal points to an action that works from that state.

Walks the scale validator over reachable states (sizes of whole attention replicas that hold
every expert, any one or two failed ranks, slots released below the launch size) and every
target. A refusal that names a size to ask for instead must name one the same state accepts;
one that tells the operator to recover ranks must be about a state with failed ranks that a
relaunch brings back (the schedulers' rule, ``core.membership``: a failed tail of scale-joined
ranks is re-admitted, every other failed rank rejoins in place); one that names ranks to remove
(``{"remove_ranks": [...]}``) must name a set the same state accepts.
"""

from __future__ import annotations

import itertools
import json
import re

import pytest

from sglang_elastic_ep.core.membership import failed_in_place, failed_tail
from sglang_elastic_ep.core.validation import (
    ScaleTopology,
    ScaleVerdict,
    judge_with_holes,
    resolve_removal,
    validate_scale,
)

# "scale down to exactly 3", "scaling down to 3", "accepted now is 3", "(e.g. 4 or 6)"
SUGGESTED = re.compile(r"\b(?:down to(?: exactly)?|accepted now is|e\.g\.|or) (\d+)")
REMOVAL = re.compile(r'\{"remove_ranks": (\[[\d, ]+\])\}')

TOPOLOGIES = [
    ScaleTopology(max_ep_size=max_size, attn_replica_size=replica,
                  num_logical_experts=experts, slots_per_rank=slots, launch_size=launch)
    for max_size, replica, launch, (experts, slots) in itertools.product(
        (4, 6, 8), (1, 2), (2, 4), ((None, None), (16, 8), (16, 6)))
    if max_size % replica == 0 and launch % replica == 0 and launch <= max_size
]


def relaunch_brings_back(current: int, failed: tuple[int, ...], launch: int | None) -> bool:
    """Whether relaunching ``failed`` with ``--elastic-ep-join-mode recover`` brings every one
    of them back, by the rule the schedulers apply: a failed tail of scale-joined ranks is let
    go and re-admitted, and every other failed rank rejoins in place once it is gone."""
    launch = launch or current
    mask = [0 if r in failed else 1 for r in range(current)]
    tail = failed_tail(mask, current, launch)
    below = tail.first if tail is not None else current
    back = set(tail.ranks if tail is not None else ()) | set(failed_in_place(mask, below, launch))
    return back == set(failed)


def states(topology: ScaleTopology) -> list[tuple[int, tuple[int, ...]]]:
    """(current size, failed ranks) the cluster can be in."""
    sizes = range(max(topology.min_ep_size, topology.attn_replica_size),
                  topology.max_ep_size + 1, topology.attn_replica_size)
    return [(size, failed) for size in sizes for k in (0, 1, 2)
            for failed in itertools.combinations(range(size), k)]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=repr)
def test_no_refusal_recommends_an_action_the_same_state_refuses(
    topology: ScaleTopology,
) -> None:
    walked = 0
    for current, failed in states(topology):
        for target in range(0, topology.max_ep_size + 3):
            verdict = validate_scale(target, current_size=current, topology=topology,
                                     failed_ranks=failed)
            if verdict.ok:
                continue
            walked += 1
            for size in map(int, SUGGESTED.findall(verdict.message)):
                again = validate_scale(size, current_size=current, topology=topology,
                                       failed_ranks=failed)
                assert again.ok, (current, failed, target, verdict.message, again.message)
            for ranks in map(json.loads, REMOVAL.findall(verdict.message)):
                removal = resolve_removal(ranks, current, failed=failed,
                                          launch_size=topology.launch_size,
                                          attn_replica_size=topology.attn_replica_size)
                assert not isinstance(removal, ScaleVerdict) or removal.ok, \
                    (current, failed, target, verdict.message, removal.message)
            if "recover" in verdict.message:
                assert failed, (current, target, verdict.message)
                assert relaunch_brings_back(current, failed, topology.launch_size), \
                    (current, failed, target, verdict.message)
            assert verdict.message.strip(), (current, failed, target)
    assert walked > 0


def test_the_walk_sees_each_kind_of_suggestion() -> None:
    """The pattern above still matches what the validator says (a renamed phrase would make
    the walk check nothing)."""
    topo = ScaleTopology(max_ep_size=8, attn_replica_size=2, num_logical_experts=16,
                         slots_per_rank=4, launch_size=2)
    messages = [
        validate_scale(5, current_size=6, topology=topo).message,  # incomplete replica
        validate_scale(2, current_size=6, topology=topo).message,  # too few expert slots
        validate_scale(10, current_size=6, topology=topo).message,  # above the maximum
        validate_scale(8, current_size=6, topology=topo, failed_ranks=[4, 5]).message,
        validate_scale(4, current_size=8, topology=topo, failed_ranks=[6, 7]).message,
    ]
    for message in messages:
        assert SUGGESTED.search(message), message
    holes = validate_scale(8, current_size=6, topology=topo, failed_ranks=[0, 1]).message
    assert not REMOVAL.search(holes), holes  # rank 0 is never offered for removal
    holes = validate_scale(8, current_size=6, topology=ScaleTopology(max_ep_size=8,
                           launch_size=6), failed_ranks=[1]).message
    assert REMOVAL.search(holes), holes


def test_refusals_while_holes_are_open_name_the_refill_that_is_accepted() -> None:
    """While removed ranks leave holes, every refused size names the size that refills them,
    and that size is accepted (a scale-up into the holes)."""
    walked = 0
    for serving in range(2, 7):
        for holes in itertools.chain.from_iterable(
                itertools.combinations(range(1, serving + 2), k) for k in (1, 2)):
            for target in range(1, serving + len(holes) + 3):
                verdict = judge_with_holes(target, serving, holes)
                if verdict is None or verdict.ok:
                    continue
                walked += 1
                (size,) = map(int, re.findall(r"new_ep_size (\d+)", verdict.message))
                again = judge_with_holes(size, serving, holes)
                assert again is not None and again.ok and again.refills_holes, \
                    (serving, holes, target, verdict.message)
    assert walked > 0


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=repr)
def test_no_removal_refusal_recommends_an_action_the_same_state_refuses(
    topology: ScaleTopology,
) -> None:
    """The same walk for ``remove_ranks``: every set of one or two ranks, from states with
    failed ranks or an open hole (a removed launch-time rank), with one or two launch-time
    ranks per node."""
    launch = topology.launch_size or 0
    walked = 0
    for (current, failed), per_node in itertools.product(states(topology), (1, 2)):
        open_holes = [()] + [(h,) for h in range(1, min(current, launch)) if h not in failed]
        removal_args = dict(failed=failed, launch_size=launch,
                            attn_replica_size=topology.attn_replica_size,
                            min_size=topology.min_ep_size, ranks_per_node=per_node)
        for holes, k in itertools.product(open_holes, (1, 2)):
            for ranks in itertools.combinations(range(current + 1), k):
                verdict = resolve_removal(ranks, current, removed=holes, **removal_args)
                if isinstance(verdict, int) or verdict.ok:
                    continue
                walked += 1
                state = (current, failed, holes, ranks, verdict.message)
                for suggested in map(json.loads, REMOVAL.findall(verdict.message)):
                    again = resolve_removal(suggested, current, removed=holes, **removal_args)
                    assert isinstance(again, int) or again.ok, (state, again)
                    if isinstance(again, int):  # a tail: judged as that size
                        size_verdict = judge_with_holes(again - len(holes), current - len(holes),
                                                        holes) or validate_scale(
                            again, current_size=current, topology=topology,
                            failed_ranks=failed)
                        assert size_verdict.ok, (state, size_verdict.message)
                for size in map(int, re.findall(r"new_ep_size (\d+)", verdict.message)):
                    size_verdict = judge_with_holes(size - len(holes), current - len(holes),
                                                    holes) if holes else None
                    size_verdict = size_verdict or validate_scale(
                        size, current_size=current, topology=topology, failed_ranks=failed)
                    assert size_verdict.ok, (state, size_verdict.message)
                if "recover" in verdict.message:
                    assert failed or holes, state
                    assert holes or relaunch_brings_back(current, failed, launch), state
    assert walked > 0

"""A launch-time rank that failed, before or after a scale, rejoins in place
(``sglang/launch_recovery``): which ranks the survivors wait for, and the exchange that picks
the expert map's source and tells the replacement the size the survivors serve on."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import launch_recovery, replica_loading


def survivor(mask: list[int], *, effective: int = 3, launch: int = 2, scaled: bool = True,
             pending: int | None = None) -> SimpleNamespace:
    tensor = torch.tensor(mask, dtype=torch.int32)
    return SimpleNamespace(active_ranks=tensor.clone(), active_ranks_cpu=tensor,
                           effective_ep_size=effective, original_ep_size=launch,
                           has_scaled=scaled, pending_ep_size=pending)


def test_survivors_wait_for_failed_launch_ranks_before_and_after_a_scale() -> None:
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 1, 0])) == (1,)
    # before any scale too (upstream's per-rank take-back is not agreed); during a scale
    # nothing is taken back
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 1, 0], effective=3, launch=3,
                                                    scaled=False)) == (1,)
    assert launch_recovery.ranks_to_rejoin(survivor([1, 0, 1, 0], pending=4)) == ()
    # a failed scale-joined tail is let go of instead (tail_recovery)
    assert launch_recovery.ranks_to_rejoin(survivor([1, 1, 0, 0])) == ()


class WorldOfRanks:
    """``dist`` for one all-reduce of the rows every member writes (SUM over the members)."""

    def __init__(self, rank: int, others: dict[int, tuple[int, int, int]]) -> None:
        self.rank, self.others = rank, others
        self.group = SimpleNamespace(WORLD="world")

    def get_rank(self) -> int:
        return self.rank

    def all_reduce(self, rows: torch.Tensor, group: Any = None) -> None:
        assert group == "world"
        for rank, row in self.others.items():
            rows[rank] += torch.tensor(row, dtype=rows.dtype)


def test_the_first_healthy_rank_sends_the_map_and_a_replacement_learns_the_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    monkeypatch.setattr(launch_recovery, "take_on_serving_size",
                        lambda state, size: taken.append(size))
    healthy, rejoining = launch_recovery.HEALTHY, launch_recovery.REJOINING
    # rank 1 rejoins; ranks 0 and 2 serve on 3
    replacement = survivor([0, 1, 0, 0], effective=4, launch=4)
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: replacement)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {0: (healthy, 3, 0),
                                                                   2: (healthy, 3, 0)}))
    upstream = pytest.fail  # never asked while elastic EP is set up
    assert launch_recovery.healthy_source_rank(
        upstream, invoked_in_elastic_ep_rejoin_path=True) == 0
    assert taken == [3]
    # a survivor: the same source, and nothing taken on
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: survivor([1, 0, 1, 0]))
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(2, {0: (healthy, 3, 0),
                                                                   1: (rejoining, 0, 0)}))
    assert launch_recovery.healthy_source_rank(
        upstream, invoked_in_elastic_ep_rejoin_path=False) == 0
    assert taken == [3]


def test_a_replacement_waits_with_the_survivors_for_a_let_go_tail(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep.sglang import tail_recovery

    monkeypatch.setattr(launch_recovery, "take_on_serving_size",
                        lambda state, size: setattr(state, "effective_ep_size", size))
    # rank 1 and the scale joiner at rank 2 failed together; rank 0 let go of slot 2 and
    # serves on 2, waiting for slot 2's replacement to return to 3
    survivor_state = survivor([1, 0, 0, 0], effective=2)
    tail_recovery.await_the_tail_with_the_survivors(survivor_state, 3)
    assert tail_recovery.awaited_return(survivor_state) == 3
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: survivor_state)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(0, {1: (launch_recovery.REJOINING,
                                                                      0, 0)}))
    assert launch_recovery.healthy_source_rank(
        pytest.fail, invoked_in_elastic_ep_rejoin_path=False) == 0
    # rank 1's replacement learns both: the size, and the tail the survivors wait for
    replacement = survivor([0, 1, 0, 0], effective=2, launch=2)
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: replacement)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {0: (launch_recovery.HEALTHY,
                                                                      2, 3)}))
    assert launch_recovery.healthy_source_rank(
        pytest.fail, invoked_in_elastic_ep_rejoin_path=True) == 0
    machine = tail_recovery.tail_recovery_state(replacement).machine
    assert machine is not None and machine.awaiting_replacement
    assert (machine.first_failed, machine.return_to) == (2, 3)


def test_no_healthy_member_is_an_error_naming_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: survivor([0, 1, 0, 0]))
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {}))
    with pytest.raises(RuntimeError, match="every member of WORLD is rejoining"):
        launch_recovery.healthy_source_rank(pytest.fail, invoked_in_elastic_ep_rejoin_path=True)


def test_without_elastic_ep_state_upstreams_exchange_runs(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: None)
    assert launch_recovery.healthy_source_rank(
        lambda **kwargs: 7, invoked_in_elastic_ep_rejoin_path=False) == 7


def test_a_replacement_reloads_its_experts_only_when_its_slots_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[tuple[str, str, list[str]]] = []
    names = ["model.layers.0.mlp.experts.3.w1.weight", "model.layers.0.self_attn.q.weight"]

    def update_weights_from_disk(path: str, load_format: str, weight_name_filter: Any
                                 ) -> tuple[bool, str]:
        loads.append((path, load_format, [n for n in names if weight_name_filter(n)]))
        return ok.value, "disk unreadable"

    ok = SimpleNamespace(value=True)
    runner = SimpleNamespace(model_config=SimpleNamespace(model_path="/models/m"),
                             load_config=SimpleNamespace(load_format="auto"),
                             weight_updater=SimpleNamespace(
                                 update_weights_from_disk=update_weights_from_disk))
    now = [[0, 1, 2, 3]]
    monkeypatch.setattr(replica_loading, "own_slots", lambda rank: now)
    replica_loading.reload_moved_experts(runner, 1, [[0, 1, 2, 3]])
    assert loads == []  # the survivors' map kept its slots: nothing to load
    replica_loading.reload_moved_experts(runner, 1, [[0, 1, 3, 2]])
    assert loads == [("/models/m", "auto", ["model.layers.0.mlp.experts.3.w1.weight"])]
    ok.value = False
    with pytest.raises(RuntimeError, match="2 moved slots failed: disk unreadable"):
        replica_loading.reload_moved_experts(runner, 1, [[0, 1, 3, 2]])


@pytest.fixture
def taking_on(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """``take_on_serving_size``'s surroundings: each local step it takes is appended to
    ``done``; ``parallel`` holds the process's launch arguments, ``metadata`` its expert map."""
    from sglang.srt import runtime_context
    from sglang.srt.elastic_ep import elastic_ep

    seen = SimpleNamespace(done=[], parallel=SimpleNamespace(elastic_ep_initial_size=2,
                                                             tp_size=2),
                           metadata=SimpleNamespace(num_physical_experts=32,
                                                    physical_to_logical_map=torch.zeros(
                                                        (2, 32), dtype=torch.int64)))
    done = seen.done
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: seen.parallel)
    monkeypatch.setattr(runtime_context, "get_context", lambda: SimpleNamespace(
        override=lambda name, **kw: done.append(("override", kw["ep_size"]))))
    monkeypatch.setattr(elastic_ep, "update_dp_attention_for_elastic_ep",
                        lambda **kw: done.append(("dp", kw["physical_ep_size"],
                                                  kw["physical_ep_rank"])))
    manager = SimpleNamespace(_on_scale=object(),
                              on_scale=lambda old, new: done.append(("nixl", old, new)))
    monkeypatch.setattr(launch_recovery, "state_manager", lambda: manager)
    monkeypatch.setattr(launch_recovery, "mark_ranks_activated",
                        lambda ranks: done.append(("activated", list(ranks))))
    monkeypatch.setattr(launch_recovery, "mark_ranks_drained",
                        lambda ranks: done.append(("drained", list(ranks))))
    monkeypatch.setattr(launch_recovery, "expert_location_metadata", lambda: seen.metadata)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {}))
    return seen


def test_a_replacement_takes_on_the_survivors_size_before_the_map_is_broadcast(
        taking_on: SimpleNamespace) -> None:
    done, metadata = taking_on.done, taking_on.metadata
    # registered WORLD at the high water (3): upstream made that its size, and the launch's
    replacement = survivor([0, 1, 0, 0], effective=3, launch=3, scaled=False)
    launch_recovery.take_on_serving_size(replacement, 3)
    assert tuple(metadata.physical_to_logical_map.shape) == (2, 48)  # 16 slots x 3 ranks
    assert (replacement.effective_ep_size, replacement.original_ep_size,
            replacement.has_scaled) == (3, 2, True)
    assert done == [("override", 3), ("dp", 3, 1), ("activated", [0, 1, 2]), ("nixl", 2, 3)]
    # before any scale: upstream's recovery as it is
    done.clear()
    never_scaled = survivor([0, 1, 0, 0], effective=2, launch=2, scaled=False)
    launch_recovery.take_on_serving_size(never_scaled, 2)
    assert done == [] and never_scaled.has_scaled is False
    # launched at 3, the survivors serve on 2 after a shrink: its buffer drops released rank 2
    taking_on.parallel = SimpleNamespace(elastic_ep_initial_size=3, tp_size=3)
    metadata.num_physical_experts = 48
    metadata.physical_to_logical_map = torch.zeros((2, 48), dtype=torch.int64)
    after_a_shrink = survivor([0, 1, 0, 0], effective=3, launch=3, scaled=False)
    launch_recovery.take_on_serving_size(after_a_shrink, 2)
    assert tuple(metadata.physical_to_logical_map.shape) == (2, 32)
    assert done == [("override", 2), ("dp", 2, 1), ("activated", [0, 1]), ("drained", [2]),
                    ("nixl", 3, 2)]


def test_a_scale_joined_slots_replacement_takes_on_the_survivors_size_from_its_own(
        taking_on: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2's replacement (a scale joiner at offset 2, which upstream starts at size 3) is
    taken back in place by survivors serving on 4 ranks: its map grows from 3 ranks' slots to
    4's, and its launch-time boundary stays the deployment's (2), not its own size."""
    taking_on.parallel = SimpleNamespace(elastic_ep_initial_size=2, tp_size=1)
    taking_on.metadata.num_physical_experts = 48
    taking_on.metadata.physical_to_logical_map = torch.zeros((2, 48), dtype=torch.int64)
    monkeypatch.setattr(launch_recovery, "adopt_launch_group_size", lambda state: None)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(2, {}))
    done, metadata = taking_on.done, taking_on.metadata
    replacement = survivor([0, 0, 1, 0], effective=3, launch=2, scaled=True)
    replacement.ep_join_rank_offset = 2
    launch_recovery.take_on_serving_size(replacement, 4)
    assert tuple(metadata.physical_to_logical_map.shape) == (2, 64)  # 16 slots x 4 ranks
    assert (replacement.effective_ep_size, replacement.original_ep_size) == (4, 2)
    assert done == [("override", 4), ("dp", 4, 2), ("activated", [0, 1, 2, 3]), ("nixl", 3, 4)]


def test_the_survivor_machine_follows_the_failed_set_and_the_agreed_rejoin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = SimpleNamespace(original_ep_size=3, effective_ep_size=3)
    peer: dict[int, bool] = {1: True}
    monkeypatch.setattr(launch_recovery, "world_members_alive",
                        lambda ranks: [peer[r] for r in ranks])
    # the pass right after the kill: Mooncake still reports the dead process
    assert launch_recovery.replacements_registered(state, (1,)) is False
    peer[1] = False
    assert launch_recovery.replacements_registered(state, (1,)) is False
    peer[1] = True  # its replacement registered
    assert launch_recovery.replacements_registered(state, (1,)) is True
    machine = launch_recovery.launch_recovery_machine(state, (1,))
    assert machine.phase is Phase.SERVING_DEGRADED
    # another launch-time rank fails before the rejoin: rank 1's replacement stays counted
    peer[2] = False
    assert launch_recovery.replacements_registered(state, (1, 2)) is False
    peer[2] = True
    assert launch_recovery.replacements_registered(state, (1, 2)) is True
    assert launch_recovery.launch_recovery_machine(state, (1, 2)) is not machine


def test_the_replacement_machine_follows_its_rejoin_and_the_reload(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = SimpleNamespace()
    slots = iter([[[0, 1]], [[1, 0]]])  # at launch, then in the survivors' map
    reloads: list[Any] = []
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: state)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {}))
    monkeypatch.setattr(launch_recovery, "own_slots", lambda rank: next(slots))
    monkeypatch.setattr(launch_recovery, "reload_moved_experts",
                        lambda runner, rank, loaded: reloads.append(
                            (loaded, launch_recovery.replacement_machine(state).phase)))
    prepared: list[tuple[str, bool]] = []
    monkeypatch.setattr(launch_recovery, "prepare_data_plane",
                        lambda model, connect: prepared.append((model, connect)))

    def rejoin(runner: Any) -> str:
        machine = launch_recovery.replacement_machine(state)
        assert machine is not None and machine.phase is Phase.REJOINING
        assert prepared == [("model", False)]  # its buffer exists before the survivors' pass
        return "rejoined"

    runner = SimpleNamespace(model="model")
    assert launch_recovery.rejoin_then_reload_moved_experts(rejoin, runner) == "rejoined"
    assert reloads == [([[0, 1]], Phase.RESTORING_EXPERTS)]
    assert prepared == [("model", False)]  # it connects at its first dispatch, as the survivors
    machine = launch_recovery.replacement_machine(state)
    assert machine is not None and machine.rank == 1 and machine.phase is Phase.SERVING_RECOVERED


def test_a_replacement_whose_rejoin_raises_ends_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    state = SimpleNamespace()
    monkeypatch.setattr(launch_recovery, "elastic_state", lambda: state)
    monkeypatch.setattr(launch_recovery, "dist", WorldOfRanks(1, {}))
    monkeypatch.setattr(launch_recovery, "own_slots", lambda rank: None)
    monkeypatch.setattr(launch_recovery, "prepare_data_plane", lambda model, connect: False)

    def rejoin(runner: Any) -> None:
        raise RuntimeError("group registration was rejected")

    with pytest.raises(RuntimeError, match="registration was rejected"):
        launch_recovery.rejoin_then_reload_moved_experts(rejoin, SimpleNamespace(model=None))
    machine = launch_recovery.replacement_machine(state)
    assert machine is not None and machine.phase is Phase.FAILED
    assert machine.error == "RuntimeError: group registration was rejected"


def test_survivors_announce_a_joiner_below_a_live_rank_in_place_and_withdraw_it_once_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched at 2, grown to 4; ranks 1 and 2 failed below the live rank 3: the survivors
    tell rank 2's replacement (a scale joiner by its arguments) that they await it in place at
    4 ranks; the launch-time rank 1 needs no notice."""
    from sglang_elastic_ep.sglang import replacement_notices

    values: dict[str, str] = {}
    store = SimpleNamespace(set=values.__setitem__, check=lambda keys: all(k in values
                                                                            for k in keys),
                            get=lambda key: values[key].encode(),
                            delete_key=lambda key: values.pop(key, None) is not None)
    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: store)
    state = SimpleNamespace(original_ep_size=2, effective_ep_size=4)
    launch_recovery.launch_recovery_machine(state, (1, 2))
    assert (replacement_notices.in_place_size(2), replacement_notices.in_place_size(1)) == (4, 0)
    replacement_notices.withdraw_in_place([2])  # as the survivors do once it is back
    assert replacement_notices.in_place_size(2) == 0 and values == {}

"""The control plane's topology comes from SGLang 0.5.23's server args (attn_dp_size)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.core.api_models import OperationKind
from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import tokenizer_hooks
from sglang_elastic_ep.sglang.http_state import HttpAdapterState, attach_adapter_state
from sglang_elastic_ep.sglang.server_mount import topology_from_args
from sglang_elastic_ep.sglang.upstream_engine import UpstreamEngine
from sglang_elastic_ep_testbed.cluster.waits import wait_until

pytestmark = pytest.mark.usefixtures("fake_io_struct")


def test_one_rank_per_attention_replica_with_dp_attention() -> None:
    # what 0.5.23 resolves `--tp 2 --dp 2 --enable-dp-attention --max-ep-size 4` to
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=2, max_ep_size=4)
    topology, ep_size = topology_from_args(args)
    assert ep_size == 2 and topology.max_ep_size == 4 and topology.attn_replica_size == 1


@pytest.mark.parametrize(("nnodes", "per_node"), [(None, 4), (1, 4), (2, 2), (4, 1)])
def test_the_launch_ranks_are_split_evenly_over_the_nodes(nnodes: int | None,
                                                          per_node: int) -> None:
    args = SimpleNamespace(tp_size=4, dp_size=1, attn_dp_size=4, max_ep_size=8, nnodes=nnodes)
    assert topology_from_args(args)[0].ranks_per_node == per_node


def test_without_attention_dp_the_whole_tp_group_is_one_replica() -> None:
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=1, max_ep_size=None)
    topology, ep_size = topology_from_args(args)
    assert ep_size == 2 and topology.max_ep_size == 2 and topology.attn_replica_size == 2


def test_the_tokenizer_managers_replica_size_wins_over_server_args() -> None:
    # the HTTP process's args read as one 2-rank replica; the tokenizer manager knows better
    args = SimpleNamespace(tp_size=2, dp_size=1, attn_dp_size=None, max_ep_size=4)
    assert topology_from_args(args)[0].attn_replica_size == 2
    topology, ep_size = topology_from_args(args, replica_size=1)
    assert ep_size == 2 and topology.attn_replica_size == 1


def test_liveness_reports_act_only_on_a_change() -> None:
    """Schedulers report after every batch; a repeat of the same view does nothing."""
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=2
    )
    tm = SimpleNamespace(attn_replica_size=1, rid_to_state={})
    status = SimpleNamespace(status=[True, False, False])
    tokenizer_hooks.mirror_active_ranks(None, tm, status)  # not mounted: nothing happens
    assert plane.health().checks == 0
    attach_adapter_state(tm, HttpAdapterState(plane=plane))
    for _ in range(3):
        tokenizer_hooks.mirror_active_ranks(None, tm, status)
    assert plane.health().checks == 1
    assert [e.type for e in plane.events.since(0).events] == ["rank_failed", "recovery_required"]
    tokenizer_hooks.mirror_active_ranks(None, tm, SimpleNamespace(status=[True, True, False]))
    assert plane.events.since(0).events[-1].type == "rank_recovered"


def test_a_slot_counted_in_by_a_commit_and_reported_down_since_is_failed() -> None:
    """The joiner died on its admission pass: every report reads the same before and after the
    commit that counted its slot in; the slot is failed once the HTTP side has the new size."""
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.membership import Membership
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=2
    )
    tm = SimpleNamespace(attn_replica_size=1, rid_to_state={})
    attach_adapter_state(tm, HttpAdapterState(plane=plane))
    status = SimpleNamespace(status=[True, True, False, False])
    tokenizer_hooks.mirror_active_ranks(None, tm, status)
    assert plane.events.since(0).events == []
    plane.set_membership(Membership(max_size=4, effective_size=3))  # the commit to 3
    tokenizer_hooks.mirror_active_ranks(None, tm, status)
    assert [e.type for e in plane.events.since(0).events][:1] == ["rank_failed"]
    assert [r.state for r in plane.status().ranks][:3] == ["active", "active", "failed"]


def test_a_leaving_shard_going_inactive_is_no_failure_and_drain_stragglers_end_with_503() -> None:
    """During a scale-down 3 -> 2 the released shard 2 reports inactive: no rank_failed, and
    nothing it ran counts as lost. Requests still running there at the drain timeout end with
    503 and a reason; finished ones are left alone."""
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.api_models import ScaleRequest
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=3
    )
    asyncio.run(plane.request_scale(ScaleRequest(new_ep_size=2, operation_id="shrink")))
    adapter = HttpAdapterState(plane=plane)
    router = adapter.router
    aborted: list[object] = []
    tm = SimpleNamespace(attn_replica_size=1, rid_to_state={"slow": object()},
                         server_args=SimpleNamespace(elastic_ep_drain_timeout=7.0),
                         _handle_abort_req=aborted.append)
    attach_adapter_state(tm, adapter)
    router.track(2, "done", tm.rid_to_state)
    router.track(2, "slow", tm.rid_to_state)
    router.start_drain({2})

    engine = UpstreamEngine(tm, adapter)
    assert engine._end_drain_stragglers(frozenset({2})) == 1
    (abort,) = aborted
    assert abort.rid == "slow" and abort.finished_reason["status_code"] == 503
    assert "--elastic-ep-drain-timeout (7 s)" in abort.abort_message
    del tm.rid_to_state["slow"]  # what the abort does

    # Released once drained: its going inactive loses nothing and fails nothing.
    tokenizer_hooks.mirror_active_ranks(None, tm, SimpleNamespace(status=[True, True, False]))
    assert [e.type for e in plane.events.since(0).events] == ["scale_requested"]
    assert len(aborted) == 1 and router.leaving_down == frozenset({2})


def test_a_leaving_shard_that_dies_mid_drain_ends_its_requests_with_503_at_once() -> None:
    """Shard 2 drains and goes inactive while it still runs a request: it died (a released
    shard holds none). The request ends at once with the lost-with-shard 503, not at the drain
    timeout; being a leaving shard, it raises no rank_failed."""
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.api_models import ScaleRequest
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=3
    )
    asyncio.run(plane.request_scale(ScaleRequest(new_ep_size=2, operation_id="shrink")))
    adapter = HttpAdapterState(plane=plane)
    aborted: list[object] = []
    tm = SimpleNamespace(attn_replica_size=1, rid_to_state={"slow": object()},
                         _handle_abort_req=aborted.append)
    attach_adapter_state(tm, adapter)
    adapter.router.track(2, "slow", tm.rid_to_state)
    adapter.router.start_drain({2})
    tokenizer_hooks.mirror_active_ranks(None, tm, SimpleNamespace(status=[True, True, False]))
    (abort,) = aborted
    assert abort.rid == "slow" and abort.finished_reason["status_code"] == 503
    assert "failed before it finished" in abort.abort_message
    # A survivor one pass behind still reports shard 2 up: it stays left out of the drain
    # confirmation's fan-out, and nothing fails or recovers.
    tokenizer_hooks.mirror_active_ranks(None, tm, SimpleNamespace(status=[True, True, True]))
    assert adapter.router.leaving_down == frozenset({2}) and len(aborted) == 1
    assert [e.type for e in plane.events.since(0).events] == ["scale_requested"]


class FakeTokenizerManager:
    """What UpstreamEngine uses of SGLang's TokenizerManager; schedulers answer ``answer``."""

    def __init__(self, answer: object) -> None:
        self.attn_replica_size = 1
        self.elastic_worker_count = 3
        self.fan_outs: list[int] = []
        self.asked: list[int] = []
        self.answer = answer
        self.phase = Phase.SERVING_EXPANDED.value
        self.rid_to_state: dict[str, object] = {}
        self.server_args = SimpleNamespace(elastic_ep_drain_timeout=120.0)

    def update_control_communicator_fan_out(self, worker_count: int) -> None:
        self.fan_outs.append(worker_count)

    async def scale_elastic_ep(self, obj: object) -> object:
        self.asked.append(obj.new_ep_size)
        if self.answer.success:  # rank 0 reports the commit right after
            self.phase = Phase.SERVING_CONTRACTED.value
        return self.answer

    def get_elastic_ep_state(self) -> dict:
        return {"scale_phase": self.phase, "last_error": None}


def _removal(answer: object) -> tuple[object, FakeTokenizerManager, object]:
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.api_models import ScaleRequest
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=3
    )
    plane.report_rank_failed([2], "process exited")
    tm = FakeTokenizerManager(answer)
    plane._engine = UpstreamEngine(tm, HttpAdapterState(plane=plane))

    async def remove() -> object:
        result = await plane.request_scale(ScaleRequest(new_ep_size=2, operation_id="cut"))
        # Polled from a thread: the watcher commits on this loop meanwhile.
        await asyncio.to_thread(wait_until, lambda: plane.status().current_operation is None,
                                60, "the removal finished", 0.05)
        return result

    return asyncio.run(remove()), tm, plane


def test_removing_a_failed_tail_asks_only_the_live_schedulers_and_drains_nothing() -> None:
    """vLLM's rule: with a failed rank inside the size, the one scale-down allowed removes
    exactly it. Its scheduler cannot answer, so the request goes to the live ones only."""
    ok = SimpleNamespace(success=True, message="failed ranks 2..2 removed",
                         pending_ep_size=2, scale_phase="releasing")
    answer, tm, plane = _removal(ok)
    assert answer.status == 200, answer
    assert tm.fan_outs == [2] and tm.asked == [2]  # asked once: no drain confirmation
    status = plane.status()
    assert status.effective_ep_size == 2, status
    assert status.recent_operations[0].result == "succeeded", status
    assert [r.state.value for r in status.ranks][:3] == ["active", "active", "safe_to_terminate"]


def test_a_refused_removal_changes_nothing() -> None:
    refused = SimpleNamespace(success=False, message="the survivors still hold rank 2's slot",
                              pending_ep_size=None, scale_phase="serving_expanded")
    answer, tm, plane = _removal(refused)
    assert answer.status == 422, answer
    assert "still hold" in answer.response.message
    assert tm.fan_outs == [2, 3]  # restored
    status = plane.status()
    assert status.effective_ep_size == 3 and status.ranks[2].state.value == "failed"


def test_a_scale_down_past_a_failed_joiner_below_a_live_one_drains_the_live_ones_only(
) -> None:
    """Launched at 2, grown to 4; joiner 2 failed below the live joiner 3. The scale-down to
    2 drains shard 3 while shard 2 counts as dead from the start: neither the request nor the
    drain confirmation waits for rank 2's scheduler, and the commit lists both safe to
    terminate."""
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.api_models import ScaleRequest
    from sglang_elastic_ep.core.validation import ScaleTopology

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1, launch_size=2),
        initial_ep_size=4)
    plane.report_rank_failed([2], "process exited")
    ok = SimpleNamespace(success=True, message="draining", pending_ep_size=2,
                         scale_phase="draining")
    tm = FakeTokenizerManager(ok)
    tm.elastic_worker_count = 4
    confirmed: list[int] = []

    async def confirm(obj: object) -> list[object]:
        confirmed.append(obj.new_ep_size)
        tm.phase = Phase.SERVING_CONTRACTED.value  # rank 0 reports the commit right after
        return [ok, ok, ok]

    tm.scale_elastic_ep_communicator = confirm
    adapter = HttpAdapterState(plane=plane)
    plane._engine = UpstreamEngine(tm, adapter)

    async def shrink() -> object:
        answer = await plane.request_scale(ScaleRequest(new_ep_size=2, operation_id="past"))
        assert adapter.router.leaving == {2, 3} and adapter.router.leaving_down == {2}
        tm.phase = Phase.DRAINING.value  # the schedulers drain until the confirmation
        await asyncio.to_thread(wait_until, lambda: plane.status().current_operation is None,
                                60, "the scale-down finished", 0.05)
        return answer

    answer = asyncio.run(shrink())
    assert answer.status == 200, answer
    assert tm.asked == [2] and confirmed == [2]
    assert tm.fan_outs == [3, 4, 3, 4]  # the live three, for the request and the confirmation
    status = plane.status()
    assert status.effective_ep_size == 2 and status.recent_operations[0].result == "succeeded"
    assert [r.state.value for r in status.ranks] == ["active", "active", "safe_to_terminate",
                                                     "safe_to_terminate"]


def test_control_plane_is_the_one_mounted_on_the_servers_tokenizer_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    from types import ModuleType

    from sglang_elastic_ep.sglang.http_state import control_plane

    name = "sglang.srt.entrypoints.http_server"
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert control_plane() is None  # no HTTP server in this process
    tm = SimpleNamespace()
    server = ModuleType(name)
    server.get_global_state = lambda: SimpleNamespace(tokenizer_manager=tm)
    monkeypatch.setitem(sys.modules, name, server)
    assert control_plane() is None  # elastic EP off: nothing mounted
    plane = object()
    attach_adapter_state(tm, HttpAdapterState(plane=plane))
    assert control_plane() is plane


SHRINK_3_TO_2 = SimpleNamespace(kind=OperationKind.SCALE_DOWN, old_ep_size=3, new_ep_size=2,
                                ranks=(2,), operation_id="shrink")


def _draining(answer: object, dead: int) -> tuple[FakeTokenizerManager, UpstreamEngine,
                                                   HttpAdapterState]:
    """An engine draining shard 2 of 3 whose shard ``dead`` died meanwhile; the live
    schedulers answer the confirmation with ``answer``."""
    tm = FakeTokenizerManager(answer)
    tm.scale_elastic_ep_communicator = lambda obj: asyncio.sleep(0, [answer, answer])
    adapter = HttpAdapterState(plane=None)
    engine = UpstreamEngine(tm, adapter)
    adapter.router.start_drain({2})
    adapter.router.mark_down({dead}, in_flight=set())
    return tm, engine, adapter


def test_a_drain_confirmation_awaits_only_the_live_schedulers() -> None:
    """A leaving shard that died mid-drain cannot answer the confirmation: only the live
    schedulers are awaited, and the fan-out is restored after (the commit sets its own)."""
    tm, engine, adapter = _draining(SimpleNamespace(success=True, message="confirmed"), dead=2)
    asyncio.run(engine._confirm_drain(SHRINK_3_TO_2))
    assert tm.fan_outs == [2, 3]
    adapter.router.forget([2])
    asyncio.run(engine._confirm_drain(SHRINK_3_TO_2))  # every shard alive: left alone
    assert tm.fan_outs == [2, 3]


def test_a_drain_confirmation_after_a_staying_shard_died_awaits_only_the_live_ones() -> None:
    """A staying rank killed mid-drain: the schedulers call the scale-down off, and the
    confirmation sent once the leaving shard drained gets their answer (saying so) instead of
    waiting for the dead one until it times out."""
    called_off = SimpleNamespace(success=False, message="scale-down to 2 called off: a "
                                 "staying rank failed during the drain")
    tm, engine, _ = _draining(called_off, dead=1)
    with pytest.raises(RuntimeError, match="a staying rank failed during the drain"):
        asyncio.run(engine._confirm_drain(SHRINK_3_TO_2))
    assert tm.fan_outs == [2, 3]


def test_a_confirmation_whose_answer_was_lost_ends_when_the_schedulers_commit() -> None:
    """A leaving rank answered and exited at once, and its answer never reached the HTTP
    process: the schedulers commit anyway, and the confirmation ends on the reported commit
    instead of failing the scale-down after SCHEDULER_ANSWER_TIMEOUT_S."""
    tm = FakeTokenizerManager(SimpleNamespace(success=True, message=""))
    tm.phase = Phase.DRAINING.value
    never: asyncio.Future[list[object]] | None = None

    async def lost_answer(obj: object) -> list[object]:
        nonlocal never
        never = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.5, setattr, tm, "phase",
                                              Phase.SERVING_CONTRACTED.value)
        return await never

    tm.scale_elastic_ep_communicator = lost_answer
    engine = UpstreamEngine(tm, HttpAdapterState(plane=None))
    asyncio.run(engine._confirm_drain(SHRINK_3_TO_2))
    assert never is not None and never.cancelled()


def test_a_phase_left_from_an_earlier_operation_does_not_end_the_wait_for_answers() -> None:
    refused = SimpleNamespace(success=False, message="scale-down to 2 called off: a staying "
                              "rank failed during the drain")
    tm = FakeTokenizerManager(refused)
    tm.phase = Phase.SERVING_CONTRACTED.value  # the last scale-down's, not yet overwritten

    async def slow_answers(obj: object) -> list[object]:
        await asyncio.sleep(0.6)  # a few of the watcher's polls
        return [refused, refused, refused]

    tm.scale_elastic_ep_communicator = slow_answers
    engine = UpstreamEngine(tm, HttpAdapterState(plane=None))
    with pytest.raises(RuntimeError, match="a staying rank failed during the drain"):
        asyncio.run(engine._confirm_drain(SHRINK_3_TO_2))


def test_a_failed_confirmation_reports_the_schedulers_own_reason_once_they_called_off(
) -> None:
    tm = FakeTokenizerManager(SimpleNamespace(success=True, message=""))
    engine = UpstreamEngine(tm, HttpAdapterState(plane=None))
    timeout = RuntimeError("the drain confirmation got no answer from 3 schedulers")
    assert engine._why_failed(timeout) == str(timeout)  # still draining: its own error
    tm.phase = Phase.FAILED.value
    tm.get_elastic_ep_state = lambda: {"scale_phase": tm.phase, "last_error": "scale-down to 2 "
                                       "called off: a staying rank failed during the drain"}
    assert "a staying rank failed during the drain" in engine._why_failed(timeout)


def test_a_live_removal_drains_its_shard_sends_its_ranks_and_leaves_a_hole() -> None:
    from sglang_elastic_ep.api.control_plane import InProcessControlPlane
    from sglang_elastic_ep.core.api_models import ScaleRequest
    from sglang_elastic_ep.core.validation import ScaleTopology
    from sglang_elastic_ep.sglang.removal_request import removal_size

    plane = InProcessControlPlane(
        topology=ScaleTopology(max_ep_size=4, attn_replica_size=1), initial_ep_size=3
    )
    ok = SimpleNamespace(success=True, message="draining", pending_ep_size=3,
                         scale_phase="draining")
    tm = FakeTokenizerManager(ok)
    confirmations: list[int] = []

    async def confirm(obj: object) -> list[object]:
        confirmations.append(obj.new_ep_size)
        return [ok, ok, ok]

    tm.scale_elastic_ep_communicator = confirm
    adapter = HttpAdapterState(plane=plane)
    plane._engine = UpstreamEngine(tm, adapter)

    async def remove() -> object:
        result = await plane.request_scale(ScaleRequest(remove_ranks=[1], operation_id="rm"))
        await asyncio.to_thread(wait_until, lambda: plane.status().current_operation is None,
                                60, "the removal finished", 0.05)
        return result

    answer = asyncio.run(remove())
    assert answer.status == 200, answer
    # The ranks travel as the size upstream's struct carries; the drain is confirmed with the
    # same request (nothing ran on shard 1 here).
    assert tm.asked == [removal_size([1])] and confirmations == [removal_size([1])]
    assert adapter.router.down == frozenset({1}) and not adapter.router.leaving
    assert {adapter.router.pick(3) for _ in range(4)} == {0, 2}
    status = plane.status()
    assert status.effective_ep_size == 2 and status.recent_operations[0].result == "succeeded"
    assert [r.state.value for r in status.ranks][:3] == ["active", "safe_to_terminate", "active"]


def test_a_committed_removal_is_read_from_rank_0s_update_with_the_same_size() -> None:
    from sglang_elastic_ep.sglang.tokenizer_hooks import apply_scale_update

    tm = SimpleNamespace(attn_replica_size=1, elastic_worker_count=3, elastic_pending_ep_size=3,
                         elastic_scale_phase="draining", elastic_last_error=None)
    upstream: list[object] = []
    removal = SimpleNamespace(success=True, effective_ep_size=3, slot_count=0)
    assert apply_scale_update(lambda t, m: upstream.append(m), tm, removal) is None
    assert upstream == [] and tm.elastic_worker_count == 3
    assert (tm.elastic_pending_ep_size, tm.elastic_scale_phase) == (None, "serving_contracted")
    grow = SimpleNamespace(success=True, effective_ep_size=4, slot_count=1)
    apply_scale_update(lambda t, m: upstream.append(m), tm, grow)
    assert upstream == [grow]  # a scale-up is upstream's

"""Scheduler-side scale-down decisions that need no cluster: who is ready, and the idle step's
place in the loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_elastic_ep.sglang import scale_down
from sglang_elastic_ep.sglang.scale_down import (
    ScaleDownState,
    holds_no_request,
    is_shrink,
    scale_down_state,
)


class Batch:
    def __init__(self, size: int) -> None:
        self.size = size

    def is_empty(self) -> bool:
        return self.size == 0


def scheduler(running: int = 0, waiting: int = 0, chunked: object = None) -> SimpleNamespace:
    return SimpleNamespace(running_batch=Batch(running), waiting_queue=[object()] * waiting,
                           chunked_req=chunked)


def test_a_scheduler_holds_no_request_only_when_nothing_runs_waits_or_is_chunked() -> None:
    assert holds_no_request(scheduler())
    assert not holds_no_request(scheduler(running=1))
    assert not holds_no_request(scheduler(waiting=2))
    assert not holds_no_request(scheduler(chunked=object()))


def test_staying_ranks_are_ready_at_once_leaving_ones_after_a_confirmed_drain() -> None:
    state = SimpleNamespace(pending_ep_size=2, effective_ep_size=3)
    down = ScaleDownState()
    assert is_shrink(state)
    assert down.ready_to_shrink(state, rank=0) == 2 and down.ready_to_shrink(state, rank=1) == 2
    # Leaving rank 2: empty scheduler, but the HTTP process has not confirmed the drain (a
    # request it routed there may still be on its way).
    down.scheduler = scheduler()
    assert down.ready_to_shrink(state, rank=2) == 0
    down.drain_confirmed = True
    assert down.ready_to_shrink(state, rank=2) == 2
    down.scheduler = scheduler(running=1)
    assert down.ready_to_shrink(state, rank=2) == 0  # confirmed, but still finishing one


def test_no_shrink_pending_means_nothing_to_be_ready_for() -> None:
    assert not is_shrink(SimpleNamespace(pending_ep_size=None, effective_ep_size=3))
    assert not is_shrink(SimpleNamespace(pending_ep_size=4, effective_ep_size=3))  # a scale-up
    idle = SimpleNamespace(pending_ep_size=None, effective_ep_size=3)
    assert ScaleDownState().ready_to_shrink(idle, 2) == 0


def test_one_scale_down_state_per_elastic_ep_state() -> None:
    state = SimpleNamespace(pending_ep_size=None, effective_ep_size=3)
    down = scale_down_state(state)
    assert scale_down_state(state) is down
    assert scale_down_state(SimpleNamespace()) is not down


def test_the_idle_step_runs_only_when_no_rank_has_a_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It follows get_next_batch_to_run, whose answer the DP-attention all-gather makes the same
    on every rank (on_idle is skipped by the overlap loop right after a batch)."""
    from sglang_elastic_ep.sglang import scale_progress

    calls: list[str] = []
    runner = SimpleNamespace(maybe_join_ep_ranks=lambda: calls.append("step"))
    sched = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=runner),
                            _maybe_report_active_ranks=lambda: calls.append("report"))
    monkeypatch.setattr(scale_progress, "elastic_state", lambda: object())
    monkeypatch.setattr(scale_progress, "lockstep_agreement_on", lambda state, parallel: True)
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: object())
    scale_progress.progress_membership_when_idle(SimpleNamespace(batch_to_run=object()), sched)
    assert calls == []
    scale_progress.progress_membership_when_idle(SimpleNamespace(batch_to_run=None), sched)
    assert calls == ["step", "report"]


def test_a_server_is_stopped_only_when_every_one_of_its_ranks_leaves() -> None:
    from sglang_elastic_ep.sglang.tail_release import first_rank_of_server

    # A joiner at offset 2 (ranks 2..): its own server.
    assert first_rank_of_server(is_joiner=True, join_offset=2, node_rank=0, ranks_per_node=1) == 2
    # Node 1 of a 2-node launch with 2 ranks per node serves ranks 2 and 3.
    assert first_rank_of_server(is_joiner=False, join_offset=0, node_rank=1, ranks_per_node=2) == 2
    # Node 0 always holds rank 0, which never leaves.
    assert first_rank_of_server(is_joiner=False, join_offset=0, node_rank=0, ranks_per_node=2) == 0


def test_a_drain_confirmation_read_after_the_commit_is_recognised() -> None:
    committed = SimpleNamespace(pending_ep_size=None, effective_ep_size=2)
    down = ScaleDownState(committed_shrink=2)
    assert down.is_late_drain_confirmation(committed, 2)
    assert not down.is_late_drain_confirmation(committed, 1)  # a new request: not late
    pending = SimpleNamespace(pending_ep_size=2, effective_ep_size=3)
    assert not down.is_late_drain_confirmation(pending, 2)  # still draining
    down.committed_shrink = None
    assert not down.is_late_drain_confirmation(committed, 2)  # no shrink committed


def test_a_shrink_below_two_attention_dp_ranks_is_refused() -> None:
    message = scale_down.too_few_dp_ranks(True, 1, 1)
    assert message is not None and "keep at least 2 ranks" in message
    assert scale_down.too_few_dp_ranks(True, 2, 1) is None
    assert scale_down.too_few_dp_ranks(True, 2, 2) is not None  # one replica of two ranks
    assert scale_down.too_few_dp_ranks(False, 1, 1) is None  # no attention DP: no such limit

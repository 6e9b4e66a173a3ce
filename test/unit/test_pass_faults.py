"""A peer that fails during a forward: the pass is flagged (not for ranks a membership step
retires on purpose), and a flagged pass's requests end with 503 and stay out of the cache."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.sglang import pass_faults
from sglang_elastic_ep.sglang.pass_faults import (
    PEER_FAILED_DURING_FORWARD,
    RESULT_ATTR,
    end_requests_of_a_faulted_pass,
    forward_watched,
    model_forward_done,
    ranks_lost,
)


def test_only_a_rank_going_inactive_counts() -> None:
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    assert bool(ranks_lost(mask, torch.tensor([1, 0, 1, 0], dtype=torch.int32)))
    assert not bool(ranks_lost(mask, mask.clone()))
    assert not bool(ranks_lost(mask, torch.tensor([1, 1, 1, 1], dtype=torch.int32)))  # joined
    assert not bool(ranks_lost(mask, torch.tensor([1, 1, 1], dtype=torch.int32)))


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    made = SimpleNamespace(active_ranks=torch.tensor([1, 1, 1, 0], dtype=torch.int32))
    monkeypatch.setattr(pass_faults, "elastic_state", lambda: made)
    monkeypatch.setattr(pass_faults, "elastic_ep_enabled", lambda: True)
    return made


def run_forward(state: SimpleNamespace, *, dies: int | None = None,
                retires: int | None = None) -> Any:
    """One ``forward_batch_generation``: a peer dies in the model's forward (the data plane
    masks it), then the pass's membership step (which first tells the watch) may retire one."""

    def forward(worker: object) -> SimpleNamespace:
        if dies is not None:
            state.active_ranks[dies] = 0
        if retires is not None:
            model_forward_done(state)  # what agreed_join_step does before the step
            state.active_ranks[retires] = 0
        return SimpleNamespace()

    return forward_watched(forward, object())


def test_a_peer_dying_in_the_forward_flags_the_pass(state: SimpleNamespace) -> None:
    assert not bool(getattr(run_forward(state), RESULT_ATTR))
    assert bool(getattr(run_forward(state, dies=2), RESULT_ATTR))
    # The next pass starts with the rank already inactive: not flagged again.
    assert not bool(getattr(run_forward(state), RESULT_ATTR))
    assert pass_faults.pass_fault_watch(state).before is None  # nothing kept between passes


def test_ranks_a_membership_step_retires_are_no_fault(state: SimpleNamespace) -> None:
    assert not bool(getattr(run_forward(state, retires=2), RESULT_ATTR))
    state.active_ranks[2] = 1
    assert bool(getattr(run_forward(state, dies=1, retires=2), RESULT_ATTR))


def test_without_elastic_ep_the_forward_is_upstreams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pass_faults, "elastic_ep_enabled", lambda: False)
    result = forward_watched(lambda worker: SimpleNamespace(), object())
    assert not hasattr(result, RESULT_ATTR)


class Req:
    def __init__(self, finished: bool = False) -> None:
        self._finished = finished
        self.to_finish = None
        self.skip_radix_cache_insert = False

    def finished(self) -> bool:
        return self._finished


class Abort:
    """Stands in for upstream's ``FINISH_ABORT`` (its module needs the CPU engine's shims;
    ``test/integration/test_pass_faults_upstream.py`` uses the real one)."""

    def __init__(self, message: str, status_code: int) -> None:
        self.message, self.status_code = message, status_code


@pytest.mark.parametrize("lost", [True, False])
def test_a_flagged_pass_ends_its_requests_with_503_out_of_the_cache(
    lost: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pass_faults, "abort_reason",
                        lambda: Abort(PEER_FAILED_DURING_FORWARD, 503))
    order: list[str] = []
    reqs = [Req(), Req(), Req(finished=True)]
    result = SimpleNamespace(copy_done=SimpleNamespace(synchronize=lambda: order.append("sync")))
    setattr(result, RESULT_ATTR, torch.tensor(lost))

    def process(processor: object, batch: Any, got: Any) -> str:
        order.append("processed")
        return "done"

    batch = SimpleNamespace(reqs=reqs)
    assert end_requests_of_a_faulted_pass(process, object(), batch, result) == "done"
    assert order == ["sync", "processed"]  # the flag is read only after upstream's own wait
    if lost:
        for req in reqs[:2]:
            assert req.to_finish.status_code == 503
            assert req.to_finish.message == PEER_FAILED_DURING_FORWARD
            assert req.skip_radix_cache_insert
    else:
        assert all(r.to_finish is None and not r.skip_radix_cache_insert for r in reqs)
    assert reqs[2].to_finish is None  # already finished: left alone


def test_a_result_without_the_flag_is_processed_as_is() -> None:
    reqs = [Req()]
    out = end_requests_of_a_faulted_pass(lambda p, b, r: "done", object(),
                                         SimpleNamespace(reqs=reqs), SimpleNamespace())
    assert out == "done" and reqs[0].to_finish is None


def test_the_testbed_tells_both_fault_503s_by_their_messages() -> None:
    from sglang_elastic_ep.sglang.tokenizer_hooks import LOST_WITH_SHARD
    from sglang_elastic_ep_testbed.cluster.load import LOST_TO_A_FAULT, RequestResult

    for message in (PEER_FAILED_DURING_FORWARD, LOST_WITH_SHARD.format(ranks=[1])):
        assert RequestResult("p", 0.0, 1.0, 503, error=message).lost_to_a_fault
        assert any(phrase in message for phrase in LOST_TO_A_FAULT)
    assert not RequestResult("p", 0.0, 1.0, 503, error="drain timed out").lost_to_a_fault
    assert not RequestResult("p", 0.0, 1.0, 500, error=PEER_FAILED_DURING_FORWARD).lost_to_a_fault


def test_a_kill_may_cost_each_client_its_request_and_the_next() -> None:
    from sglang_elastic_ep_testbed.cluster.load import most_lost_to_a_kill

    assert [most_lost_to_a_kill(c) for c in (1, 2, 6)] == [2, 4, 12]

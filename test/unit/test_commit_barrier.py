"""The scale-up's commit barrier agrees whether every joiner is still in Mooncake's WORLD."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_elastic_ep.sglang import commit_barrier
from sglang_elastic_ep.sglang.commit_barrier import (
    CountedOutOfWorld,
    agree_at_commit,
    agreed_commit_barrier,
    serving_rank_commit,
)


def summing(others: int, sent: list[int]) -> Callable[[int], int]:
    """The all-reduce of the barrier: this rank's value plus what the other members sent."""
    def reduce(value: int) -> int:
        sent.append(value)
        return value + others

    return reduce


def test_every_member_counting_every_joiner_in_lets_the_commit_go_ahead() -> None:
    sent: list[int] = []
    assert agree_at_commit([2], lambda ranks: False, summing(0, sent)) is True
    assert sent == [0]


def test_a_rank_that_counts_a_joiner_out_turns_every_member_the_same_way() -> None:
    sent: list[int] = []
    asked: list[Sequence[int]] = []

    def counts_out(ranks: Sequence[int]) -> bool:
        asked.append(tuple(ranks))
        return True

    assert agree_at_commit([2, 3], counts_out, summing(0, sent)) is False
    assert sent == [1] and asked == [(2, 3)]
    # A rank that counts them in reads the same sum when another member counted them out.
    assert agree_at_commit([2, 3], lambda ranks: False, summing(1, [])) is False


def test_a_joiner_adds_nothing_and_asks_nothing() -> None:
    sent: list[int] = []

    def never(ranks: Sequence[int]) -> bool:
        raise AssertionError("a joiner does not judge itself")

    assert agree_at_commit((), never, summing(0, sent)) is True
    assert sent == [0]
    assert agree_at_commit((), never, summing(2, [])) is False


class FakeState(SimpleNamespace):
    def sync_active_to_cpu(self) -> None:
        self.active_ranks_cpu = self.active_ranks.clone()


@pytest.fixture
def barrier(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A fake rank at EP size 2 going to 3: ``commit()`` runs upstream's ``_finalize_scale_up``
    (the barrier, then the commit) as a serving rank, ``join()`` the barrier as a joiner."""
    calls: list[Any] = []
    state = FakeState(active_ranks=torch.tensor([1, 1, 1, 0], dtype=torch.int32),
                      active_ranks_cpu=torch.tensor([1, 1, 1, 0], dtype=torch.int32),
                      effective_ep_size=2)
    env = SimpleNamespace(state=state, calls=calls, alive=[True], others=0, enabled=True,
                          sent=[], runner=SimpleNamespace(model="model"), told=[])
    monkeypatch.setattr(commit_barrier, "elastic_ep_enabled", lambda: env.enabled)
    monkeypatch.setattr(commit_barrier, "elastic_state", lambda: env.state)
    monkeypatch.setattr(commit_barrier, "prepare_data_plane",
                        lambda model, *, connect: calls.append(("connect", connect)))
    monkeypatch.setattr(commit_barrier, "world_members_alive",
                        lambda ranks: [env.alive[i] for i, _ in enumerate(ranks)])
    monkeypatch.setattr(commit_barrier, "_world_sum", lambda like: summing(env.others, env.sent))
    monkeypatch.setattr(commit_barrier.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(commit_barrier.replacement_notices, "announce_counted_out",
                        lambda ranks: env.told.append(list(ranks)))

    def join() -> Any:
        return agreed_commit_barrier(lambda *a, **k: calls.append("upstream barrier"),
                                     env.runner, target_size=3, log_tag="JOINER")

    def finalize_scale_up(runner: Any) -> None:
        """Upstream's: the barrier, then the commit (the new size, every slot of it live)."""
        agreed_commit_barrier(lambda *a, **k: calls.append("upstream barrier"), runner,
                              target_size=3, log_tag="PRIMARY")
        calls.append("commit")
        state.effective_ep_size = 3
        state.active_ranks[:3] = 1
        state.sync_active_to_cpu()

    env.join = join
    env.commit = lambda: serving_rank_commit(finalize_scale_up, env.runner)
    return env


def test_the_barrier_connects_then_agrees_instead_of_upstreams_barrier(
        barrier: SimpleNamespace) -> None:
    barrier.commit()
    assert barrier.calls == [("connect", True), "commit"] and barrier.sent == [0]
    assert barrier.state.active_ranks.tolist() == [1, 1, 1, 0]
    assert barrier.state.active_ranks_cpu.tolist() == [1, 1, 1, 0]


def test_a_joiner_counted_out_is_marked_failed_after_the_commit(
        barrier: SimpleNamespace) -> None:
    barrier.alive = [False]
    barrier.commit()
    assert barrier.sent == [1]
    assert barrier.calls[-1] == "commit" and barrier.state.effective_ep_size == 3
    assert barrier.state.active_ranks.tolist() == [1, 1, 0, 0]
    assert barrier.state.active_ranks_cpu.tolist() == [1, 1, 0, 0]
    assert barrier.told == [[2]]  # a joiner still in join_group reads it and exits
    # Marked once: the next scale-up's commit starts clean.
    barrier.alive, barrier.state.effective_ep_size = [True], 2
    barrier.commit()
    assert barrier.state.active_ranks.tolist() == [1, 1, 1, 0] and barrier.told == [[2]]


def test_a_notice_that_cannot_be_written_still_lets_the_joiners_slot_go(
        barrier: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def store_gone(ranks: Sequence[int]) -> None:
        raise ConnectionError("store gone")

    monkeypatch.setattr(commit_barrier.replacement_notices, "announce_counted_out", store_gone)
    barrier.alive = [False]
    with caplog.at_level("WARNING"):
        barrier.commit()
    assert barrier.state.active_ranks_cpu.tolist() == [1, 1, 0, 0]
    assert "could not tell joiners [2] they were counted out" in caplog.text


def test_another_rank_counting_the_joiner_out_marks_it_failed_here_too(
        barrier: SimpleNamespace) -> None:
    barrier.others = 1
    barrier.commit()
    assert barrier.sent == [0]
    assert barrier.state.active_ranks_cpu.tolist() == [1, 1, 0, 0] and barrier.told == [[2]]


def test_a_joiner_the_serving_ranks_counted_out_stops_with_the_way_back(
        barrier: SimpleNamespace) -> None:
    barrier.others = 1
    with pytest.raises(CountedOutOfWorld, match="--ep-join-mode recover"):
        barrier.join()
    assert barrier.sent == [0]
    barrier.others = 0
    assert barrier.join() is None


def test_a_rank_that_joined_earlier_serves_in_the_next_scale_up(
        barrier: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's joiner flag stays set on a process that joined once; inside
    ``_finalize_scale_up`` it is a serving rank: it judges the joiners and does not raise."""
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace(
        moe=SimpleNamespace(is_ep_scale_joiner=True, is_ep_joiner=True)))
    barrier.alive = [False]
    barrier.commit()
    assert barrier.sent == [1] and barrier.calls[-1] == "commit"
    assert barrier.state.active_ranks_cpu.tolist() == [1, 1, 0, 0]


def test_without_elastic_ep_upstreams_barrier_runs(barrier: SimpleNamespace) -> None:
    barrier.enabled = False
    barrier.join()
    assert barrier.calls == ["upstream barrier"] and barrier.sent == []

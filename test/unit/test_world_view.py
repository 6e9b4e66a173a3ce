"""Around a Mooncake WORLD view change: the members meet before it, and each waits for the new
view before the next collective."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_elastic_ep.sglang.world_view import (
    ReplacementGone,
    WorldQuiesce,
    propose_then_wait_for_view,
    queue_ready_unless_gone,
    quiesce_key,
    store_barrier,
    wait_for_local_view,
    wait_for_peers_in_world,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_an_applied_view_costs_no_wait() -> None:
    clock = FakeClock()
    waited = wait_for_local_view(lambda: [1, 1, 1, 0], [2], clock=clock, sleep=clock.sleep)
    assert waited == 0.0


def test_waits_until_the_view_shows_every_admitted_rank() -> None:
    clock = FakeClock()
    views = iter([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    waited = wait_for_local_view(lambda: next(views), [3], poll_s=0.5, clock=clock,
                                 sleep=clock.sleep)
    assert waited == 1.0


def test_a_view_that_never_comes_times_out() -> None:
    clock = FakeClock()
    waited = wait_for_local_view(lambda: [1, 1, 0, 0], [2, 3], timeout_s=2.0, poll_s=0.5,
                                 clock=clock, sleep=clock.sleep)
    assert waited is None
    assert clock.now == 2.0


def test_the_wait_ends_once_an_admitted_rank_is_gone() -> None:
    clock = FakeClock()
    offline = iter([False, False, True])
    waited = wait_for_local_view(lambda: [1, 1, 0, 0], [2], poll_s=0.5, clock=clock,
                                 sleep=clock.sleep, gone=lambda: next(offline))
    assert waited is None
    assert clock.now == 1.0  # two polls, not the 60 s timeout


PROPOSAL_TIMEOUT = ("mooncakePgCommActivateRanks failed: RPC error: "
                    "mooncake::CoordinatorRpcService::proposeViewUpdate RPC failed: time out")


def test_an_admission_waits_for_the_view_after_the_proposal() -> None:
    calls: list[str] = []
    admitted = propose_then_wait_for_view(lambda: calls.append("propose") or True,
                                          lambda: calls.append("view") or 0.5, [2])
    assert admitted == (True, 0.5) and calls == ["propose", "view"]


def test_ranks_not_registered_yet_are_not_admitted_and_no_view_is_awaited() -> None:
    def view() -> float:
        raise AssertionError("no view to wait for")

    assert propose_then_wait_for_view(lambda: False, view, [2]) == (False, None)


def test_a_failed_own_proposal_goes_on_when_the_view_shows_the_admission(
        caplog: pytest.LogCaptureFixture) -> None:
    """The others' proposals made the change: this rank is in their view."""
    def propose() -> bool:
        raise RuntimeError(PROPOSAL_TIMEOUT)

    assert propose_then_wait_for_view(propose, lambda: 0.0, [2]) == (True, 0.0)
    assert "view shows them admitted" in caplog.text and "time out" in caplog.text


def test_a_failed_own_proposal_raises_when_the_view_lacks_the_admission() -> None:
    def propose() -> bool:
        raise RuntimeError(PROPOSAL_TIMEOUT)

    with pytest.raises(RuntimeError, match="proposeViewUpdate RPC failed"):
        propose_then_wait_for_view(propose, lambda: None, [2])


def test_a_rank_beyond_the_view_is_not_active() -> None:
    clock = FakeClock()
    assert wait_for_local_view(lambda: [1, 1], [2], timeout_s=0.0, clock=clock,
                               sleep=clock.sleep) is None


# ------------------------------------------------------------ the quiesce barrier before a change


def _real_store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))


def _cross(store: Any, key: str, parties: int, timeout_s: float,
           arriving: int | None = None) -> list[bool]:
    """``arriving`` of the ``parties`` (all by default) meet at ``key``, each on its own client
    as each rank has (one client blocks while it waits)."""
    from torch.distributed import TCPStore

    count = parties if arriving is None else arriving
    clients = [TCPStore("127.0.0.1", store.port, is_master=False,
                        timeout=timedelta(seconds=10)) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda client: store_barrier(client, key, parties, timeout_s),
                             clients))


def test_every_member_passes_once_all_arrived() -> None:
    store = _real_store()
    assert _cross(store, "k", 3, 10.0) == [True, True, True]


def test_the_same_key_can_be_crossed_again() -> None:
    store = _real_store()
    assert _cross(store, "k", 2, 10.0) == [True, True]
    assert _cross(store, "k", 2, 10.0) == [True, True]
    assert store.add("k", 0) == 4


def test_crossing_a_key_again_and_again_keeps_one_done_key() -> None:
    store = _real_store()
    keys_at_start = store.num_keys()
    for _ in range(5):
        assert _cross(store, "k", 2, 10.0) == [True, True]
    # The counter and the last crossing's done key; the earlier done keys were dropped.
    assert store.num_keys() - keys_at_start == 2
    assert store.check(["k/done-5"]) and not store.check(["k/done-4"])


def test_a_member_that_never_comes_times_the_others_out_and_the_next_crossing_needs_all() -> None:
    store = _real_store()
    # Two of three members arrive, the third died on the way: both time out. The crossing
    # they gave up on is passed over, so the next one needs all three again.
    assert _cross(store, "k", 3, 0.2, arriving=2) == [False, False]
    assert _cross(store, "k", 3, 0.2, arriving=2) == [False, False]
    assert _cross(store, "k", 3, 10.0) == [True, True, True]


def test_a_member_that_comes_after_the_others_gave_up_gives_up_too() -> None:
    store = _real_store()
    assert _cross(store, "k", 2, 0.2, arriving=1) == [False]
    # The last member arrives once the first gave up: it does not go ahead alone.
    assert _cross(store, "k", 2, 0.2, arriving=1) == [False]
    assert _cross(store, "k", 2, 10.0) == [True, True]


def test_a_last_member_that_comes_as_the_wait_times_out_is_met() -> None:
    from torch.distributed import TCPStore

    store = _real_store()
    waiter = TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    last_member: list[bool] = []

    class LastArrivalAtTheTimeout:
        """The waiter's store, on which the last member arrives as the wait times out."""

        def __getattr__(self, name: str) -> Any:
            return getattr(waiter, name)

        def wait(self, keys: list[str], timeout: timedelta) -> None:
            last_member.append(store_barrier(store, "k", 2, 10.0))
            raise RuntimeError("wait timeout")

    # Both see the crossing met: the last member decided it before the waiter could give up.
    assert store_barrier(LastArrivalAtTheTimeout(), "k", 2, 0.2) is True
    assert last_member == [True]


def test_the_last_arrival_does_not_wait() -> None:
    store = _real_store()
    store.add("k", 1)  # the first member arrived earlier
    assert store_barrier(store, "k", 2, timeout_s=0.0) is True


def test_a_barrier_of_nobody_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one party"):
        store_barrier(_real_store(), "k", 0, 1.0)


def test_each_change_gets_its_own_key() -> None:
    admit = quiesce_key("admit", [1, 0], [2])
    assert admit == "elastic-ep/quiesce/admit/members-0,1/ranks-2"
    assert quiesce_key("admit", [0, 1, 2], [3]) != admit
    assert quiesce_key("release", [0, 1], [2]) != admit


def test_armed_members_are_used_by_one_change_only() -> None:
    quiesce = WorldQuiesce()
    quiesce.arm([2, 0, 1])
    assert quiesce.take() == (0, 1, 2)
    assert quiesce.take() == ()


def test_a_change_without_an_agreed_step_meets_nobody() -> None:
    # No members armed: upstream's own path, so no store is asked (none exists here).
    WorldQuiesce().before_view_change("admit", [2])


@pytest.fixture
def quiesce_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A real rendezvous store as ``get_global_tcp_store`` returns it, this process as rank 0,
    and a short barrier timeout."""
    import sglang.srt.distributed.utils as distributed_utils

    from sglang_elastic_ep.sglang import world_view

    store = _real_store()
    monkeypatch.setattr(distributed_utils, "get_global_tcp_store", lambda: store)
    monkeypatch.setattr(world_view.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(world_view, "QUIESCE_TIMEOUT_S", 0.2)
    return store


def test_an_admission_backs_out_when_a_member_never_comes(quiesce_store: Any) -> None:
    quiesce = WorldQuiesce()
    quiesce.arm([0, 1])
    assert quiesce.before_view_change("admit", [2], back_out=True) is False
    assert quiesce.take_backed_out() is True
    assert quiesce.take_backed_out() is False  # told once


def test_a_deactivation_goes_ahead_when_a_member_never_comes(quiesce_store: Any) -> None:
    quiesce = WorldQuiesce()
    quiesce.arm([0, 1])
    assert quiesce.before_view_change("release", [1]) is True
    assert quiesce.take_backed_out() is False


def test_a_met_barrier_lets_the_admission_go_ahead(quiesce_store: Any) -> None:
    from torch.distributed import TCPStore

    other = TCPStore("127.0.0.1", quiesce_store.port, is_master=False,
                     timeout=timedelta(seconds=10))
    other.add(quiesce_key("admit", [0, 1], [2]), 1)  # rank 1 arrived first
    quiesce = WorldQuiesce()
    quiesce.arm([1, 0])
    assert quiesce.before_view_change("admit", [2], back_out=True) is True
    assert quiesce.take_backed_out() is False


def test_arming_the_next_step_forgets_an_earlier_back_out(quiesce_store: Any) -> None:
    quiesce = WorldQuiesce()
    quiesce.arm([0, 1])
    quiesce.before_view_change("admit", [2], back_out=True)
    quiesce.arm([0, 1])
    assert quiesce.take_backed_out() is False


def test_an_admission_that_backed_out_proposes_nothing(
        quiesce_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep.sglang import world_view

    state = SimpleNamespace()
    monkeypatch.setattr(world_view, "elastic_state", lambda: state)
    world_view.world_quiesce(state).arm([0, 1])
    proposed: list[list[int]] = []
    assert world_view.admit_then_wait_for_view(
        lambda ranks: proposed.append(ranks) or True, [2]) is False
    assert proposed == []  # upstream's "not yet": a later pass proposes it


def test_the_group_wait_ends_when_the_replacement_registers() -> None:
    ready = iter([False, False, True])
    polls: list[float] = []
    wait_for_peers_in_world(lambda: next(ready), [1], lambda ranks: [True] * len(ranks),
                            sleep=polls.append)
    assert len(polls) == 2


def test_the_group_wait_gives_up_on_a_replacement_world_counts_out() -> None:
    views = iter([[True, True], [True, False]])
    polls: list[float] = []
    with pytest.raises(ReplacementGone, match=r"ranks \[3\] left Mooncake's WORLD"):
        wait_for_peers_in_world(lambda: False, [1, 3], lambda ranks: next(views),
                                sleep=polls.append)
    assert len(polls) == 1  # one poll while both were still in WORLD, none after



class QueueSocket:
    """One zmq socket of a message queue: each message arrives after ``delay`` empty polls."""

    def __init__(self, messages: list[bytes], delay: int = 0) -> None:
        self.messages, self.delay, self.empty_polls, self.sent = list(messages), delay, 0, []

    def poll(self, timeout_ms: int) -> int:
        if not self.messages or self.empty_polls < self.delay:
            self.empty_polls += 1
            return 0
        self.empty_polls = 0
        return 1

    def recv(self) -> bytes:
        return self.messages.pop(0)

    def send(self, message: bytes) -> None:
        self.sent.append(message)


def message_queue(role: str, local: QueueSocket, remote: QueueSocket, n_local: int = 0,
                  n_remote: int = 0) -> SimpleNamespace:
    return SimpleNamespace(_is_writer=role == "writer", _is_local_reader=role == "local",
                           _is_remote_reader=role == "remote", local_socket=local,
                           remote_socket=remote, n_local_reader=n_local,
                           n_remote_reader=n_remote)


def test_the_queue_writer_answers_ready_once_every_reader_subscribed() -> None:
    local, remote = QueueSocket([b"sub"]), QueueSocket([b"sub", b"sub"], delay=3)
    asked: list[int] = []
    queue_ready_unless_gone(message_queue("writer", local, remote, n_local=1, n_remote=2),
                            lambda: asked.append(1) or [])
    assert (local.sent, remote.sent) == ([b"READY"], [b"READY"])
    assert len(asked) == 6  # asked WORLD on each empty poll, never gave up


def test_the_queue_wait_gives_up_once_a_member_left_world() -> None:
    remote = QueueSocket([b"sub"], delay=10)
    views = iter([[], [], [1]])
    with pytest.raises(ReplacementGone, match=r"ranks \[1\] left Mooncake's WORLD"):
        queue_ready_unless_gone(message_queue("writer", QueueSocket([]), remote, n_remote=1),
                                lambda: next(views))
    assert remote.sent == [] and remote.messages == [b"sub"]


def test_a_queue_reader_waits_for_ready() -> None:
    remote = QueueSocket([b"READY"], delay=2)
    queue_ready_unless_gone(message_queue("remote", QueueSocket([]), remote), lambda: [])
    assert remote.messages == []
    with pytest.raises(RuntimeError, match="expected READY"):
        queue_ready_unless_gone(message_queue("local", QueueSocket([b"junk"]), remote),
                                lambda: [])

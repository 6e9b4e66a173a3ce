"""The driver of a scale joiner's machine (sglang/scale_up_joiner.py): upstream's start-up steps,
each one's end told to the machine, and a step that raises."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang import scale_up_joiner
from sglang_elastic_ep.sglang.scale_up_joiner import commit_joining, join_world, joiner_machine


@pytest.fixture
def joiner_process(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A scale joiner for EP rank 2 of 3 (one attention-TP rank), with upstream's state."""
    import sglang.srt.runtime_context as runtime_context

    state = SimpleNamespace()
    moe = SimpleNamespace(elastic_ep_backend="mooncake", is_ep_scale_joiner=True)
    monkeypatch.setattr(scale_up_joiner, "elastic_state", lambda: state)
    monkeypatch.setattr(runtime_context, "get_exec", lambda: SimpleNamespace(moe=moe))
    monkeypatch.setattr(runtime_context, "get_parallel",
                        lambda: SimpleNamespace(ep_join_rank_offset=2, tp_size=1, tp_rank=0))
    return moe


RUNNER = SimpleNamespace(_elastic_global_rank=lambda: 2)


def phase() -> str:
    machine = joiner_machine()
    return "none" if machine is None else machine.phase.value


def test_each_step_of_the_start_up_moves_the_joiner_on(joiner_process: SimpleNamespace) -> None:
    steps: list[str] = []
    join_world(lambda: steps.append(f"in join_group: {phase()}"))
    steps.append(f"after admission: {phase()}")
    commit_joining(lambda runner, size: steps.append(f"barrier for {size}: {phase()}"),
                   RUNNER, 3)
    assert steps == ["in join_group: pending", "after admission: joining",
                     "barrier for 3: syncing_new_world"]
    machine = joiner_machine()
    assert machine is not None and machine.phase is Phase.SERVING_EXPANDED
    assert list(machine.ranks) == [2] and machine.new_size == 3


def test_a_step_that_raises_fails_the_joiner_and_the_error_goes_on(
        joiner_process: SimpleNamespace) -> None:
    def join_group() -> None:
        raise RuntimeError("group registration was rejected")

    with pytest.raises(RuntimeError, match="registration was rejected"):
        join_world(join_group)
    machine = joiner_machine()
    assert machine is not None and machine.phase is Phase.FAILED
    assert machine.error == "RuntimeError: group registration was rejected"


def test_a_failed_commit_barrier_fails_the_admitted_joiner(
        joiner_process: SimpleNamespace) -> None:
    join_world(lambda: None)

    def barrier(runner: Any, size: int) -> None:
        raise RuntimeError("barrier peer gone")

    with pytest.raises(RuntimeError, match="barrier peer gone"):
        commit_joining(barrier, RUNNER, 3)
    machine = joiner_machine()
    assert machine is not None and machine.phase is Phase.FAILED
    assert Phase.JOINING in machine.seconds_in_phases()


def test_a_process_that_is_not_a_scale_joiner_gets_no_machine(
        joiner_process: SimpleNamespace) -> None:
    joiner_process.is_ep_scale_joiner = False
    assert join_world(lambda: "joined") == "joined"
    assert joiner_machine() is None
    # Without a machine the commit hook passes straight through.
    assert commit_joining(lambda runner, size: size, RUNNER, 3) == 3


def test_a_joiner_reloads_its_experts_when_the_serving_ranks_map_moved_them(
        joiner_process: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded for its start-up layout (e.g. the launch placement of a released launch slot),
    served with the map the serving ranks broadcast: reloaded before the barrier."""
    maps = {"start-up": [[12, 13, 4, 5]], "broadcast": [[0, 1, 2, 3]]}
    current = ["start-up"]
    steps: list[Any] = []
    monkeypatch.setattr(scale_up_joiner, "own_slots", lambda rank: maps[current[0]])
    monkeypatch.setattr(scale_up_joiner, "reload_moved_experts",
                        lambda runner, rank, loaded: steps.append(("reload", rank, loaded)))

    def join_group() -> None:
        current[0] = "broadcast"  # the map arrives after the admission

    join_world(join_group)
    commit_joining(lambda runner, size: steps.append(("barrier", size)), RUNNER, 3)
    assert steps == [("reload", 2, [[12, 13, 4, 5]]), ("barrier", 3)]


@pytest.fixture
def start_up(monkeypatch: pytest.MonkeyPatch, joiner_process: SimpleNamespace) -> list[str]:
    """The steps a joiner's start-up takes, as the hooks call them."""
    steps: list[str] = []
    monkeypatch.setattr(scale_up_joiner, "prepare_data_plane",
                        lambda model, *, connect: steps.append(f"buffer of {model}"))
    monkeypatch.setattr(scale_up_joiner, "_apply_join_topology",
                        lambda runner, state: steps.append("topology of size 3"))
    monkeypatch.setattr(scale_up_joiner, "_register_and_join", lambda runner: join_world(
        lambda: steps.append(f"register and join: {phase()}")))
    return steps


PREPARING_RUNNER = SimpleNamespace(_elastic_global_rank=lambda: 2, model="model",
                                   is_draft_worker=False)


def test_a_joiner_without_graphs_prepares_then_joins_at_the_commit(
        monkeypatch: pytest.MonkeyPatch, start_up: list[str]) -> None:
    monkeypatch.setattr(scale_up_joiner, "_joins_at_the_commit", lambda: True)
    scale_up_joiner.prepare_then_join(lambda runner: start_up.append("upstream's join"),
                                      PREPARING_RUNNER)
    assert start_up == ["buffer of model", "topology of size 3"]
    assert phase() == "none"  # not registered: the serving ranks know nothing of it yet
    start_up.append("KV cache")
    commit_joining(lambda runner, size: start_up.append(f"barrier for {size}: {phase()}"),
                   PREPARING_RUNNER, 3)
    assert start_up == ["buffer of model", "topology of size 3", "KV cache",
                        "register and join: pending", "barrier for 3: syncing_new_world"]
    assert phase() == "serving_expanded"


def test_a_joiner_that_joins_first_still_prepares_its_buffer_before_registering(
        monkeypatch: pytest.MonkeyPatch, start_up: list[str]) -> None:
    monkeypatch.setattr(scale_up_joiner, "_joins_at_the_commit", lambda: False)
    scale_up_joiner.prepare_then_join(lambda runner: start_up.append("upstream's join"),
                                      PREPARING_RUNNER)
    assert start_up == ["buffer of model", "upstream's join"]
    commit_joining(lambda runner, size: start_up.append("barrier"), PREPARING_RUNNER, 3)
    assert start_up[-1] == "barrier" and "register and join: pending" not in start_up


def test_a_replacement_below_a_live_rank_rejoins_in_place_instead_of_joining(
        monkeypatch: pytest.MonkeyPatch, start_up: list[str]) -> None:
    """The survivors serve on 4 ranks and await rank 2 in place (rank 3 serves above it): its
    replacement registers no cohort and meets no commit barrier; at the commit point it runs
    upstream's rejoin, as a launch-time rank's replacement does."""
    import sglang.srt.layers.dp_attention as dp_attention

    from sglang_elastic_ep.sglang import replacement_notices

    monkeypatch.setattr(scale_up_joiner, "_joins_at_the_commit", lambda: True)
    monkeypatch.setattr(dp_attention, "enable_joiner_all_gather",
                        lambda: start_up.append("gathers over WORLD"))
    store = FakeStore()
    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: store)
    replacement_notices.announce_in_place([2], 4)
    runner = SimpleNamespace(**vars(PREPARING_RUNNER), post_capture_elastic_ep_recover=lambda:
                             start_up.append("upstream's rejoin"))
    scale_up_joiner.prepare_then_join(lambda r: start_up.append("upstream's join"), runner)
    start_up.append("KV cache")
    commit_joining(lambda r, size: start_up.append("barrier"), runner, 3)
    assert start_up == ["buffer of model", "gathers over WORLD", "KV cache", "upstream's rejoin"]
    assert phase() == "none"  # never a scale joiner's admission


def test_a_process_that_is_not_a_scale_joiner_prepares_nothing(
        start_up: list[str], joiner_process: SimpleNamespace) -> None:
    joiner_process.is_ep_scale_joiner = False
    scale_up_joiner.prepare_then_join(lambda runner: start_up.append("upstream"),
                                      PREPARING_RUNNER)
    assert start_up == ["upstream"]


@pytest.mark.parametrize(("env", "graphs_off", "deferred"),
                         [(None, True, True), ("0", True, False), ("1", False, False)])
def test_the_join_waits_for_the_commit_only_without_graphs_and_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch, env: str | None, graphs_off: bool,
        deferred: bool) -> None:
    import sglang.srt.model_executor.cuda_graph_config as graph_config

    monkeypatch.setattr(graph_config, "cuda_graph_fully_disabled", lambda: graphs_off)
    if env is None:
        monkeypatch.delenv(scale_up_joiner.PREPARE_ENV, raising=False)
    else:
        monkeypatch.setenv(scale_up_joiner.PREPARE_ENV, env)
    assert scale_up_joiner._joins_at_the_commit() is deferred


def test_a_joiner_never_admitted_exits_at_the_scale_timeout_with_the_reason(
        joiner_process: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Mooncake's join_group has no timeout: a joiner whose scale-up was called off waits
    there until its watchdog ends the process (here a fake exit that releases the wait)."""
    import functools
    import threading

    released = threading.Event()
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        released.set()

    monkeypatch.setattr(scale_up_joiner, "scale_timeout_s", lambda: 0.05)
    monkeypatch.setattr(scale_up_joiner, "AdmissionWatchdog", functools.partial(
        scale_up_joiner.AdmissionWatchdog, exit_process=fake_exit))
    with caplog.at_level("ERROR"):
        join_world(lambda: released.wait(60))
    assert exits == [scale_up_joiner.EXIT_NOT_ADMITTED]
    assert "was not admitted within --elastic-ep-scale-timeout" in caplog.text
    assert "scale joiner for EP ranks [2]" in caplog.text


def test_an_admitted_joiner_or_one_without_a_timeout_is_never_ended() -> None:
    exits: list[int] = []
    with scale_up_joiner.AdmissionWatchdog(0.05, "joiner", exit_process=exits.append) as dog:
        watch = dog._thread
        assert watch is not None and watch.is_alive()
    watch.join(60)  # admitted at once: the watchdog ends without firing
    assert not watch.is_alive() and exits == []
    with scale_up_joiner.AdmissionWatchdog(0.0, "joiner", exit_process=exits.append) as dog:
        assert dog._thread is None  # --elastic-ep-scale-timeout 0: no limit


@pytest.fixture
def watched_joiner(joiner_process: SimpleNamespace,
                   monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Rank 2's joiner with the rendezvous store faked, its watchdogs polling every 10 ms and
    ending it by a fake exit that records the code and releases ``released`` (the wait it was
    in), and a scale timeout far away."""
    import functools
    import threading

    from sglang_elastic_ep.sglang import replacement_notices

    store = FakeStore()
    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: store)
    env = SimpleNamespace(notices=replacement_notices, released=threading.Event(), exits=[])

    def fake_exit(code: int) -> None:
        env.exits.append(code)
        env.released.set()

    monkeypatch.setattr(scale_up_joiner, "scale_timeout_s", lambda: 600.0)
    monkeypatch.setattr(scale_up_joiner, "AdmissionWatchdog", functools.partial(
        scale_up_joiner.AdmissionWatchdog, exit_process=fake_exit, poll_s=0.01))
    return env


def test_a_joiner_the_survivors_await_in_place_exits_at_once_naming_the_relaunch(
        watched_joiner: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    """Relaunched before the survivors noticed that rank 2 failed below a live rank, the
    replacement read no notice and registered a cohort, which nobody will admit: once the
    notice appears it exits, long before the timeout."""
    joiner = watched_joiner

    def join_group() -> None:
        joiner.notices.announce_in_place([2], 4)  # the survivors, meanwhile
        joiner.released.wait(60)

    with caplog.at_level("ERROR"):
        join_world(join_group)
    assert joiner.exits == [scale_up_joiner.EXIT_NOT_ADMITTED]
    assert "the survivors await ranks [2] in place" in caplog.text
    assert "relaunch this joiner with the same arguments" in caplog.text


def test_a_joiner_the_serving_ranks_counted_out_at_their_commit_exits_at_once(
        watched_joiner: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Mooncake gave up on the joiner's admission (it did not acknowledge the view update in
    time) and the serving ranks committed without it: their notice ends its wait in
    join_group, long before the timeout. A count from an earlier joiner of the slot, there
    before it registered, does not."""
    joiner = watched_joiner
    joiner.notices.announce_counted_out([2])  # an earlier joiner of the slot
    polls: list[str | None] = []

    def join_group() -> None:
        for _ in range(6000):  # until the watchdog has looked and let it wait
            if len(polls) >= 3:
                break
            joiner.released.wait(0.01)
        assert len(polls) >= 3 and joiner.exits == [], (polls, joiner.exits)
        joiner.notices.announce_counted_out([2])  # the serving ranks, at their commit
        joiner.released.wait(60)

    counted_out_since = scale_up_joiner.counted_out_since

    def counting(registered: dict[int, int]) -> str | None:
        polls.append(counted_out_since(registered))
        return polls[-1]

    monkeypatch.setattr(scale_up_joiner, "counted_out_since", counting)
    with caplog.at_level("ERROR"):
        join_world(join_group)
    assert joiner.exits == [scale_up_joiner.EXIT_NOT_ADMITTED]
    assert "the serving ranks counted ranks [2] out of Mooncake's WORLD" in caplog.text
    assert "relaunch this joiner with --ep-join-mode recover" in caplog.text


def test_an_admitted_joiner_counted_out_before_it_serves_exits_and_one_that_serves_is_let_be(
        watched_joiner: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    """Mooncake admitted it late: the serving ranks had counted it out and committed without
    it, so its next collective (here the commit barrier) waits for good; their notice ends it.
    A joiner that commits and serves has no watch left."""
    joiner = watched_joiner

    def barrier_the_others_left(runner: object, size: int) -> None:
        joiner.notices.announce_counted_out([2])  # the serving ranks, at their commit
        joiner.released.wait(60)

    with caplog.at_level("ERROR"):
        join_world(lambda: None)  # admitted
        commit_joining(barrier_the_others_left, RUNNER, 3)
    assert joiner.exits == [scale_up_joiner.EXIT_NOT_ADMITTED]
    assert "the serving ranks counted ranks [2] out of Mooncake's WORLD" in caplog.text

    joiner.exits.clear()
    join_world(lambda: None)
    holder = scale_up_joiner.attached_state(scale_up_joiner.elastic_state(),
                                            scale_up_joiner._STATE_ATTR,
                                            scale_up_joiner.JoinerState)
    watch = holder.counted_out_watch
    assert watch is not None and watch._thread is not None and watch._thread.is_alive()
    commit_joining(lambda runner, size: None, RUNNER, 3)
    watch._thread.join(60)
    assert not watch._thread.is_alive() and holder.counted_out_watch is None
    assert joiner.exits == []


def test_a_joiner_whose_notices_cannot_be_read_waits_for_its_deadline(
        caplog: pytest.LogCaptureFixture) -> None:
    exits: list[int] = []

    def unreadable() -> str | None:
        raise ConnectionError("store gone")

    with caplog.at_level("ERROR"), scale_up_joiner.AdmissionWatchdog(
            0.2, "joiner", exit_process=exits.append, turned_away=unreadable,
            poll_s=0.01) as dog:
        assert dog._thread is not None
        dog._thread.join(60)
    assert exits == [scale_up_joiner.EXIT_NOT_ADMITTED]
    assert "was not admitted within --elastic-ep-scale-timeout" in caplog.text
    assert "gives up its admission" not in caplog.text


class FakeStore:
    """The rendezvous store's calls the tail handoff uses."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def delete_key(self, key: str) -> bool:
        return self.values.pop(key, None) is not None

    def add(self, key: str, amount: int) -> int:
        total = int(self.values.get(key, b"0").decode()) + amount
        self.values[key] = str(total).encode()
        return total


def test_a_replacement_of_the_lowest_slots_of_a_tail_waits_for_the_rest_with_the_survivors(
        joiner_process: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Joiners 2 and 3 were let go together; rank 2's replacement is re-admitted at 3 while
    the survivors still await 4: it learns so before its commit barrier and awaits it too (its
    proposal must match theirs when rank 3's replacement registers)."""
    from sglang_elastic_ep.sglang import replacement_notices, tail_recovery

    store = FakeStore()
    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: store)
    replacement_notices.announce_partial_return(3, 4)  # a survivor, as it asks for size 3
    state = scale_up_joiner.elastic_state()
    state.effective_ep_size = 2
    join_world(lambda: None)

    def barrier(runner: Any, size: int) -> None:
        state.effective_ep_size = size
        replacement_notices.withdraw_partial_return(size)  # the survivors, once it committed

    commit_joining(barrier, RUNNER, 3)
    machine = tail_recovery.tail_recovery_state(state).machine
    assert machine is not None and machine.awaiting_replacement
    assert machine.failed_slots == range(3, 4)
    assert replacement_notices.tail_awaited_above(3) == 0 and store.values == {}


def test_a_joiner_of_an_ordinary_scale_up_awaits_no_tail(
        joiner_process: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep.sglang import replacement_notices, tail_recovery

    monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: FakeStore())
    state = scale_up_joiner.elastic_state()
    state.effective_ep_size = 2
    join_world(lambda: None)
    commit_joining(lambda runner, size: setattr(state, "effective_ep_size", size), RUNNER, 3)
    assert tail_recovery.tail_recovery_state(state).machine is None


def test_a_joiner_ended_by_its_watchdog_tells_its_parent_as_a_failed_scheduler_does() -> None:
    """Its parent (the DP controller, or the server) learns of the end by SIGQUIT, as from a
    scheduler that raised: an exit alone in the start-up leaves the server waiting."""
    import os
    import signal

    read_end, write_end = os.pipe()
    parent = os.fork()
    if parent == 0:  # the joiner's parent: records SIGQUIT, reaps the scheduler
        try:
            quits: list[int] = []
            signal.signal(signal.SIGQUIT, lambda signum, frame: quits.append(signum))
            scheduler = os.fork()
            if scheduler == 0:
                scale_up_joiner.end_the_joiners_server(scale_up_joiner.EXIT_NOT_ADMITTED)
            _, status = os.waitpid(scheduler, 0)
            os.write(write_end, f"{os.waitstatus_to_exitcode(status)} {quits}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(parent, 0)
    exited = os.read(read_end, 100).decode()
    os.close(read_end)
    assert exited == f"{scale_up_joiner.EXIT_NOT_ADMITTED} [{int(signal.SIGQUIT)}]", exited

"""NIXL data-plane membership: ordering of connect/disconnect against activation and drain.

The stand-in buffer is told about activation and drain events (on a logical clock shared with the
connect/disconnect calls) and fails the test on a connect before the peer's activation or a
disconnect before its drain, independently of the membership's own checks.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.backends.nixl_membership import (
    ARRIVAL_POLL_S,
    BufferSizing,
    MembershipOrderError,
    NixlMembership,
    RankRemovedError,
    local_experts_per_rank,
    max_physical_experts,
)

# ----------------------------------------------------------------------------- stand-in buffer


class OrderViolation(AssertionError):
    pass


class RecordingBuffer:
    """``nixl_ep.Buffer``-shaped stand-in that checks the protocol order.

    * ``connect_ranks(r)`` needs an ``activated(r)`` event with no ``drained(r)`` after it
      (founders count as activated at launch).
    * ``disconnect_ranks(r)`` needs a ``drained(r)`` event after the last connect of ``r``, and
      ``r`` must be connected and at the tail of the connect order (nixl_ep's rule).
    """

    get_rdma_size_hint = staticmethod(lambda tokens, hidden, ranks, experts: 1000 * ranks)

    def __init__(self, rank: int, founders: int, clock: itertools.count) -> None:
        self.rank = rank
        self.clock = clock
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.remote: list[int] = []
        self.last_activated: dict[int, int] = {r: -1 for r in range(founders)}
        self.last_drained: dict[int, int] = {}
        self.last_connected: dict[int, int] = {}
        self.memory_calls: list[dict[str, int]] = []
        self.explicitly_destroy = True
        self.destroyed = False
        # nixl_ep documents disconnects at the end of the connect order only; the testbed's CPU
        # buffer also drops a rank in the middle (a launch-time rank replaced after a scale-up)
        self.middle_disconnects = False

    # events the test (the "control plane") reports
    def activated(self, ranks: list[int]) -> None:
        t = next(self.clock)
        for r in ranks:
            self.last_activated[r] = t

    def drained(self, ranks: list[int]) -> None:
        t = next(self.clock)
        for r in ranks:
            self.last_drained[r] = t

    # nixl_ep.Buffer interface
    def update_memory_buffers(
        self, num_ranks: int, num_experts_per_rank: int, num_rdma_bytes: int
    ) -> None:
        self.memory_calls.append(
            dict(
                num_ranks=num_ranks,
                num_experts_per_rank=num_experts_per_rank,
                num_rdma_bytes=num_rdma_bytes,
            )
        )

    def connect_ranks(self, remote_ranks: list[int]) -> None:
        t = next(self.clock)
        for r in remote_ranks:
            if r == self.rank:
                continue  # nixl_ep filters the own rank out
            act = self.last_activated.get(r)
            if act is None or self.last_drained.get(r, -2) > act:
                raise OrderViolation(f"rank {self.rank}: connect to {r} before its activation")
            if r in self.remote:
                raise OrderViolation(f"rank {self.rank}: {r} connected twice")
            self.remote.append(r)
            self.last_connected[r] = t
        self.calls.append(("connect", tuple(remote_ranks)))

    def disconnect_ranks(self, remote_ranks: list[int]) -> None:
        next(self.clock)
        for r in remote_ranks:
            if r not in self.remote:
                raise OrderViolation(f"rank {self.rank}: disconnect of unconnected {r}")
            if self.last_drained.get(r, -2) < self.last_connected[r]:
                raise OrderViolation(f"rank {self.rank}: disconnect of {r} before its drain")
        if not self.middle_disconnects and \
                sorted(self.remote[-len(remote_ranks) :]) != sorted(remote_ranks):
            raise OrderViolation(f"rank {self.rank}: {remote_ranks} are not the tail")
        self.remote = [r for r in self.remote if r not in remote_ranks]
        self.calls.append(("disconnect", tuple(remote_ranks)))

    def destroy(self) -> None:
        self.destroyed = True


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def make(
    rank: int = 0, founders: int = 2, max_ep: int = 4, *, check_order: bool = True
) -> tuple[NixlMembership, RecordingBuffer, FakeTime]:
    ft = FakeTime()
    clock = itertools.count()
    buf = RecordingBuffer(rank, founders, clock)
    m = NixlMembership(check_order=check_order, clock=ft.clock, sleep=ft.sleep)
    m.attach(buf, rank=rank, max_ep_size=max_ep, initial_ep_size=founders)
    return m, buf, ft


def activate(m: NixlMembership, buf: RecordingBuffer, ranks: list[int]) -> None:
    """What the plugin does after Mooncake activate_ranks returned."""
    buf.activated(ranks)
    m.mark_activated(ranks)


def drain(m: NixlMembership, buf: RecordingBuffer, ranks: list[int]) -> None:
    buf.drained(ranks)
    m.mark_drained(ranks)


# ----------------------------------------------------------------------------- tests


def test_first_dispatch_connects_the_launch_world_then_idle_dispatch_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m, buf, _ = make(rank=1, founders=2)
    assert buf.calls == []  # attach alone never connects
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1))]
    assert m.connected_ep_size == 2 and not m.pending

    def boom() -> None:
        raise AssertionError("_apply reached while idle")

    monkeypatch.setattr(m, "_apply", boom)
    for _ in range(10_000):
        m.ensure_connected()
    assert buf.calls == [("connect", (0, 1))]


def test_scale_up_connects_after_activation_at_the_next_dispatch() -> None:
    m, buf, _ = make()
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    # on_scale only records: no connect yet (it would block in the control path).
    assert buf.calls == [("connect", (0, 1))]
    assert m.scale_to == 3 and m.connected_ep_size == 2 and m.pending
    m.ensure_connected()
    assert buf.calls[-1] == ("connect", (2,))
    assert m.connected_ep_size == 3 and buf.remote == [1, 2]


def test_replacing_a_rank_below_the_top_keeps_the_ranks_above_it_connected() -> None:
    # 2 -> 3, then launch-time rank 1 is replaced: dispatch must still reach rank 2
    m, buf, _ = make(rank=0, founders=2)
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    buf.middle_disconnects = True  # the CPU buffer's rule (GPU: not run, docs/design.md)
    drain(m, buf, [1])  # it died: nothing of it is in flight
    buf.activated([1])  # its replacement is in WORLD again
    m.replace([1])
    m.ensure_connected()
    assert buf.calls[-2:] == [("disconnect", (1,)), ("connect", (1,))]
    assert m.connected_ep_size == 3 and not m.pending


def test_scale_down_disconnects_the_tail_after_the_drain() -> None:
    m, buf, _ = make(founders=2)
    m.ensure_connected()
    activate(m, buf, [2, 3])
    m.on_scale(4)
    m.ensure_connected()
    drain(m, buf, [2, 3])
    m.on_scale(2)
    assert buf.calls[-1] == ("connect", (2, 3))  # nothing before the next dispatch
    m.ensure_connected()
    assert buf.calls[-1] == ("disconnect", (2, 3))
    assert m.connected_ep_size == 2 and buf.remote == [1]


def test_phases_2_3_2_3_on_a_founder_wait_the_reconnect_grace() -> None:
    m, buf, ft = make(rank=0, founders=2)
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    drain(m, buf, [2])
    m.on_scale(2)
    m.ensure_connected()
    ft.now += 1.5  # a new rank 2 is activated 1.5 s after the disconnect
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    assert buf.calls == [
        ("connect", (0, 1)),
        ("connect", (2,)),
        ("disconnect", (2,)),
        ("connect", (2,)),
    ]
    assert ft.slept == [pytest.approx(m.reconnect_grace_s - 1.5)]
    assert m.applied == buf.calls


def test_joiner_connects_to_its_whole_world_on_first_dispatch() -> None:
    clock = itertools.count()
    buf = RecordingBuffer(rank=2, founders=3, clock=clock)  # the joiner sees 0..2 as active
    m = NixlMembership()
    m.attach(buf, rank=2, max_ep_size=4, initial_ep_size=3)
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1, 2))]
    assert buf.remote == [0, 1]


def test_on_scale_before_activation_is_refused_at_the_call_site() -> None:
    m, buf, _ = make()
    m.ensure_connected()
    with pytest.raises(MembershipOrderError, match="before they were activated"):
        m.on_scale(3)  # e.g. from the HTTP handler
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1))]
    assert m.scale_to == 2


def test_scale_down_before_drain_is_refused_at_the_call_site() -> None:
    m, buf, _ = make()
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    with pytest.raises(MembershipOrderError, match="before they were drained"):
        m.on_scale(2)
    m.ensure_connected()
    assert buf.calls[-1] == ("connect", (2,))


def test_standin_fails_on_connect_before_activate() -> None:
    # With the membership's own check off, the stand-in must catch the wrong order.
    m, buf, _ = make(check_order=False)
    m.ensure_connected()
    m.on_scale(3)  # no activation reported
    with pytest.raises(OrderViolation, match="connect to 2 before its activation"):
        m.ensure_connected()


def test_standin_fails_on_disconnect_before_drain() -> None:
    m, buf, _ = make(check_order=False)
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    m.on_scale(2)  # no drain reported
    with pytest.raises(OrderViolation, match="disconnect of 2 before its drain"):
        m.ensure_connected()


def test_shrink_and_regrow_before_any_dispatch_still_reconnects() -> None:
    # An idle server (no dispatch) removes rank 2 and gets a new rank 2: same size, but the old
    # connection belongs to a dead process and must be replaced.
    m, buf, ft = make()
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    drain(m, buf, [2])
    m.on_scale(2)
    activate(m, buf, [2])
    m.on_scale(3)
    assert m.pending and m.scale_to == m.connected_ep_size == 3
    m.ensure_connected()
    assert buf.calls[-2:] == [("disconnect", (2,)), ("connect", (2,))]
    assert ft.slept == [pytest.approx(m.reconnect_grace_s)]


def test_grow_then_shrink_before_any_dispatch_never_touches_the_buffer() -> None:
    m, buf, _ = make()
    m.ensure_connected()
    activate(m, buf, [2])
    m.on_scale(3)
    drain(m, buf, [2])
    m.on_scale(2)
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1))]
    assert m.connected_ep_size == 2


def test_a_buffer_made_at_the_launch_size_takes_on_a_smaller_serving_size_before_connecting(
) -> None:
    """A launch-time rank's replacement creates its buffer at the launch size (3) before it
    rejoins survivors serving on 2 (a scale-down released rank 2): the released rank is marked
    drained, and the first dispatch connects only the serving ranks."""
    m, buf, _ = make(rank=1, founders=3)
    with pytest.raises(MembershipOrderError):
        m.on_scale(2)  # rank 2 not known drained: refused, nothing recorded
    drain(m, buf, [2])
    m.on_scale(2)
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1))]
    assert m.connected_ep_size == 2


def test_leaving_rank_stops_dispatching_and_releases_its_buffer() -> None:
    clock = itertools.count()
    buf = RecordingBuffer(rank=2, founders=3, clock=clock)
    m = NixlMembership()
    m.attach(buf, rank=2, max_ep_size=4, initial_ep_size=3)
    m.ensure_connected()
    m.on_scale(2)  # this rank is the one removed; it needs no drain mark for itself
    assert m.is_leaving
    with pytest.raises(RankRemovedError):
        m.ensure_connected()
    assert buf.calls == [("connect", (0, 1, 2))]  # it never disconnects the survivors
    m.release()
    assert buf.destroyed and m.buffer is None


def test_on_scale_before_the_buffer_exists_is_used_by_attach() -> None:
    clock = itertools.count()
    buf = RecordingBuffer(rank=0, founders=2, clock=clock)
    m = NixlMembership()
    m.mark_activated([2])
    buf.activated([2])
    m.on_scale(3)  # no dispatch ran yet on this rank
    m.attach(buf, rank=0, max_ep_size=4, initial_ep_size=2)
    m.ensure_connected()
    assert buf.calls == [("connect", (0, 1, 2))]

    m2 = NixlMembership()
    m2.on_scale(3)
    with pytest.raises(MembershipOrderError):
        m2.attach(RecordingBuffer(0, 2, clock), rank=0, max_ep_size=4, initial_ep_size=2)


def test_callbacks_and_bad_sizes() -> None:
    seen: list[int] = []
    before: list[object] = []
    m = NixlMembership(
        before_connect=before.append, on_applied=lambda mm: seen.append(mm.connected_ep_size)
    )
    buf = RecordingBuffer(0, 2, itertools.count())
    m.attach(buf, rank=0, max_ep_size=3, initial_ep_size=2)
    m.ensure_connected()
    assert before == [buf] and seen == [2]
    with pytest.raises(ValueError):
        m.on_scale(4)
    with pytest.raises(ValueError):
        m.on_scale(0)
    with pytest.raises(RuntimeError):
        m.attach(buf, rank=0, max_ep_size=3, initial_ep_size=2)


def test_cluster_of_three_follows_the_rfc_sequence() -> None:
    """2 -> 3 -> 2 -> 3 driven as the plugin drives it, on every rank at once."""
    clock = itertools.count()
    ft = FakeTime()

    def new_rank(rank: int, world: int) -> tuple[NixlMembership, RecordingBuffer]:
        b = RecordingBuffer(rank, world, clock)
        mm = NixlMembership(clock=ft.clock, sleep=ft.sleep)
        mm.attach(b, rank=rank, max_ep_size=4, initial_ep_size=world)
        return mm, b

    ranks = {0: new_rank(0, 2), 1: new_rank(1, 2)}
    for mm, _ in ranks.values():
        mm.ensure_connected()
    for cycle in range(2):
        # HTTP handler: nothing touches the buffers. Joiner starts and joins (Mooncake).
        ranks[2] = new_rank(2, 3)
        for r in (0, 1):
            mm, b = ranks[r]
            activate(mm, b, [2])  # after activate_ranks
            mm.on_scale(3)
        for mm, _ in ranks.values():
            mm.ensure_connected()  # next dispatch everywhere
        assert [b.remote for _, b in ranks.values()] == [[1, 2], [0, 2], [0, 1]]
        # Scale-down: drain rank 2, then on_scale everywhere; rank 2 leaves.
        for r in (0, 1):
            mm, b = ranks[r]
            drain(mm, b, [2])
            mm.on_scale(2)
        leaving, _ = ranks.pop(2)
        leaving.on_scale(2)
        with pytest.raises(RankRemovedError):
            leaving.ensure_connected()
        leaving.release()
        for mm, _ in ranks.values():
            mm.ensure_connected()
        assert [b.remote for _, b in ranks.values()] == [[1], [0]]
        ft.now += 10.0 if cycle == 0 else 0.0
    assert ranks[0][1].calls == [
        ("connect", (0, 1)),
        ("connect", (2,)),
        ("disconnect", (2,)),
        ("connect", (2,)),
        ("disconnect", (2,)),
    ]


# ----------------------------------------------------------------------------- sizing


def test_sizing_allocates_for_the_maximum() -> None:
    buf = RecordingBuffer(0, 2, itertools.count())
    sizing = BufferSizing(
        max_ep_size=16, num_local_experts=18, num_max_dispatch_tokens_per_rank=128, hidden_size=64
    )
    hints: list[tuple[int, int, int, int]] = []

    def hint(tokens: int, hidden: int, ranks: int, experts: int) -> int:
        hints.append((tokens, hidden, ranks, experts))
        return 4096

    assert sizing.allocate(buf, hint) == 4096
    assert hints == [(128, 64, 16, 288)]
    assert buf.memory_calls == [dict(num_ranks=16, num_experts_per_rank=18, num_rdma_bytes=4096)]
    assert sizing.max_num_experts == 288
    assert sizing.dispatch_num_experts(3) == 54
    assert sizing.dispatch_num_experts(3, fixed_layout=True) == 288
    # Default hint: the buffer class's get_rdma_size_hint.
    assert sizing.allocate(buf) == 16_000
    with pytest.raises(ValueError):
        sizing.dispatch_num_experts(17)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_ep_size=0, num_local_experts=1, num_max_dispatch_tokens_per_rank=8, hidden_size=1),
        dict(
            max_ep_size=2, num_local_experts=1, num_max_dispatch_tokens_per_rank=1025, hidden_size=1
        ),
        dict(max_ep_size=3, num_local_experts=1, num_max_dispatch_tokens_per_rank=3, hidden_size=1),
    ],
)
def test_sizing_rejects_what_nixl_ep_cannot_do(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        BufferSizing(**kwargs)


def test_expert_count_helpers() -> None:
    assert local_experts_per_rank(256, 32, 16) == 18
    assert max_physical_experts(18, 16) == 288
    with pytest.raises(ValueError, match="do not divide"):
        local_experts_per_rank(256, 0, 3)
    with pytest.raises(ValueError):
        local_experts_per_rank(256, 0, 0)


# ----------------------------------------------------------------------------- SGLang adapter


class FakeNixlEPBuffer:
    """Upstream's NixlEPBuffer shape: state on a namespace behind a classmethod."""

    state = SimpleNamespace(
        buffer=None, connected_ep_size=None, scale_to=None, dispatch_ep_size=None
    )

    @classmethod
    def _state(cls) -> SimpleNamespace:
        return cls.state


def test_adapter_on_scale_and_dispatch_delegate_to_the_membership() -> None:
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as hooks

    cls = FakeNixlEPBuffer
    cls.state = SimpleNamespace(
        buffer=None, connected_ep_size=None, scale_to=None, dispatch_ep_size=None
    )
    state = cls._state()
    buf = RecordingBuffer(0, 2, itertools.count())
    m = hooks.membership_of(state)
    m._before_connect = None  # no SGLang TCPStore here
    state.buffer = buf
    m.attach(buf, rank=0, max_ep_size=4, initial_ep_size=2)
    assert hooks.nixl_get_nixl_buffer(cls, None, 64, None) is buf
    assert (state.connected_ep_size, state.dispatch_ep_size) == (2, 2)

    # Host mask does not show rank 2 yet: an early on_scale is refused, nothing connects.
    with pytest.raises(MembershipOrderError):
        hooks.nixl_on_scale(cls, 2, 3, active_ranks_cpu=lambda: [1, 1, 0, 0])
    buf.activated([2])
    hooks.nixl_on_scale(cls, 2, 3, active_ranks_cpu=lambda: [1, 1, 1, 0])
    assert buf.calls == [("connect", (0, 1))]
    hooks.nixl_get_nixl_buffer(cls, None, 64, None)
    assert buf.calls[-1] == ("connect", (2,))
    assert (state.connected_ep_size, state.scale_to, state.dispatch_ep_size) == (3, 3, 3)


def test_adapter_hook_table_names_real_upstream_targets() -> None:
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as hooks

    kinds = {"BEFORE", "AFTER", "AROUND", "REPLACE"}
    targets = [t for t, _, _, _ in hooks.HOOKS]
    assert len(targets) == len(set(targets))
    for target, fn, kind, reason in hooks.HOOKS:
        assert target.startswith("sglang.srt.") and callable(fn) and kind in kinds and reason
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(next(iter(spec.submodule_search_locations))).parent
    for target, _, _, _ in hooks.HOOKS:
        # Read upstream's source instead of importing it (SGLang needs GPU packages to import).
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            path = root.joinpath(*parts[:cut]).with_suffix(".py")
            if path.is_file():
                break
        else:
            raise AssertionError(f"no module file for {target}")
        node: ast.AST = ast.parse(path.read_text())
        for name in parts[cut:]:
            found = [
                n
                for n in ast.iter_child_nodes(node)
                if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name
            ]
            assert found, f"{target}: {name} not found in {path}"
            node = found[0]


# ----------------------------------------------------------------------------- host mirror (CPU)


def test_mirror_hooks_follow_events_and_device_faults_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from sglang_elastic_ep.sglang import nixl_buffer_hooks as hooks

    active = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    state = SimpleNamespace(
        active_ranks=active, last_active_ranks=active.clone(), active_ranks_cpu=active.clone()
    )
    assert hooks.state_is_active_equal_last(state)
    active[1] = 0  # fault written into the (here: CPU) device mask
    assert not hooks.state_is_active_equal_last(state)
    # upstream's reaction: snapshot, then copy to host -> quiet again
    hooks.state_after_snapshot_active_to_last(None, state)
    state.active_ranks_cpu = active.clone()
    hooks.state_after_sync_active_to_cpu(None, state)
    assert hooks.state_is_active_equal_last(state)
    assert hooks.mirror_of(state).inactive_ranks() == [1, 3]

    group = SimpleNamespace(
        active_ranks=torch.ones(3, dtype=torch.int32),
        active_ranks_cpu=torch.ones(3, dtype=torch.int32),
    )
    calls: list[list[int]] = []
    done: list[str] = []
    ready = {"now": False}
    upstream = SimpleNamespace(
        try_recover_ranks=lambda ranks: calls.append(list(ranks)) or ready["now"],
        broadcast_global_expert_location_metadata=lambda **kw: done.append("broadcast"),
        get_healthy_expert_location_src_rank=lambda **kw: 0,
        ElasticEPStateManager=SimpleNamespace(
            instance=lambda: SimpleNamespace(reset=lambda: done.append("reset"))
        ),
    )
    monkeypatch.setattr(hooks, "elastic_ep_module", lambda: upstream)
    lookups: list[str] = []  # no ElasticEPState set up; each lookup is counted
    monkeypatch.setattr(hooks, "elastic_state", lambda: lookups.append("state") or None)
    eplb = SimpleNamespace(reset_generator=lambda: done.append("eplb"))
    kw = dict(tp_group=group, eplb_manager=eplb, model_config=None, moe_ep_rank=0)
    assert hooks.maybe_recover_ep_ranks(**kw) is False and calls == []
    group.active_ranks[2] = 0  # Mooncake evicted rank 2
    assert hooks.maybe_recover_ep_ranks(**kw) is False and calls == [[2]]
    assert lookups == []  # polled every pass while no replacement is in WORLD: nothing else
    ready["now"] = True  # the replacement joined
    group.active_ranks[2] = 1
    group.active_ranks_cpu[2] = 0  # host copy still stale: upstream ANDs both
    assert hooks.maybe_recover_ep_ranks(**kw) is True and lookups == ["state"]
    # A recovery (rank 2 was active before) keeps EPLB's state: no reset, locations broadcast.
    assert calls[-1] == [2] and done == ["broadcast", "reset"]
    group.active_ranks[2] = 0
    kw["eplb_manager"] = None  # without --enable-eplb upstream dereferenced None here
    assert hooks.maybe_recover_ep_ranks(**kw) is True


def test_a_recovered_rank_is_reconnected_at_the_next_dispatch() -> None:
    """Recovery: the failed rank's id now names a new process; the dead agent goes first."""
    m, buf, ft = make(rank=0, founders=2)
    m.ensure_connected()
    buf.drained([1])  # the dead process has nothing in flight
    buf.activated([1])  # Mooncake recover_ranks returned for the replacement
    m.replace([1, 0])  # the own rank is never replaced
    assert buf.calls == [("connect", (0, 1))] and m.pending  # recorded only
    m.ensure_connected()
    assert buf.calls[-2:] == [("disconnect", (1,)), ("connect", (1,))]
    assert m.connected_ep_size == 2 and not m.pending
    assert ft.slept == [pytest.approx(m.reconnect_grace_s)]  # nixl_ep's grace (not on CPU)
    with pytest.raises(ValueError, match="outside the EP size"):
        m.replace([3])


def test_prepare_data_plane_creates_the_buffer_then_connects_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A joiner creates its buffer before it registers (no peer is there to connect to), and
    connects at the commit barrier; a model without NIXL has nothing to prepare."""
    from sglang_elastic_ep.sglang import nixl_buffer_hooks as hooks

    state = SimpleNamespace(buffer=None, connected_ep_size=None, scale_to=None,
                            dispatch_ep_size=None)
    impl = SimpleNamespace(group="ep group", hidden_size=64, deepep_mode="low_latency",
                           num_max_dispatch_tokens_per_rank=8, num_experts=16,
                           num_local_experts=8)
    created: list[tuple] = []
    buf = RecordingBuffer(2, 2, itertools.count())

    def create(st: SimpleNamespace, *args: object) -> RecordingBuffer:
        created.append(args)
        st.buffer = buf
        m = hooks.membership_of(st)
        m._before_connect = None  # no SGLang TCPStore here
        m.attach(buf, rank=2, max_ep_size=4, initial_ep_size=3)  # a joiner for rank 2 of 3
        return buf

    monkeypatch.setattr(hooks, "_nixl_state", lambda: state)
    monkeypatch.setattr(hooks, "_create_buffer", create)
    monkeypatch.setattr(hooks, "_nixl_dispatch_impl", lambda model: None)
    assert hooks.prepare_data_plane("dense model", connect=True) is False and created == []

    monkeypatch.setattr(hooks, "_nixl_dispatch_impl", lambda model: impl)
    assert hooks.prepare_data_plane("moe model", connect=False) is True
    assert created == [("ep group", 64, "low_latency", 8, 16, 8)] and buf.calls == []
    assert hooks.prepare_data_plane("moe model", connect=True) is True
    assert len(created) == 1  # the buffer is made once
    assert buf.calls == [("connect", (0, 1, 2))] and buf.remote == [0, 1]
    assert (state.connected_ep_size, state.dispatch_ep_size) == (3, 3)


# ------------------------------------------------------------------- peers gone before the connect


class ArrivalStore:
    """The TCPStore calls the arrival wait makes; ``arrive`` plays a peer reaching its connect."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.on_check: list[object] = []

    def set(self, key: str, value: bytes) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def delete_key(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None

    def arrive(self, rank: int) -> None:
        self.set(f"elastic-ep/nixl-arrival/{rank}", b"1")


def make_with_arrivals(
    alive: dict[int, bool], *, rank: int = 0, founders: int = 2, timeout_s: float = 300.0
) -> tuple[NixlMembership, RecordingBuffer, FakeTime, ArrivalStore]:
    ft = FakeTime()
    buf = RecordingBuffer(rank, founders, itertools.count())
    store = ArrivalStore()
    buf.tcp_store_group = store  # type: ignore[attr-defined]
    m = NixlMembership(clock=ft.clock, sleep=ft.sleep, arrival_timeout_s=timeout_s,
                       members_alive=lambda ranks: [alive.get(r, True) for r in ranks])
    m.attach(buf, rank=rank, max_ep_size=4, initial_ep_size=founders)
    store.arrive(1 - rank)
    m.ensure_connected()
    return m, buf, ft, store


def test_a_joiner_dead_before_its_connect_is_dropped_once_mooncake_counts_it_out() -> None:
    alive = {2: True}
    m, buf, ft, store = make_with_arrivals(alive)
    activate(m, buf, [2])
    m.on_scale(3)
    polls: list[float] = []

    def sleep(s: float) -> None:
        polls.append(s)
        ft.now += s
        if len(polls) == 3:
            alive[2] = False  # Mooncake's view drops the dead joiner

    m._sleep = sleep
    m.ensure_connected()
    assert len(polls) == 3  # waited for its arrival until it was counted out, no longer
    assert buf.calls == [("connect", (0, 1))]  # no connect with the dead process at all
    assert m.dropped == [2] and not m.pending and m.connected_ep_size == 2
    assert store.keys == {"elastic-ep/nixl-arrival/1": b"1"}  # the own mark is withdrawn


def test_peers_that_arrived_are_connected_and_a_dead_one_with_a_stale_mark_is_not() -> None:
    m, buf, ft, store = make_with_arrivals({3: False}, founders=2)
    activate(m, buf, [2, 3])
    m.on_scale(4)
    store.arrive(2)
    store.arrive(3)  # left by a process killed inside its connect
    m.ensure_connected()
    assert buf.calls[-1] == ("connect", (2,)) and m.dropped == [3]
    assert ft.slept == []  # everyone alive had arrived: no wait
    assert m.connected_ep_size == 3


def test_a_peer_alive_but_late_past_the_timeout_is_connected_anyway() -> None:
    m, buf, ft, _ = make_with_arrivals({}, timeout_s=1.0)
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    assert buf.calls[-1] == ("connect", (2,)) and m.dropped == []
    # the buffer's own wait takes over from here
    assert 1.0 <= sum(ft.slept) <= 1.0 + ARRIVAL_POLL_S + 1e-9


def test_a_dropped_rank_is_connected_when_its_replacement_is_taken_back() -> None:
    alive = {2: False}
    m, buf, _, store = make_with_arrivals(alive)
    activate(m, buf, [2])
    m.on_scale(3)
    m.ensure_connected()
    assert m.dropped == [2]
    alive[2] = True
    store.arrive(2)
    buf.activated([2])
    m.replace([2])
    m.ensure_connected()  # nothing to disconnect: the dead process was never connected
    assert buf.calls[-1] == ("connect", (2,)) and buf.remote == [1, 2]
    assert m.connected_ep_size == 3

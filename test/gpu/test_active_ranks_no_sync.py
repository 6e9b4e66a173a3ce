"""The per-forward elastic-EP poll never syncs the host with the GPU.

Runs the poll functions the plugin installs in place of upstream's (``is_active_equal_last``,
``maybe_recover_ep_ranks``) after every simulated forward, hundreds of times, under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing CUDA call raises). A fault is
injected on the GPU mid-run, as NIXL's ``query_mask_buffer`` and Mooncake would write it, and
the poll must notice it, still without a sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.backends.active_ranks_mirror import ActiveRanksMirror
from sglang_elastic_ep.sglang import nixl_buffer_hooks as hooks

pytestmark = pytest.mark.usefixtures("cuda")

MAX_EP = 16
EP = 4


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_sync_detector_catches_upstreams_reads() -> None:
    """Positive control: the reads upstream does per forward do raise in this mode."""
    active = torch.ones(MAX_EP, dtype=torch.int32, device="cuda")
    last = active.clone()
    with no_sync():
        with pytest.raises(RuntimeError, match="synchroniz"):
            bool(active.all())  # maybe_recover_ep_ranks
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.equal(active, last)  # ElasticEPState.is_active_equal_last


def make_state(size: int = MAX_EP) -> SimpleNamespace:
    active = torch.zeros(size, dtype=torch.int32, device="cuda")
    active[:EP] = 1
    return SimpleNamespace(
        active_ranks=active,
        last_active_ranks=active.clone(),
        active_ranks_cpu=active.cpu(),
    )


def test_poll_path_has_no_host_sync_and_still_sees_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state()  # ElasticEPState: NIXL's mask lands here
    tp_group = make_state(EP)  # Mooncake's process-group mask (sized to the group)
    recover_calls: list[list[int]] = []
    fake_upstream = SimpleNamespace(
        try_recover_ranks=lambda ranks: recover_calls.append(list(ranks)) or False
    )
    monkeypatch.setattr(hooks, "elastic_ep_module", lambda: fake_upstream)

    mask_buffer = torch.zeros(MAX_EP, dtype=torch.int32, device="cuda")  # NIXL: 1 = masked
    x = torch.randn(512, 512, device="cuda")
    w = torch.randn(512, 512, device="cuda") / 512**0.5

    # First use builds the mirrors (from the host copies upstream keeps).
    assert hooks.state_is_active_equal_last(state)
    assert (
        hooks.maybe_recover_ep_ranks(
            tp_group=tp_group, eplb_manager=None, model_config=None, moe_ep_rank=0
        )
        is False
    )
    recover_calls.clear()

    def forward() -> None:
        nonlocal x
        x = torch.tanh(x @ w)  # the model
        state.active_ranks[:EP].copy_(1 - mask_buffer[:EP])  # _combine_core after a combine

    fault_at, seen_at, polls = 300, None, 0
    with no_sync():
        for i in range(600):
            if i == fault_at:
                mask_buffer[2:3].fill_(1)  # NIXL masks rank 2 (GPU-side timeout)
                tp_group.active_ranks[2:3].fill_(0)  # Mooncake evicts it
            forward()
            equal = hooks.state_is_active_equal_last(state)  # every forward
            hooks.maybe_recover_ep_ranks(  # every forward while a rank is missing upstream
                tp_group=tp_group, eplb_manager=None, model_config=None, moe_ep_rank=0
            )
            polls += 2
            if i < fault_at:
                assert equal, f"forward {i}: change reported before any fault"
                assert not recover_calls, f"forward {i}: recovery polled before any fault"
            elif not equal and seen_at is None:
                seen_at = i
        # Let the last queued copies land, still without blocking on the GPU.
        deadline = time.monotonic() + 10
        while seen_at is None and time.monotonic() < deadline:
            if not hooks.state_is_active_equal_last(state):
                seen_at = 600
            time.sleep(0.001)
    torch.cuda.synchronize()
    print(f"{polls} poll calls without a host sync; fault at forward {fault_at}, seen at {seen_at}")
    assert seen_at is not None, "the fault never reached the mirror"
    assert mirror_inactive(state) == [2] + list(range(EP, MAX_EP))
    assert recover_calls and all(c == [2] for c in recover_calls), recover_calls

    # Upstream's reaction (rebalance) is an event: it snapshots and copies the mask to the host
    # once (a sync, allowed there). Afterwards the per-forward check is quiet again, no sync.
    hooks.state_after_snapshot_active_to_last(None, state)
    state.last_active_ranks = state.active_ranks.clone()
    state.active_ranks_cpu = state.active_ranks.cpu()
    hooks.state_after_sync_active_to_cpu(None, state)
    with no_sync():
        for _ in range(50):
            forward()
            assert hooks.state_is_active_equal_last(state)


def mirror_inactive(owner: SimpleNamespace) -> list[int]:
    return hooks.mirror_of(owner).inactive_ranks()


def settle(mirror: ActiveRanksMirror) -> bool:
    """Poll (never block) until the queued copy has landed; returns whether it changed the mask."""
    deadline = time.monotonic() + 10
    changed = False
    while mirror._pending_generation is not None:
        changed |= mirror.poll_refresh()
        assert time.monotonic() < deadline, "device copy never completed"
    return changed


def test_mirror_discards_copies_queued_before_a_membership_event() -> None:
    dev = torch.ones(8, dtype=torch.int32, device="cuda")
    mirror = ActiveRanksMirror(8, [1] * 8, device_mask=dev)
    with no_sync():
        dev[3:4].fill_(0)
        assert mirror.refresh_async()
        assert not mirror.refresh_async()  # one copy in flight at a time
        mirror.set_active([5], False)  # membership event after the copy was queued
        assert not settle(mirror)  # completes, but is stale: ignored
        assert mirror.inactive_ranks() == [5]
        assert mirror.refresh_async()
        assert settle(mirror)
    # device says rank 3 is down and rank 5 up: the fresh copy is authoritative
    assert mirror.inactive_ranks() == [3]
    mirror.set_active([3, 5], True)
    mirror.push_to_device()
    torch.cuda.synchronize()
    assert dev.tolist() == [1] * 8

"""SGLang 0.5.23 adapter for the NIXL data plane: hooks that only delegate.

Everything that decides anything lives in :mod:`sglang_elastic_ep.backends.nixl_membership`
(connect/disconnect ordering) and :mod:`sglang_elastic_ep.backends.active_ranks_mirror` (host-side
active-rank mask). This module wires them onto upstream objects; it registers nothing itself.
The plugin's hook table (:data:`sglang_elastic_ep.hooks.HOOKS`) is the one list of what gets
installed; it names the ``hook_*`` functions below. Each of them first checks
``upstream.elastic_ep_enabled`` and, without ``--elastic-ep-backend``, calls upstream's
original unchanged (AROUND) or does nothing (AFTER). The functions they delegate to
(``nixl_on_scale``, ``state_is_active_equal_last``, ...) are the elastic-EP behaviour itself and
are what the tests call directly. ``HOOKS`` here is a read-only view of this module's rows of
that table, as ``(target, hook function, HookType name, why)``.

SGLang is imported lazily, inside the functions that need it, so this module imports without it.

Upstream facts this relies on (``srt/layers/moe/token_dispatcher/nixl.py``,
``srt/elastic_ep/elastic_ep.py``, ``srt/model_executor/model_runner.py``):

* ``NixlEPBuffer`` keeps its state on ``ctx.resources.buffers["nixl_ep_state"]`` (a
  ``SimpleNamespace``); we add a ``membership`` attribute to it.
* ``NixlEPBuffer.get_nixl_buffer`` is called at the start of every dispatch and combine. Upstream
  creates the buffer there and lazily ``connect_ranks`` when ``scale_to > connected_ep_size``; it
  never disconnects. Here a scale joiner creates its buffer before it registers, and every rank
  applies the recorded connects before the scale-up's commit barrier
  (:func:`prepare_data_plane`), so the first dispatch at the new size has nothing to set up.
* ``ModelRunner._elastic_scale_ready_barrier`` is the commit barrier of a scale-up: the serving
  ranks reach it from ``_finalize_scale_up`` (after ``on_scale``), the joiners from
  ``_finalize_elastic_ep_joiner``, so each pair of them is in ``connect_ranks`` at the same time.
* ``NixlEPBuffer.on_scale(from, to)`` is reached through ``ElasticEPStateManager.on_scale``,
  which ``ModelRunner._finalize_scale_up`` calls after ``try_admit_scale_ranks`` (Mooncake
  ``activate_ranks``) and after ``sync_active_to_cpu`` has set the joiners to 1.
* ``ElasticEPState.is_active_equal_last`` (``torch.equal`` on two CUDA tensors) runs after every
  forward once ``--elastic-ep-backend`` is set: a host-device sync per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sglang_elastic_ep.backends.active_ranks_mirror import ActiveRanksMirror
from sglang_elastic_ep.backends.nixl_membership import BufferSizing, NixlMembership
from sglang_elastic_ep.sglang.join_kind import note_join, slot_history
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import (
    elastic_ep_enabled,
    elastic_ep_module,
    elastic_state,
    state_manager,
)
from sglang_elastic_ep.sglang.world_view import ReplacementGone, world_members_alive

logger = get_logger(__name__)

_MIRROR_ATTR = "_elastic_ep_mirror"


# ------------------------------------------------------------------------ membership plumbing


def _refresh_tcp_store(buffer: Any) -> None:
    """Upstream hands the buffer the current global TCPStore before every connect."""
    from sglang.srt.distributed.utils import get_global_tcp_store

    store = get_global_tcp_store()
    if store is not None:
        buffer.set_tcp_store_group(store)


def membership_of(state: Any) -> NixlMembership:
    """The membership stored on upstream's ``nixl_ep_state`` namespace (created on first use)."""
    m = getattr(state, "membership", None)
    if m is None:

        def mirror_sizes(mm: NixlMembership) -> None:
            # Upstream's dispatch reads these after get_nixl_buffer() returns.
            state.connected_ep_size = mm.connected_ep_size
            state.scale_to = mm.scale_to
            state.dispatch_ep_size = mm.connected_ep_size

        m = NixlMembership(before_connect=_refresh_tcp_store, on_applied=mirror_sizes,
                           members_alive=world_members_alive)
        state.membership = m
    return m


def _nixl_state() -> Any:
    from sglang.srt.layers.moe.token_dispatcher.nixl import NixlEPBuffer

    return NixlEPBuffer._state()


def mark_ranks_activated(ranks: Iterable[int]) -> None:
    """For the plugin's control path: Mooncake ``activate_ranks`` returned for ``ranks``."""
    membership_of(_nixl_state()).mark_activated(ranks)


def mark_ranks_drained(ranks: Iterable[int]) -> None:
    """For the plugin's scale-down: ``ranks`` have no tokens in flight. Call before on_scale."""
    membership_of(_nixl_state()).mark_drained(ranks)


def _active_ranks_cpu() -> list[int] | None:
    inst = elastic_state()
    if inst is None or inst.active_ranks_cpu is None:
        return None
    return [int(v) for v in inst.active_ranks_cpu.tolist()]


def nixl_on_scale(
    cls: Any,
    from_ep_size: int,
    to_ep_size: int,
    *,
    active_ranks_cpu: Callable[[], list[int] | None] = _active_ranks_cpu,
) -> None:
    """REPLACE for ``NixlEPBuffer.on_scale``: record the target, never connect here.

    On growth, the joining ranks count as activated when the host copy of the active-rank mask
    already shows them (upstream sets it right after ``activate_ranks``); an ``on_scale`` reached
    before that (e.g. from an HTTP handler) raises ``MembershipOrderError`` instead of hanging
    the next dispatch. On shrink, the plugin must have called :func:`mark_ranks_drained`.
    """
    state = cls._state()
    m = membership_of(state)
    if to_ep_size > from_ep_size:
        mask = active_ranks_cpu()
        if mask is not None:
            m.mark_activated(
                r for r in range(from_ep_size, to_ep_size) if r < len(mask) and mask[r]
            )
    m.on_scale(to_ep_size)
    if m.buffer is None:
        # Before the first dispatch upstream's creation path reads these.
        state.scale_to = to_ep_size
        state.dispatch_ep_size = to_ep_size


def nixl_get_nixl_buffer(
    cls: Any,
    group: Any,
    hidden_size: int,
    deepep_mode: Any,
    num_max_dispatch_tokens_per_rank: int = -1,
    num_experts: int = -1,
    num_local_experts: int = -1,
) -> Any:
    """REPLACE for ``NixlEPBuffer.get_nixl_buffer`` (called before every dispatch/combine).

    Idle cost: the state lookup upstream does anyway plus one integer comparison.
    """
    state = cls._state()
    if state.buffer is not None:
        state.membership.ensure_connected()
        return state.buffer
    buffer = _create_buffer(
        state,
        group,
        hidden_size,
        deepep_mode,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        num_local_experts,
    )
    state.membership.ensure_connected()
    return buffer


def _create_buffer(
    state: Any,
    group: Any,
    hidden_size: int,
    deepep_mode: Any,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    num_local_experts: int,
) -> Any:
    """Upstream's creation path, with sizing owned by the membership; the first connect is
    recorded, and applied by the caller's ``ensure_connected``."""
    import torch.distributed as dist
    from sglang.srt.distributed.utils import get_global_tcp_store
    from sglang.srt.layers.moe.token_dispatcher.nixl import _load_nixl_ep
    from sglang.srt.runtime_context import get_parallel

    buffer_cls, _ = _load_nixl_ep()
    if deepep_mode.enable_normal():
        raise NotImplementedError("Normal mode is not supported for Nixl EP yet.")
    if not deepep_mode.enable_low_latency():
        raise ValueError(f"unsupported deepep mode {deepep_mode}")
    if num_max_dispatch_tokens_per_rank <= 0 or num_experts <= 0 or num_local_experts <= 0:
        raise ValueError(
            "NIXL EP needs num_max_dispatch_tokens_per_rank, num_experts and num_local_experts"
        )
    state.hidden_size = hidden_size
    state.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
    state.num_experts = num_experts
    state.num_local_experts = num_local_experts

    rank = dist.get_rank(group)
    world_size = dist.get_world_size(group)
    offset = state_manager().get_ep_join_rank_offset()
    global_rank = rank + offset
    max_ep_size = get_parallel().max_ep_size or world_size
    sizing = BufferSizing(
        max_ep_size=max_ep_size,
        num_local_experts=num_local_experts,
        num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
        hidden_size=hidden_size,
    )
    tcp_store = get_global_tcp_store()
    if tcp_store is None:
        raise RuntimeError(
            "Global TCPStore is not initialized. "
            "Make sure init_distributed_environment was called before using NIXL EP."
        )
    logger.info(
        "[elastic-ep][nixl] creating buffer: rank=%d global_rank=%d max_ep_size=%d "
        "local_experts=%d max_experts=%d",
        rank,
        global_rank,
        max_ep_size,
        num_local_experts,
        sizing.max_num_experts,
    )
    buffer = buffer_cls(rank=global_rank, tcp_store_group=tcp_store)
    sizing.allocate(buffer, buffer_cls.get_rdma_size_hint)
    state.buffer = buffer
    state.sizing = sizing
    m = membership_of(state)
    m.attach(buffer, rank=global_rank, max_ep_size=max_ep_size, initial_ep_size=offset + world_size)
    return buffer


def _nixl_dispatch_impl(model: Any) -> Any:
    """The low-latency NIXL dispatcher of the model's first MoE layer (None without NIXL): the
    buffer sizes the first dispatch would pass come from it."""
    from sglang.srt.layers.moe.token_dispatcher.nixl import NixlEPDispatcher

    for module in model.modules():
        dispatcher = getattr(module, "dispatcher", None)
        # Two-batch overlap wraps one dispatcher per micro-batch; they share the buffer.
        for inner in getattr(dispatcher, "_inners", None) or [dispatcher]:
            if isinstance(inner, NixlEPDispatcher):
                return inner._low_latency_dispatcher
    return None


def prepare_data_plane(model: Any, *, connect: bool) -> bool:
    """Create this rank's NIXL EP buffer now if it has none, with the sizes its first dispatch
    would use; with ``connect``, also apply the connects and disconnects recorded so far.
    False when the model does not dispatch over NIXL (nothing to prepare).

    A scale joiner calls it before it registers (``connect=False``: the agent and the memory
    registration cost it nothing at the commit); every rank calls it again before the commit
    barrier (``connect=True``: the handshakes with the joiners happen there, both sides at once).
    """
    impl = _nixl_dispatch_impl(model)
    if impl is None:
        return False
    state = _nixl_state()
    if state.buffer is None:
        _create_buffer(state, impl.group, impl.hidden_size, impl.deepep_mode,
                       impl.num_max_dispatch_tokens_per_rank, impl.num_experts,
                       impl.num_local_experts)
    if connect:
        state.membership.ensure_connected()
    return True


# ------------------------------------------------------------------------ active-rank mirror


def mirror_of(owner: Any) -> ActiveRanksMirror:
    """The mirror of ``owner.active_ranks`` (an ``ElasticEPState`` or a ``GroupCoordinator``).

    Built on first use from ``owner.active_ranks_cpu``, which upstream keeps on the host.
    """
    mirror = getattr(owner, _MIRROR_ATTR, None)
    if mirror is None:
        device_mask = owner.active_ranks
        cpu = owner.active_ranks_cpu
        mirror = ActiveRanksMirror(
            int(device_mask.numel()),
            cpu if cpu is not None else None,
            device_mask=device_mask,
        )
        setattr(owner, _MIRROR_ATTR, mirror)
    return mirror


def state_is_active_equal_last(self: Any) -> bool:
    """REPLACE for ``ElasticEPState.is_active_equal_last``: read the mirror, never the GPU.

    Folds in the device snapshot queued on an earlier call (if complete) and queues the next.
    """
    mirror = mirror_of(self)
    mirror.poll_refresh()
    mirror.refresh_async()
    return not mirror.changed_since_snapshot()


def state_after_snapshot_active_to_last(result: Any, self: Any) -> None:
    """AFTER ``ElasticEPState.snapshot_active_to_last``: the mirror snapshots at the next
    ``sync_active_to_cpu`` (upstream always pairs the two), when it learns the new mask."""
    mirror_of(self).snapshot_on_next_set()
    return None


def state_after_sync_active_to_cpu(result: Any, self: Any) -> None:
    """AFTER ``ElasticEPState.sync_active_to_cpu``: a membership event; the host copy is fresh."""
    if self.active_ranks_cpu is not None:
        mirror = mirror_of(self)
        mirror.set_mask(self.active_ranks_cpu)
        slot_history(self).observe(mirror.as_list())
    return None


def maybe_recover_ep_ranks(
    *,
    tp_group: Any,
    eplb_manager: Any,
    model_config: Any,
    moe_ep_rank: int,
) -> bool:
    """REPLACE for ``elastic_ep.maybe_recover_ep_ranks``: upstream's logic, reading the mirror.

    Upstream reads ``tp_group.active_ranks`` (CUDA) with ``.all()`` and ``.cpu()`` on every
    forward while a rank is missing. Here the missing ranks come from the mirror of that tensor
    (refreshed without blocking) and the host mask; the collective steps are upstream's own.
    """
    mirror = mirror_of(tp_group)
    mirror.poll_refresh()
    mirror.refresh_async()
    cpu = tp_group.active_ranks_cpu
    cpu_vals = cpu.tolist() if cpu is not None else [1] * mirror.size
    ranks_to_recover = [
        i
        for i in range(mirror.size)
        if not (mirror.is_active(i) and (i >= len(cpu_vals) or cpu_vals[i]))
    ]
    if not ranks_to_recover:
        return False
    return recover_ranks(ranks_to_recover, mirror, eplb_manager=eplb_manager,
                         model_config=model_config, moe_ep_rank=moe_ep_rank)


def recover_ranks(ranks: list[int], mirror: ActiveRanksMirror, *, eplb_manager: Any,
                  model_config: Any, moe_ep_rank: int) -> bool:
    """Upstream's recovery steps for replacements of ``ranks`` (every survivor, on the same
    pass): WORLD and the launch-time groups take them back, the healthy ranks broadcast the
    expert map, the active masks count them again. False when a replacement is not in WORLD
    yet (nothing changed)."""
    ee = elastic_ep_module()
    try:
        if not ee.try_recover_ranks(ranks):
            return False  # polled every pass until the replacement is in WORLD: nothing else read
    except ReplacementGone as exc:
        logger.error("[elastic-ep] taking back ranks %s stopped: %s", ranks, exc)
        return False
    state = elastic_state()
    kind = slot_history(state).join_kind(ranks) if state is not None else None
    # The replacement takes the failed rank's slots: the locations broadcast below put its
    # experts back where they were.
    _replace_nixl_peers(ranks)
    ee.broadcast_global_expert_location_metadata(
        model_config=model_config,
        moe_ep_rank=moe_ep_rank,
        src_rank=ee.get_healthy_expert_location_src_rank(invoked_in_elastic_ep_rejoin_path=False),
    )
    ee.ElasticEPStateManager.instance().reset()
    mirror.set_active(ranks)
    if kind is not None:
        note_join(state, ranks, kind, eplb_manager)
    logger.info("recover ranks %s done", ranks)
    return True


def _replace_nixl_peers(ranks: list[int]) -> None:
    """The recovered ranks are new processes: the NIXL data plane (if in use) reconnects them
    at the next dispatch, where the replacement connects to everyone."""
    try:
        from sglang.srt.layers.moe.token_dispatcher.nixl import NixlEPBuffer
    except ImportError:
        return
    state = NixlEPBuffer._state()
    membership = getattr(state, "membership", None)
    if membership is not None:
        membership.replace(ranks)


# ------------------------------------------------------------------ hooks (gated entry points)
# Registered through sglang_elastic_ep.hooks.HOOKS. Without elastic EP each is upstream itself.


def hook_nixl_on_scale(original: Callable[..., Any], cls: Any, *args: Any, **kwargs: Any) -> None:
    """AROUND ``NixlEPBuffer.on_scale`` -> :func:`nixl_on_scale` when elastic EP is on."""
    if not elastic_ep_enabled():
        return original(cls, *args, **kwargs)
    return nixl_on_scale(cls, *args, **kwargs)


def hook_nixl_get_nixl_buffer(
    original: Callable[..., Any], cls: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``NixlEPBuffer.get_nixl_buffer`` -> :func:`nixl_get_nixl_buffer` when on."""
    if not elastic_ep_enabled():
        return original(cls, *args, **kwargs)
    return nixl_get_nixl_buffer(cls, *args, **kwargs)


def hook_is_active_equal_last(original: Callable[..., Any], self: Any) -> bool:
    """AROUND ``ElasticEPState.is_active_equal_last`` -> :func:`state_is_active_equal_last`."""
    if not elastic_ep_enabled():
        return original(self)
    return state_is_active_equal_last(self)


def hook_after_snapshot_active_to_last(result: Any, self: Any) -> None:
    """AFTER ``ElasticEPState.snapshot_active_to_last``; nothing without elastic EP."""
    if elastic_ep_enabled():
        state_after_snapshot_active_to_last(result, self)
    return None


def hook_after_sync_active_to_cpu(result: Any, self: Any) -> None:
    """AFTER ``ElasticEPState.sync_active_to_cpu``: refresh the mirror, and warn if some expert
    lost every replica (a membership event, so host work is fine here)."""
    if not elastic_ep_enabled():
        return None
    state_after_sync_active_to_cpu(result, self)
    from sglang_elastic_ep.sglang import expert_dispatch

    expert_dispatch.log_replica_coverage(self.active_ranks_cpu)
    return None


def hook_maybe_recover_ep_ranks(original: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """AROUND ``elastic_ep.maybe_recover_ep_ranks`` -> :func:`maybe_recover_ep_ranks` when on."""
    if not elastic_ep_enabled():
        return original(*args, **kwargs)
    return maybe_recover_ep_ranks(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """``HOOKS``: this module's rows of the plugin's hook table (the one source of truth)."""
    if name == "HOOKS":
        from sglang_elastic_ep import hooks

        return [
            (h.target, h.resolve(), h.kind, h.why)
            for h in hooks.HOOKS
            if h.impl.startswith(f"sglang.{__name__.rpartition('.')[2]}:")
        ]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

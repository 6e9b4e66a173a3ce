"""Look-ups of SGLang state shared by the adapter modules, in one place.

Each function imports SGLang inside its body, so importing the adapter never loads SGLang's
heavy modules; the functions themselves are cheap enough for the forward path. Modules import
the names they use (``from ...upstream import state_manager``), so a test can replace a look-up
for one module with ``monkeypatch.setattr(module, name, ...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Upstream's own ``scale_phase`` when it cannot recover failed ranks (``fail_recovery``); not a
# phase this plugin writes, so not one of ``core.phases.Phase``.
RECOVERY_UNSUPPORTED = "recovery_unsupported"


def elastic_ep_enabled() -> bool:
    """Whether this process serves with elastic EP (``--elastic-ep-backend`` was given).

    False before SGLang published its config (unit tests, early imports). Cheap enough for the
    forward path: a dict lookup and two attribute reads, and traceable by torch.compile.
    """
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    if not ctx.is_config_namespace_published("exec"):
        return False
    return ctx.config_bag("exec").moe.elastic_ep_backend is not None


def state_manager() -> Any:
    """Upstream's ``ElasticEPStateManager`` class (the per-process membership state's owner)."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    return ElasticEPStateManager


def elastic_state() -> Any:
    """This process's ``ElasticEPState``; None until elastic EP set it up."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

    return ElasticEPStateManager.instance()


def elastic_ep_module() -> Any:
    """Upstream's ``sglang.srt.elastic_ep.elastic_ep`` module (recovery steps, broadcasts)."""
    from sglang.srt.elastic_ep import elastic_ep

    return elastic_ep


def expert_location_module() -> Any:
    """Upstream's ``sglang.srt.eplb.expert_location`` module (the expert map's metadata)."""
    from sglang.srt.eplb import expert_location

    return expert_location


def expert_location_metadata() -> Any:
    """The global ``ExpertLocationMetadata`` (None before the model runner built it)."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return get_global_expert_location_metadata()


def lockstep_agreement_on(state: Any, parallel: Any) -> bool:
    """The per-pass agreement runs in an elastic deployment with room to grow, on any device: its
    inputs ride in the DP-attention gather upstream runs every pass (``gather_agreement``), so it
    adds no collective and no host sync."""
    if state is None or state.active_ranks is None:
        return False
    return bool(parallel.max_ep_size and parallel.max_ep_size > parallel.tp_size)


def attached_state(owner: Any, attr: str, factory: Callable[[], T]) -> T:
    """The adapter state kept on ``owner`` (an upstream per-process object) under ``attr``,
    built with ``factory`` on first use: one instance per process, no module global."""
    found = getattr(owner, attr, None)
    if found is None:
        found = factory()
        setattr(owner, attr, found)
    return found


def world_host_group() -> Any:
    """WORLD's host-memory process group (``GroupCoordinator.cpu_group`` of SGLang's world
    group; ``mooncake-cpu`` on an elastic server, extended by upstream on every join). A
    collective over it moves host tensors only, on every device: no kernel, no host sync."""
    from sglang.srt.distributed.parallel_state import get_world_group

    return get_world_group().cpu_group


def scale_timeout_s() -> float:
    """``--elastic-ep-scale-timeout``: how long a scale may stay pending, a scale-up waiting
    for its joiners or a scale-down draining (0, no limit, before SGLang published its
    config)."""
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    if not ctx.is_config_namespace_published("exec"):
        return 0.0
    return float(ctx.config_bag("exec").moe.elastic_ep_scale_timeout or 0)

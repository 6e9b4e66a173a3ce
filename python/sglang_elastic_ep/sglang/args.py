"""Our command-line flags, added to SGLang's parser and copied onto ``ServerArgs``.

``--ep-join-mode`` is the RFC's name for upstream's ``--elastic-ep-join-mode``; both are
accepted, and giving both with different values is a startup error.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from sglang_elastic_ep.core.stall import MOONCAKE_HEARTBEAT_TIMEOUT_S

# Spawned SGLang children inherit the environment: the Mooncake timeout flags travel to the
# process-group setup this way (read where WORLD's options are built).
ENV_COLLECTIVE_TIMEOUT = "SGLANG_EEP_COLLECTIVE_TIMEOUT_S"
ENV_FAULT_WINDOW = "SGLANG_EEP_FAULT_WINDOW_S"

# A fault window this long closes after that timeout has taken a dead process's rank out, so a
# survivor whose report is the only one in cannot be evicted in its place.
FAULT_WINDOW_PAST_HEARTBEAT_S = MOONCAKE_HEARTBEAT_TIMEOUT_S + 5.0

# flag -> (dest on ServerArgs, default, type, help)
EXTRA_FLAGS: dict[str, tuple[str, Any, type, str]] = {
    "--ep-join-mode": (
        "eep_join_mode_alias", None, str,
        "RFC name of --elastic-ep-join-mode: 'scale' (a new rank) or 'recover' (a failed one)",
    ),
    "--elastic-ep-drain-timeout": (
        "elastic_ep_drain_timeout", 120.0, float,
        "seconds leaving shards may spend finishing running requests on scale-down",
    ),
    "--elastic-ep-collective-timeout": (
        "elastic_ep_collective_timeout", None, float,
        "Mooncake collective timeout in seconds (Mooncake's default when unset)",
    ),
    "--elastic-ep-fault-window": (
        "elastic_ep_fault_window", None, float,
        "Mooncake fault-reconciliation window in seconds (Mooncake's default when unset); from "
        "three ranks on keep it above Mooncake's 30 s heartbeat timeout, e.g. 35",
    ),
    "--elastic-ep-slow-expert-threshold": (
        "elastic_ep_slow_expert_threshold", 3.0, float,
        "an expert is slow when its time per token exceeds this multiple of the median expert's",
    ),
    "--elastic-ep-slow-expert-checks": (
        "elastic_ep_slow_expert_checks", 10, int,
        "consecutive health checks with most of a rank's experts slow before it is blocked",
    ),
    "--elastic-ep-health-interval": (
        "elastic_ep_health_interval", 2.0, float,
        "seconds between expert-latency health checks (0 turns them off)",
    ),
    "--elastic-ep-stall-timeout": (
        "elastic_ep_stall_timeout", 60.0, float,
        "seconds with requests waiting and no answer from any scheduler before the status and "
        "health report the server stalled (0 turns the check off)",
    ),
    "--elastic-ep-expert-min-ranks": (
        "elastic_ep_expert_min_ranks", 1, int,
        "every EPLB layout keeps each expert on at least this many ranks, so that this many "
        "minus one ranks can fail with every expert still served (1: EPLB's layout as is)",
    ),
    "--elastic-ep-webhook-url": (
        "elastic_ep_webhook_url", None, str,
        "URL that receives elastic EP events as JSON POSTs (retried with backoff)",
    ),
}


def add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    """AFTER hook on ``ServerArgs.add_cli_args``."""
    group = parser.add_argument_group("sglang-elastic-ep")
    for flag, (dest, default, typ, help_text) in EXTRA_FLAGS.items():
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "type": typ, "help": help_text}
        if flag == "--ep-join-mode":
            kwargs["choices"] = ["scale", "recover"]
        group.add_argument(flag, **kwargs)


def resolve_join_mode(upstream: str | None, alias: str | None) -> str | None:
    """The join mode from upstream's flag and the RFC alias; conflicting values are an error."""
    if alias is None:
        return upstream
    if upstream is not None and upstream != alias:
        raise ValueError(
            f"--ep-join-mode {alias} contradicts --elastic-ep-join-mode {upstream}: "
            "give one of them (they are the same setting)"
        )
    return alias


def join_mode_for_slot(mode: str | None, join_rank_offset: int) -> str | None:
    """A replacement for ranks that joined by scale-up (``--ep-join-mode recover`` with the
    join offset of their slots) joins the way they did: as a scale joiner. The survivors know
    the slots failed and re-admit it there (sglang/tail_recovery.py); upstream's recover mode
    only rebuilds the launch-time world."""
    if mode == "recover" and join_rank_offset > 0:
        return "scale"
    return mode


def from_cli_args(server_args: Any, cls: Any, args: argparse.Namespace) -> None:
    """AFTER hook on ``ServerArgs.from_cli_args``: carry our flags onto the instance."""
    for dest, default, _typ, _help in EXTRA_FLAGS.values():
        setattr(server_args, dest, getattr(args, dest, default))
    # Spawned SGLang children inherit the environment, so process-wide settings travel there.
    for env, value in (
        (ENV_COLLECTIVE_TIMEOUT, server_args.elastic_ep_collective_timeout),
        (ENV_FAULT_WINDOW, server_args.elastic_ep_fault_window),
    ):
        if value is not None:
            if value <= 0:
                raise ValueError(f"{env}: Mooncake timeouts must be positive seconds, got {value}")
            os.environ[env] = str(value)
    largest = max(int(server_args.ep_size), declared_max_ep_size(server_args) or 0)
    for short in (fault_window_too_short(server_args.elastic_ep_collective_timeout,
                                         server_args.elastic_ep_fault_window),
                  fault_window_within_heartbeat(server_args.elastic_ep_fault_window, largest)):
        if short:
            logging.getLogger(__name__).warning("[elastic-ep] %s", short)
    from sglang_elastic_ep.core.health import HealthConfig

    HealthConfig(  # bad thresholds are a startup error, not a failure in the HTTP process
        latency_threshold=server_args.elastic_ep_slow_expert_threshold,
        persistence_threshold=server_args.elastic_ep_slow_expert_checks,
    )
    if server_args.elastic_ep_stall_timeout < 0:
        raise ValueError("--elastic-ep-stall-timeout must be >= 0 seconds (0: off), got "
                         f"{server_args.elastic_ep_stall_timeout}")
    if server_args.elastic_ep_health_interval < 0:
        raise ValueError("--elastic-ep-health-interval must be >= 0 seconds (0: off), got "
                         f"{server_args.elastic_ep_health_interval}")
    if server_args.elastic_ep_expert_min_ranks < 1:
        raise ValueError("--elastic-ep-expert-min-ranks must be >= 1, got "
                         f"{server_args.elastic_ep_expert_min_ranks}")
    drain, scale = server_args.elastic_ep_drain_timeout, getattr(
        server_args, "elastic_ep_scale_timeout", None)
    if drain < 0:
        raise ValueError(f"--elastic-ep-drain-timeout must be >= 0 seconds, got {drain}")
    if scale is not None and drain >= scale:
        # A scale-down still draining at the scale timeout is called off: it would be called off
        # before its stragglers were ended.
        raise ValueError(f"--elastic-ep-drain-timeout ({drain:g} s) must be below "
                         f"--elastic-ep-scale-timeout ({scale:g} s): lower the drain timeout or "
                         "raise the scale timeout")
    prefer_elasticity_aware_eplb(server_args)
    server_args.ep_join_mode = join_mode_for_slot(
        resolve_join_mode(getattr(server_args, "ep_join_mode", None),
                          server_args.eep_join_mode_alias),
        int(getattr(server_args, "ep_join_rank_offset", 0) or 0),
    )
    reserve_room_to_grow(server_args)


def prefer_elasticity_aware_eplb(server_args: Any) -> None:
    """With elastic EP, EPLB's ``auto`` picks upstream's elasticity-aware algorithm, which packs
    experts onto the active ranks only (``deepseek``, the usual ``auto``, would place experts on
    a failed rank's slots)."""
    if (getattr(server_args, "elastic_ep_backend", None) is not None
            and getattr(server_args, "enable_eplb", False)
            and getattr(server_args, "eplb_algorithm", None) == "auto"):
        server_args.eplb_algorithm = "elasticity_aware"


def declared_max_ep_size(server_args: Any) -> int | None:
    """The ``--max-ep-size`` the operator gave (the largest size a scale request may ask for),
    which :func:`reserve_room_to_grow` may have raised internally."""
    return getattr(server_args, "eep_declared_max_ep_size", None) or getattr(
        server_args, "max_ep_size", None)


def reserve_room_to_grow(server_args: Any) -> None:
    """A deployment launched at its ``--max-ep-size`` (and every joiner or replacement of one)
    gets one attention replica of capacity above it, reserved and never offered.

    Upstream turns its runtime-scale machinery on (the expandable WORLD, the joiners' DP gather,
    and with it this plugin's per-pass agreement) only when ``--max-ep-size`` is above the
    launch size, so a deployment launched at its maximum could neither shrink nor grow back.
    Every process of the deployment computes the same capacity from the same flags (a scale
    joiner's launch size is its ``--elastic-ep-initial-size``); scale requests above the
    declared maximum are still refused with 400. The cost: NIXL buffers and the active-rank
    mask sized for one more replica."""
    declared = getattr(server_args, "max_ep_size", None)
    if getattr(server_args, "elastic_ep_backend", None) is None or not declared:
        return
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    if getattr(server_args, "ep_join_mode", None) == "scale":
        launch = getattr(server_args, "elastic_ep_initial_size", None)
    else:
        launch = getattr(server_args, "elastic_ep_initial_size", None) or tp
    if launch is None or int(launch) != int(declared):
        return
    # Before SGLang resolves the arguments, the attention-DP degree may still sit in dp_size
    # (``--dp N --enable-dp-attention``) or already in attn_dp_size.
    dp = max(int(getattr(server_args, "attn_dp_size", 1) or 1),
             int(getattr(server_args, "dp_size", 1) or 1))
    replica = tp // dp if tp % dp == 0 else tp
    server_args.eep_declared_max_ep_size = int(declared)
    server_args.max_ep_size = int(declared) + max(1, replica)


def joins_a_released_launch_slot(join_mode: str | None, join_rank_offset: int,
                                 initial_size: int | None) -> bool:
    """A scale joiner whose slots lie inside the launch size: they were launch-time slots a
    scale-down released (the primary admits a joiner only at its current size)."""
    return join_mode == "scale" and initial_size is not None and join_rank_offset < initial_size


def check_elastic_ep_args(original: Any, server_args: Any) -> Any:
    """AROUND ``parallel_hook.handle_elastic_ep``: upstream refuses a scale joiner whose offset
    is below ``--elastic-ep-initial-size``, because it assumes joiners only append past the
    launch layout. After a scale-down below the launch size the expert map ends at the
    current size, so a joiner into a released launch slot appends at its own offset like any
    other: upstream's checks run with the launch size declared equal to the offset, and the
    real launch size (which fixes the slots per rank) is declared again after them."""
    from sglang.srt.arg_groups.model_override_base import resolving_view
    from sglang.srt.arg_groups.overrides import declare_resolution

    cfg = resolving_view(server_args)
    launch = cfg.elastic_ep_initial_size
    offset = int(cfg.ep_join_rank_offset or 0)
    if not joins_a_released_launch_slot(cfg.ep_join_mode, offset, launch):
        return original(server_args)
    declare_resolution(server_args, "sglang_elastic_ep.released_launch_slot",
                       elastic_ep_initial_size=offset)
    try:
        return original(server_args)
    finally:
        declare_resolution(server_args, "sglang_elastic_ep.released_launch_slot",
                           elastic_ep_initial_size=launch)


def fault_window_within_heartbeat(fault_window: float | None, largest_ep_size: int
                                  ) -> str | None:
    """Why the fault window given can cost a live rank at up to ``largest_ep_size`` ranks, or
    None.

    From three ranks on, a rank can die below a survivor. When that survivor's report is the
    only one in as the window closes (the other survivor's collective waits on it), Mooncake
    evicts the survivor in place of the dead rank. A window longer than Mooncake's heartbeat
    timeout closes after that timeout took a dead process's rank out (docs/operations.md,
    "Fault timing")."""
    if (fault_window is None or largest_ep_size < 3
            or fault_window > MOONCAKE_HEARTBEAT_TIMEOUT_S):
        return None
    return (f"--elastic-ep-fault-window {fault_window:g} is not above Mooncake's "
            f"{MOONCAKE_HEARTBEAT_TIMEOUT_S:g} s heartbeat timeout, and this deployment can have "
            f"{largest_ep_size} ranks: when only a survivor above a dead rank has reported it as "
            "the window closes, Mooncake evicts that survivor instead; use "
            f"--elastic-ep-fault-window {FAULT_WINDOW_PAST_HEARTBEAT_S:g} (each death then "
            "pauses serving about that long)")


def fault_window_too_short(collective_timeout: float | None, fault_window: float | None
                           ) -> str | None:
    """Why the fault window given is too short for the collective timeout given, or None.

    Mooncake's coordinator decides whom to evict when the window closes, from the failed links
    reported by then. A survivor that notices a death only through the collective timeout
    reports after it; if only a faster survivor's report is in, the dead rank and that reporter
    look equally connected and the tie goes against the higher rank: a live rank is evicted
    (docs/operations.md, "Fault timing")."""
    if collective_timeout is None or fault_window is None or fault_window >= 2 * collective_timeout:
        return None
    return (f"--elastic-ep-fault-window {fault_window:g} is below twice "
            f"--elastic-ep-collective-timeout {collective_timeout:g}: a survivor that notices a "
            "death through the timeout may report it after the window closed, and Mooncake can "
            f"then evict a live rank; use --elastic-ep-fault-window {2 * collective_timeout:g} "
            "or more")

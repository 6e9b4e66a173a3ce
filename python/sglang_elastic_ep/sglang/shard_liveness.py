"""One reporter of shard liveness: the scheduler of EP rank 0.

Each DP-attention scheduler tells the tokenizer after its batches (and, with this plugin, after
its idle iterations) which DP shards are alive, each from its own view of the membership.
Around a death the survivors learn of it on different passes (one in its forward, another only
at its next idle iteration), so for a while their reports disagree, and the tokenizer saw the
dead shard fail, come back and fail again: ``rank_failed``, ``rank_recovered``, ``rank_failed``
went to the orchestrator for one death. Rank 0's scheduler serves as long as the deployment
does (its server hosts the HTTP server), and its view changes only on a death it saw itself or
on a membership pass every rank agreed on, so its reports alone are consistent. The other
schedulers still hand over the scale results they hold (upstream sends them in the same call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, elastic_state


def report_from_rank_zero_only(original: Callable[..., None], scheduler: Any) -> None:
    """AROUND ``Scheduler._maybe_report_active_ranks``."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    if (not elastic_ep_enabled() or not getattr(scheduler, "attn_dp_enabled", False)
            or runner is None or runner._elastic_global_rank() == 0):
        return original(scheduler)
    state = elastic_state()
    if state is None or state.active_ranks_cpu is None:
        return None  # upstream sends nothing then either
    pending = runner._pending_elastic_scale_update
    if pending is not None:
        scheduler.ipc_channels.send_to_tokenizer.send_output(pending)
        runner._pending_elastic_scale_update = None
    return None

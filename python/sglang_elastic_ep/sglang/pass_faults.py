"""A peer that fails during a forward pass: that pass's requests end with 503, out of the cache.

The data plane notices a dead peer inside the forward that needs it: NIXL EP masks the peer
during dispatch or combine, and upstream copies the mask into the elastic state's
``active_ranks`` after every combine (``nixl.py``, ``_combine_core``); Mooncake marks it in the
same tensor during a collective. That forward then ran without the dead peer's expert outputs,
so its tokens are wrong, and a prefill's KV written in it would be reused from the prefix cache
by later requests with the same prompt. Mask-aware routing only helps from the next forward on.

So each forward is watched: the mask is cloned when the forward starts, and when the model's
forward is done (before any membership step of the pass, which may retire ranks on purpose)
``lost`` is computed on the mask's device: some rank active at the start is inactive now. The
flag goes to the host with the forward's results: a non-blocking copy enqueued before upstream's
own copy of the sampled tokens, so upstream's wait for those (``copy_done``) covers it and no
host sync is added. When the batch's results are processed, every request of a flagged pass
ends with HTTP 503 and a message (retrying is safe), its output is not committed and its KV is
kept out of the radix cache (``skip_radix_cache_insert``).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_ep_enabled, elastic_state

logger = get_logger(__name__)

# The 503's message; clients and tests tell these from other failures by it.
PEER_FAILED_DURING_FORWARD = (
    "a peer EP rank failed during this request's forward pass, so its output would be wrong; "
    "nothing of it was kept: retry the request"
)
RESULT_ATTR = "elastic_ep_peer_lost"
_WATCH_ATTR = "_elastic_ep_pass_faults"


@dataclass
class PassFaultWatch:
    """The forward in flight on this process: the mask at its start and, once the model's
    forward is done, whether a rank active then is inactive now (a device bool)."""

    before: torch.Tensor | None = None
    lost: torch.Tensor | None = None


def pass_fault_watch(state: Any) -> PassFaultWatch:
    return attached_state(state, _WATCH_ATTR, PassFaultWatch)


def ranks_lost(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the masks' device: some rank active in ``before`` is inactive in
    ``after``. Ranks that became active (a commit, a recovery) do not count."""
    if before.shape != after.shape:
        return torch.zeros((), dtype=torch.bool, device=after.device)
    return ((before != 0) & (after == 0)).any()


def model_forward_done(state: Any) -> None:
    """Called when the model's forward of the pass is done and before the pass's membership
    step: take ``lost`` now, so ranks a scale-down or a let-go retires on this pass on purpose
    never count. Later calls in the same forward (a draft model's) keep the first answer."""
    watch = pass_fault_watch(state)
    if watch.before is not None and watch.lost is None:
        watch.lost = ranks_lost(watch.before, state.active_ranks)


def _to_host(flag: torch.Tensor) -> torch.Tensor:
    if flag.device.type == "cpu":
        return flag
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(flag, non_blocking=True)  # on the forward's stream, before upstream's copy
    return host


def forward_watched(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``TpModelWorker.forward_batch_generation``: clone the mask, run the forward, and
    hang the pass's ``lost`` flag (host memory) on the result as :data:`RESULT_ATTR`."""
    state = elastic_state() if elastic_ep_enabled() else None
    if state is None or state.active_ranks is None:
        return original(worker, *args, **kwargs)
    watch = pass_fault_watch(state)
    watch.before, watch.lost = state.active_ranks.clone(), None
    try:
        result = original(worker, *args, **kwargs)
        model_forward_done(state)  # no membership step ran in this forward: take it now
        if result is not None and watch.lost is not None:
            setattr(result, RESULT_ATTR, _to_host(watch.lost))
        return result
    finally:
        watch.before = watch.lost = None


def end_requests_of_a_faulted_pass(original: Any, processor: Any, batch: Any, result: Any,
                                   *args: Any, **kwargs: Any) -> Any:
    """AROUND ``SchedulerBatchResultProcessor.process_batch_result_prefill`` and ``_decode``:
    on a pass whose forward lost a peer, every request of the batch ends with 503 before its
    result is committed, and none of its KV enters the prefix cache."""
    flag = getattr(result, RESULT_ATTR, None)
    if flag is not None:
        copy_done = getattr(result, "copy_done", None)
        if copy_done is not None:
            copy_done.synchronize()  # upstream's own wait, a few lines early; it covers the flag
        if bool(flag):
            end_with_503(batch.reqs)
    return original(processor, batch, result, *args, **kwargs)


def abort_reason() -> Any:
    """Upstream's finish reason for a request ended by the server: 503 with our message."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(PEER_FAILED_DURING_FORWARD, HTTPStatus.SERVICE_UNAVAILABLE,
                        "ServiceUnavailableError")


def end_with_503(reqs: list[Any]) -> int:
    """Mark ``reqs`` to end with 503 at this result (the prefill and decode paths both honour
    ``to_finish``) and keep their KV out of the radix cache; how many were marked."""
    marked = 0
    for req in reqs:
        if req.finished():
            continue
        req.to_finish = abort_reason()
        req.skip_radix_cache_insert = True
        marked += 1
    if marked:
        logger.warning("[elastic-ep] a peer rank failed during this pass's forward: its %d "
                       "request(s) end with 503 and stay out of the prefix cache", marked)
    return marked

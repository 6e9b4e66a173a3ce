"""Enter the first collective after an admission only once this rank's Mooncake view has it.

Mooncake PG (control-plane design) admits ranks through a view update that its coordinator
commits and each process's agent applies in the background. Applying a view resets the group's
collective counter (``taskCount``), whose parity picks the buffer slot of the next collective,
and sets the active set whose sync flags a collective waits for (``mooncake_worker_thread.cpp``).
``recover_ranks`` can return on a rank before that rank's agent applied the view. Upstream then
broadcasts the expert map at once (``_finalize_scale_up``): a rank still on the old view waits
in the old slot for the old members while the others, on the new view, complete the broadcast
without it and wait in the next barrier. That is the 3 -> 4 hang with a scale-joined rank 2 as
a member (docs/design.md).

So after WORLD admits ranks, each rank waits (locally, no collective) until its own view shows
them active. On the usual path the view is already applied and the wait costs one call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)

VIEW_APPLY_TIMEOUT_S = 60.0
_POLL_S = 0.01


def wait_for_local_view(
    active_ranks: Callable[[], Sequence[int]],
    ranks: Sequence[int],
    timeout_s: float = VIEW_APPLY_TIMEOUT_S,
    poll_s: float = _POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Poll ``active_ranks()`` until every rank in ``ranks`` is active: the seconds waited, or
    None when the view did not show them within ``timeout_s``."""
    start = clock()
    while True:
        view = list(active_ranks())
        if all(0 <= r < len(view) and view[r] for r in ranks):
            return clock() - start
        if clock() - start >= timeout_s:
            return None
        sleep(poll_s)


def admit_then_wait_for_view(original: Callable[[list[int]], bool], global_ranks: list[int]
                             ) -> bool:
    """AROUND ``elastic_ep._try_recover_world`` (scale-up admission and rank recovery)."""
    if not original(global_ranks):
        return False
    from mooncake.pg import get_active_ranks, get_current_epoch

    world = dist.group.WORLD
    waited = wait_for_local_view(lambda: get_active_ranks(world).tolist(), global_ranks)
    epoch = get_current_epoch(world)
    if waited is None:
        # Going on risks the hang this hook exists for; failing would strand the joiners. Say
        # which view this rank is on so the hang (if it comes) can be read from the log.
        logger.error("[elastic-ep] rank %d: Mooncake WORLD view (epoch %d, active %s) still "
                     "lacks admitted ranks %s after %.0f s", dist.get_rank(), epoch,
                     get_active_ranks(world).tolist(), global_ranks, VIEW_APPLY_TIMEOUT_S)
    else:  # one line per admission: which view each rank entered the next collective on
        logger.info("[elastic-ep] rank %d: Mooncake WORLD view epoch %d has admitted ranks %s "
                    "(waited %.2f s for it)", dist.get_rank(), epoch, global_ranks, waited)
    return True

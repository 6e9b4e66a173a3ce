"""A scale-up's commit barrier as an agreement on whether every joiner made it into WORLD.

The serving ranks and the joiners meet in one barrier over WORLD before the commit
(``ModelRunner._elastic_scale_ready_barrier``). Mooncake can put a joiner into the view and
then give up on it: its agent does not acknowledge the view update in time (it hangs, for one
in ``join_group``), or it dies. Its peers then count it out of WORLD and their collectives skip
it, so upstream's barrier passes without it and every serving rank would commit the new size
with the joiner's slot marked live. On an idle cluster no forward pass fails on that slot: the
status would show a size with a slot that never serves, and control requests would wait for
its scheduler.

So the barrier is an all-reduce instead, one collective as before: each member adds 1 when it
counts some joiner out of Mooncake's WORLD (a joiner adds 0). Every member reads the same sum:

- 0: the commit goes ahead as upstream's.
- more: the serving ranks commit (upstream commits right after the barrier) and then mark the
  joiners failed in their mask (:func:`serving_rank_commit`), all on the same pass,
  so the next pass's agreement lets their slots go (``tail_recovery``), as for a joiner that
  dies just after its commit. They also count it out in the rendezvous store
  (``replacement_notices``): a joiner that never reached the barrier (still in
  ``join_group``, or admitted by Mooncake too late, then waiting in a collective the others
  left) reads that and exits, so its relaunch can follow at once. A joiner that reached the
  barrier although some serving rank counted it out stops with an error: the others are about
  to let its slot go, and a relaunch in recover mode brings it back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.sglang import replacement_notices
from sglang_elastic_ep.sglang.nixl_buffer_hooks import prepare_data_plane
from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_ep_enabled, elastic_state
from sglang_elastic_ep.sglang.world_view import world_members_alive

logger = get_logger(__name__)

_STATE_ATTR = "_sglang_eep_commit_barrier"


class CountedOutOfWorld(RuntimeError):
    """A joiner met the serving ranks at the commit, but some of them had counted it out."""


@dataclass
class CommitBarrierState:
    # Inside upstream's ``_finalize_scale_up``: this rank serves and admits joiners. A process
    # that joined by scale-up keeps upstream's joiner flag for good, and serves in every later
    # scale-up, so the flag cannot tell the two sides of the barrier apart; the path can.
    serving_commit: bool = False
    # The joiners this rank's last commit barrier agreed were counted out of WORLD; marked
    # failed once upstream's commit (which marks every slot of the new size live) returned.
    counted_out: tuple[int, ...] = ()


def agree_at_commit(joining: Sequence[int], counts_out: Callable[[Sequence[int]], bool],
                    all_reduce_sum: Callable[[int], int]) -> bool:
    """Whether every member counts every one of ``joining`` as in WORLD: this rank's answer
    (``counts_out``; a joiner passes no ranks) summed over the barrier's members."""
    mine = 1 if joining and counts_out(joining) else 0
    return all_reduce_sum(mine) == 0


def counts_a_joiner_out(joining: Sequence[int]) -> bool:
    """Whether this rank's Mooncake WORLD view no longer counts some of ``joining`` as live
    members (offline, or never acknowledged the admission)."""
    return not all(world_members_alive(list(joining)))


def _world_sum(like: torch.Tensor) -> Callable[[int], int]:
    def reduce(value: int) -> int:
        total = like.new_tensor([value])
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
        return int(total.item())  # a membership step, not the forward pass: one host read

    return reduce


def agreed_commit_barrier(original: Callable[..., Any], runner: Any, target_size: int,
                          log_tag: str) -> None:
    """AROUND ``ModelRunner._elastic_scale_ready_barrier`` (the serving ranks from
    ``_finalize_scale_up``, a joiner from ``_finalize_elastic_ep_joiner``): connect the NIXL
    data plane to the new ranks (both sides at once, instead of at the first dispatch after the
    commit), then meet in the agreed barrier (see the module docstring)."""
    state = elastic_state()
    if not elastic_ep_enabled() or state is None:
        return original(runner, target_size=target_size, log_tag=log_tag)
    prepare_data_plane(runner.model, connect=True)
    holder = attached_state(state, _STATE_ATTR, CommitBarrierState)
    joining = (tuple(range(int(state.effective_ep_size), int(target_size)))
               if holder.serving_commit else ())
    agreed = agree_at_commit(joining, counts_a_joiner_out, _world_sum(state.active_ranks))
    if agreed:
        return None
    rank = dist.get_rank()
    if not holder.serving_commit:
        raise CountedOutOfWorld(
            f"rank {rank}: the serving ranks counted this joiner out of Mooncake's WORLD during "
            f"its admission to EP size {target_size}; they let its slot go. Relaunch it with "
            "--ep-join-mode recover")
    holder.counted_out = joining
    logger.warning("[elastic-ep] rank %d: at the commit to EP size %d some rank counted joiners "
                   "%s out of Mooncake's WORLD (admission not acknowledged, or the process "
                   "died): the commit goes ahead and their slots are marked failed",
                   rank, target_size, list(joining))
    return None


def serving_rank_commit(original: Callable[..., Any], runner: Any,
                        *args: Any, **kwargs: Any) -> Any:
    """AROUND ``ModelRunner._finalize_scale_up`` (a serving rank's admission and commit): the
    barrier inside it is this rank's serving side; after upstream's commit (it marks every
    slot of the new size live), the joiners the barrier counted out are marked failed, as a
    dispatcher does for a peer that stops answering, and the next pass lets their slots go."""
    state = elastic_state()
    if state is None:
        return original(runner, *args, **kwargs)
    holder = attached_state(state, _STATE_ATTR, CommitBarrierState)
    holder.serving_commit = True
    try:
        result = original(runner, *args, **kwargs)
    finally:
        holder.serving_commit = False
    counted_out, holder.counted_out = holder.counted_out, ()
    if counted_out:
        mark_failed(state, counted_out)
        logger.warning("[elastic-ep] rank %d: joiners %s marked failed after the commit to EP "
                       "size %d: the survivors let their slots go on the next pass; relaunch "
                       "them with --ep-join-mode recover", dist.get_rank(), list(counted_out),
                       state.effective_ep_size)
        tell_the_joiners_they_were_counted_out(counted_out)
    return result


def tell_the_joiners_they_were_counted_out(ranks: Sequence[int]) -> None:
    """The notice a joiner that never reached the barrier watches for; without it (a store
    error) that joiner is left to its own timeouts or its orchestrator: the error costs time,
    not the slot, which is let go either way."""
    try:
        replacement_notices.announce_counted_out(ranks)
    except Exception as exc:  # noqa: BLE001 - the slot is let go either way
        logger.warning("[elastic-ep] could not tell joiners %s they were counted out (%s): "
                       "end any of them still running before relaunching it", list(ranks),
                       exc)


def mark_failed(state: Any, ranks: Sequence[int]) -> None:
    """Clear ``ranks`` in the state's mask and its host copy (not in its snapshot: upstream's
    fault check then sees the change, as for a rank the dispatcher found dead)."""
    for rank in ranks:
        state.active_ranks[rank] = 0
    state.sync_active_to_cpu()

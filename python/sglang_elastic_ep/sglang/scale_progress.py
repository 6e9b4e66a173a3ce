"""Keep elastic membership work moving when a server has no traffic.

Upstream advances a pending scale-up (cohort check, admission, commit) and rank recovery only at
the end of a forward pass (``ModelRunner.maybe_join_ep_ranks``). An idle cluster runs no forward
passes, so a POSTed scale-up waited until the next request arrived (minutes, on a quiet night).

Where the idle step runs matters. With DP attention every rank learns in the same loop
iteration that no rank has work (the token-count all-gather inside
``Scheduler.get_next_batch_to_run``), so "no batch this iteration" is the same on all ranks and
the step's collectives line up. ``Scheduler.on_idle`` is not such a point: the overlap event
loop skips it on the iteration right after a batch (it processes that batch's result instead).
A process that just joined has no previous batch, so on the first idle iteration after a commit
it ran the step while the others did not, and every rank's collective sequence was off by one
from then on (a stall, or ``ValueError: 0 is not a valid ForwardMode``: docs/design.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from sglang_elastic_ep.core.agreement import LockstepVerdict, lockstep_verdict
from sglang_elastic_ep.sglang import expert_health, tail_recovery
from sglang_elastic_ep.sglang.scale_down import finalize_scale_down, is_shrink, scale_down_state
from sglang_elastic_ep.sglang.upstream import elastic_state, lockstep_agreement_on

logger = logging.getLogger(__name__)


def progress_membership_when_idle(plan: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.get_next_batch_to_run``: when no rank has a batch this iteration, run the
    per-forward elastic step that a forward pass would have run (see the module docstring)."""
    if getattr(plan, "batch_to_run", None) is not None:
        return  # the forward pass calls maybe_join_ep_ranks itself
    from sglang.srt.runtime_context import get_parallel

    if not lockstep_agreement_on(elastic_state(), get_parallel()):
        return
    # Called on every idle iteration (not only when this rank sees a scale): the agreement
    # inside maybe_join_ep_ranks is a collective that every rank must enter on the same pass.
    worker = getattr(scheduler, "tp_worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return
    runner.maybe_join_ep_ranks()
    # Upstream reports commits and active ranks to the tokenizer after a batch; do it here too.
    scheduler._maybe_report_active_ranks()


def rebalance_after_rank_fault(original: Any, *, eplb_manager: Any) -> bool:
    """AROUND ``elastic_ep.maybe_rebalance_after_rank_fault``: without ``--enable-eplb`` there is
    no manager to rebalance with (upstream dereferences None and kills the scheduler). Record the
    new active set and rely on the mask-aware dispatch (``expert_dispatch``) to route tokens to
    live replicas instead."""
    if eplb_manager is not None:
        return original(eplb_manager=eplb_manager)
    state = elastic_state()
    if state is None or state.is_active_equal_last():
        return False
    state.snapshot_active_to_last()
    state.sync_active_to_cpu()
    logger.warning(
        "[elastic-ep] active ranks changed to %s without EPLB: experts of inactive ranks are "
        "served from live replicas where they exist (start with --enable-eplb to rebalance)",
        state.active_ranks_cpu.tolist(),
    )
    return False


def _ready_target(state: Any, target: int) -> int:
    """``target`` when this rank could admit the joiners now, else 0: it sees the request, the
    joining cohort in the store, and every joiner's Mooncake peer state (the local checks
    upstream makes inside ``maybe_join_ep_ranks``)."""
    if not target:
        return 0
    from sglang.srt.elastic_ep.elastic_ep import get_scale_cohort

    effective = state.effective_ep_size
    cohort = get_scale_cohort(effective)
    if cohort is None or cohort.target_ep_size != target:
        # a mismatching cohort is upstream's to report: let every rank enter and fail it
        return target if cohort is not None else 0
    from mooncake.pg import get_peer_state

    joining = list(range(effective, target))
    return target if all(get_peer_state(dist.group.WORLD, joining)) else 0


ENV_TEST_SKEW = "SGLANG_EEP_TEST_SKEW_PASSES"


class ReadinessSkew:
    """Test-only fault injection (``SGLANG_EEP_TEST_SKEW_PASSES=<rank>:<passes>``): that rank
    reports a scale as ready only ``passes`` passes after it could, as if it saw the change
    late. The agreement must then hold the other ranks (serving) until it catches up."""

    @classmethod
    def from_environment(cls, rank: int) -> ReadinessSkew:
        """The knob as the server's environment set it before start (read once, not per pass)."""
        return cls(os.environ.get(ENV_TEST_SKEW), rank)

    def __init__(self, spec: str | None, rank: int) -> None:
        self.passes = 0
        if spec:
            target_rank, _, passes = spec.partition(":")
            if int(target_rank) == rank:
                self.passes = int(passes)
        self.rank = rank
        self._held: dict[int, int] = {}  # target -> passes held back so far

    def entered(self) -> None:
        """The ranks entered a change: the next change is late again (a recovery re-admits
        into the same size a scale-up reached before)."""
        self._held.clear()

    def apply(self, ready: int) -> int:
        if not self.passes or not ready:
            return ready
        held = self._held.get(ready, 0)
        if held < self.passes:
            self._held[ready] = held + 1
            logger.info("[elastic-ep] test skew: rank %d holds back readiness for size %d "
                        "(pass %d of %d)", self.rank, ready, held + 1, self.passes)
            return 0
        return ready


_SKEW_ATTR = "_elastic_ep_readiness_skew"


def readiness_skew(runner: Any) -> ReadinessSkew:
    """This rank's skew, built on first use and kept on its model runner (one per process), so
    the per-pass step reads an attribute, not the environment."""
    skew = getattr(runner, _SKEW_ATTR, None)
    if skew is None:
        skew = ReadinessSkew.from_environment(dist.get_rank())
        setattr(runner, _SKEW_ATTR, skew)
    return skew


def agreed_join_step(original: Any, runner: Any) -> None:
    """AROUND ``ModelRunner.maybe_join_ep_ranks``: enter the membership step only on a pass where
    every active rank is ready for the same change (see
    :func:`sglang_elastic_ep.core.agreement.lockstep_verdict`): a scale up or down, or letting
    go of a failed tail of scale-joined ranks (``tail_recovery``). Upstream let each rank decide
    from local checks (its copy of the request, the cohort key, Mooncake peer state), so under
    load one rank admitted the joiner while another ran the next MoE dispatch, and both hung."""
    from sglang.srt.runtime_context import get_parallel

    state = elastic_state()
    if not lockstep_agreement_on(state, get_parallel()):
        return original(runner)
    tail_recovery.request_return_when_replacement_registered(state)
    target = state.pending_ep_size or 0
    let_go = 0 if target else tail_recovery.contraction_target(state, runner)
    shrinking = is_shrink(state)
    if let_go:  # every survivor is ready as soon as it sees the failure
        target = ready = let_go
    elif shrinking:  # a scale-down: leaving ranks are ready once they hold no request
        ready = scale_down_state(state).ready_to_shrink(state, runner._elastic_global_rank())
    else:
        ready = _ready_target(state, target)
    skew = readiness_skew(runner)
    ready = skew.apply(ready)
    # Expert timings ride along (expert_health): no collective of their own.
    timings = expert_health.local_contribution(runner._elastic_global_rank(),
                                               int(state.active_ranks.numel()))
    reduced = torch.tensor([ready, -ready, target, *timings], dtype=torch.int64)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    expert_health.expert_health_state(state).take_gathered(reduced[3:].tolist())
    verdict = lockstep_verdict(int(reduced[0]), -int(reduced[1]), int(reduced[2]))
    if verdict is LockstepVerdict.WAIT:
        return None
    if verdict is LockstepVerdict.ENTER:
        skew.entered()
        if let_go:
            return tail_recovery.let_go_of_failed_tail(runner, let_go)
        if shrinking:
            return finalize_scale_down(runner, target)
    original(runner)
    tail_recovery.note_committed(state)
    return None

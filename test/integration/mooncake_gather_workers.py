"""One rank of the failed-gather integration test, run in its own process (spawned).

Every rank joins a real ``mooncake-cpu`` WORLD group and runs, twice, what upstream's DP gather
over the expanded WORLD runs (a zeroed tensor of every row, its own row written, an all-reduce
SUM), through the plugin's ``seeing_the_all_reduce``; then ``repair_after_failed_gather`` on the
result. Rows end with their check value, as during the agreement's gather. Round 1 has every
rank; the victim exits before round 2. Before the repair each survivor adds ``STALE`` to every
row, as a dead peer's stale buffer would (the repair must not depend on Mooncake leaving the
sum clean). Each survivor puts its rounds' outcomes on the queue.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

WIDTH = 12
STALE = 7


def sent_row(rank: int, round_index: int) -> list[int]:
    """A row a scheduler sends: upstream's eleven columns (forward mode 2), then its check."""
    from sglang_elastic_ep.sglang.gather_repair import row_check

    tokens = 10 * (rank + 1) + round_index
    values = [tokens, tokens, 1, 0, 1, 2, 0, 0, 1, 0, 0]
    return [*values, row_check(values)]


IDLE = [0, 0, 1, 0, 1, 4, 0, 0, 1, 0, 0, 0]


class GatherInfo:
    """The fields of upstream's ``MLPSyncBatchInfo`` the repair reads and derives."""

    def __init__(self, rows: torch.Tensor, world: int) -> None:
        self.num_dp_ranks, self.tp_size, self.cp_size = world, 1, 1
        self.tp0_info_cpu = rows
        self.global_num_tokens = rows[:, 0].tolist()

    def _get_fallback_tensor(self, device: str) -> torch.Tensor:
        return torch.tensor(IDLE, dtype=torch.int64)


def one_round(rank: int, world: int, round_index: int, stale: int) -> dict[str, Any]:
    from sglang_elastic_ep.sglang.gather_repair import (
        repair_after_failed_gather,
        seeing_the_all_reduce,
    )

    group = dist.group.WORLD
    rows = torch.zeros(world, WIDTH, dtype=torch.int64)
    rows[rank] = torch.tensor(sent_row(rank, round_index))
    with seeing_the_all_reduce(group) as seen:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    summed = rows[:, 0].tolist()
    rows += stale
    info = GatherInfo(rows, world)
    failed = repair_after_failed_gather(info, seen, group, checked=True)
    return {"summed": summed, "failed": failed, "rows": rows.tolist(),
            "tokens": info.global_num_tokens}


def fallback_verdicts(rank: int, world: int) -> list[str]:
    """The verdicts of two fallback rounds over WORLD (see the module docstring)."""
    from types import SimpleNamespace

    from sglang_elastic_ep.core.agreement import Proposal, StepKind
    from sglang_elastic_ep.sglang import expert_health, gather_agreement

    expert_health.local_contribution = lambda own, size: []
    expert_health.expert_health_state = lambda state: SimpleNamespace(take_gathered=list)
    gather_agreement.world_host_group = lambda: dist.group.WORLD
    verdicts = []
    for all_ready in (False, True):
        ready = 3 if all_ready or rank != world - 1 else 0
        gather_agreement.propose = lambda state, runner, batch_idle, ready=ready: Proposal(
            rank=rank, kind=StepKind.GROW, ready=ready, target=3, serving=2)
        state = SimpleNamespace(active_ranks=torch.ones(world, dtype=torch.int32))
        verdicts.append(gather_agreement.agree_by_all_reduce(state, runner=None).verdict.name)
    return verdicts


def run_rank(rank: int, world: int, port: int, victim: int, results: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import mooncake.pg  # noqa: F401  (registers the mooncake-cpu backend)

    dist.init_process_group(backend="mooncake-cpu", rank=rank, world_size=world)
    verdicts = fallback_verdicts(rank, world)
    first = one_round(rank, world, 0, 0)
    dist.barrier()
    if rank == victim:
        os._exit(0)
    second = one_round(rank, world, 1, STALE)
    results.put((rank, first, second, verdicts))
    results.close()
    results.join_thread()  # flushed before the hard exit (Mooncake's threads block a clean one)
    os._exit(0)

"""The agreement's columns through SGLang 0.5.23's own ``MLPSyncBatchInfo.all_gather``, with our
hooks applied by SGLang's HookRegistry, over a one-process group (both of upstream's paths)."""

from __future__ import annotations

import pkgutil
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from sglang_elastic_ep import hooks  # noqa: E402
from sglang_elastic_ep.core.agreement import (  # noqa: E402
    PROPOSAL_COLUMNS,
    LockstepVerdict,
    Proposal,
    StepKind,
)
from sglang_elastic_ep.sglang import expert_health, gather_agreement, tail_recovery  # noqa: E402
from sglang_elastic_ep.sglang.gather_agreement import CHECK_COLUMNS  # noqa: E402
from sglang_elastic_ep.sglang.gather_repair import row_check  # noqa: E402
from sglang_elastic_ep_testbed.cluster.procs import free_port  # noqa: E402

DPA = "sglang.srt.managers.scheduler_components.dp_attn."
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="torch.cuda.is_available() is False: no GPU here, the cuda case is not run")),
]


@pytest.fixture
def world_of_one(request: pytest.FixtureRequest) -> Iterator[str]:
    device = request.param
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield device
    finally:
        dist.destroy_process_group()


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Our dp_attn rows of the hook table, applied by SGLang's registry; undone afterwards."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in hooks.HOOKS:
        if not hook.target.startswith(DPA):
            continue
        owner_path, _, attr = hook.target.rpartition(".")
        owner = pkgutil.resolve_name(owner_path)
        monkeypatch.setattr(owner, attr, getattr(owner, attr))  # restored at teardown
        HookRegistry._apply_target(hook.target, [(HookType[hook.kind], hook.resolve(), None)])
    return pkgutil.resolve_name(DPA.rstrip("."))


def sync_info(dp_attn: Any, num_dp_ranks: int) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return dp_attn.MLPSyncBatchInfo(
        num_dp_ranks=num_dp_ranks, tp_size=1, cp_size=1, num_tokens=3, num_tokens_for_logprob=3,
        can_run_decode_cuda_graph=True, can_run_draft_cuda_graph=True,
        can_run_prefill_cuda_graph=False, is_extend_in_batch=False, local_can_run_tbo=True,
        local_forward_mode=ForwardMode.DECODE.value,
    )


@pytest.mark.parametrize("world_of_one", DEVICES, indirect=True)
@pytest.mark.parametrize("use_all_reduce", [True, False], ids=["expanded-world", "tp-group"])
def test_upstreams_gather_carries_the_proposal_and_keeps_its_own_answers(
    world_of_one: str, hooked: Any, use_all_reduce: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = world_of_one
    dp_attn = hooked
    import sglang.srt.runtime_context as runtime_context

    # Two slots over the expanded WORLD (the second one inactive); one over the TP group.
    slots = 2 if use_all_reduce else 1
    world_mask = torch.tensor([1, 0][:slots], dtype=torch.int32, device=device)
    state = SimpleNamespace(active_ranks=world_mask, active_ranks_cpu=world_mask.cpu())
    tp_group = SimpleNamespace(active_ranks=torch.ones(slots, dtype=torch.int32, device=device),
                               active_ranks_cpu=torch.ones(slots, dtype=torch.int32))
    parallel = SimpleNamespace(tp_group=tp_group)
    monkeypatch.setattr(dp_attn, "get_parallel", lambda: parallel)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: parallel)
    monkeypatch.setattr(gather_agreement, "elastic_state", lambda: state)
    monkeypatch.setattr(tail_recovery, "state_manager",
                        lambda: SimpleNamespace(instance=lambda: state))
    mine = Proposal(rank=0, kind=StepKind.GROW, ready=2, target=2, serving=1)
    monkeypatch.setattr(gather_agreement, "propose", lambda state, runner, batch_idle: mine)
    monkeypatch.setattr(gather_agreement, "_slots_per_rank", lambda: 2)
    monkeypatch.setattr(expert_health, "own_timings", lambda slots: [50, 60, 1, 2])
    monkeypatch.setattr(expert_health, "expert_location_metadata",
                        lambda: SimpleNamespace(num_local_physical_experts=2))

    plain = sync_info(dp_attn, slots)
    plain.all_gather(device=device, group=dist.group.WORLD, use_all_reduce=use_all_reduce)
    assert plain.tp0_info_cpu.shape[1] == 11  # outside a bracketed pass: upstream's row

    agreement = gather_agreement.gather_agreement(state)
    agreement.runner = object()  # what bracket_mlp_sync hands over for the pass
    info = sync_info(dp_attn, slots)
    info.all_gather(device=device, group=dist.group.WORLD, use_all_reduce=use_all_reduce)
    assert info.tp0_info_cpu.shape[1] == 11 + PROPOSAL_COLUMNS + 4 + CHECK_COLUMNS
    row = info.tp0_info_cpu[0].tolist()
    assert row[-1] == row_check(row[:-1])  # this rank's row ends with its check value
    assert info.global_num_tokens == plain.global_num_tokens == [3, 0][:slots]
    assert info.can_run_decode_cuda_graph == plain.can_run_decode_cuda_graph
    agreed = agreement.take()
    assert agreed is not None and agreed.verdict is LockstepVerdict.ENTER
    assert agreed.outcome.proposals == (mine,)
    expected = [50, 60, 0, 0, 1, 2, 0, 0] if slots == 2 else [50, 60, 1, 2]
    assert expert_health.expert_health_state(state).gathered == (2, expected)
    # The mask we lend upstream for the expanded WORLD is put back.
    assert parallel.tp_group.active_ranks.tolist() == [1] * slots

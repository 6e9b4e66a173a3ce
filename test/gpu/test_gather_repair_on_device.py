"""The DP gather's repair and the no-gather fallback with rows and masks on the device.

On a GPU server upstream's gather runs its all-reduce on device rows and reads one host copy.
``seeing_the_all_reduce`` keeps a device clone of the row this rank sent and runs the
collective through a handle: on a healthy pass that must add no host sync. When Mooncake reports
a failed peer, ``repair_after_failed_gather`` restores this rank's row from that clone into the
host copy and idles the failed and stale rows. The fallback for passes without a gather
(``agree_by_all_reduce``) reduces host tensors only, even with the mask on the device.

One process (world size 1): the peers' rows are written into the tensor before the collective,
as a completed sum would hold them. Mooncake is not on the GPU machine, so its verdict on the
all-reduce (``failed_peers``) is given; the real one is read in
``test/integration/test_failed_gather_repair.py`` (CPU). Each case runs on the CPU too, the
twin CI runs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
import mooncake_gather_workers as W  # noqa: E402
from cuda_syncs import count_syncs  # noqa: E402

from sglang_elastic_ep.controller.launchers.ports import free_port  # noqa: E402
from sglang_elastic_ep.core.agreement import LockstepVerdict, Proposal, StepKind  # noqa: E402
from sglang_elastic_ep.sglang import expert_health, gather_agreement, gather_repair  # noqa: E402

ROWS = 3
OWN, PEER, VICTIM = 0, 1, 2


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[str, Any]]:
    """A one-process WORLD (gloo) and, with a GPU, an NCCL group beside it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    made: dict[str, Any] = {"cpu": dist.group.WORLD}
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
        made["cuda"] = dist.new_group([0], backend="nccl")
    try:
        yield made
    finally:
        dist.destroy_process_group()


def device_case(device: str, request: pytest.FixtureRequest) -> None:
    if device == "cuda":
        request.getfixturevalue("cuda")  # skips, with the reason printed, without a GPU


def sent_rows(device: str) -> torch.Tensor:
    """The pass's rows as the sum leaves them: this rank's, a live peer's, the victim's."""
    return torch.tensor([W.sent_row(r, 1) for r in range(ROWS)], dtype=torch.int64,
                        device=device)


def gather(rows: torch.Tensor, group: Any, seen_through: bool) -> Any:
    """Upstream's collective on ``rows`` (optionally through the plugin's handle) and its one
    host copy."""
    if not seen_through:
        dist.all_reduce(rows, group=group)
        return None, rows.cpu()
    with gather_repair.seeing_the_all_reduce(group) as seen:
        dist.all_reduce(rows, group=group)
    return seen, rows.cpu()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_seeing_the_all_reduce_adds_no_sync_and_changes_no_row(
    device: str, groups: dict[str, Any], request: pytest.FixtureRequest,
) -> None:
    device_case(device, request)
    group = groups[device]
    seen, host = gather(sent_rows(device), group, seen_through=True)
    assert host.tolist() == sent_rows("cpu").tolist()
    assert seen.work is not None and seen.own_index == OWN
    assert seen.own_row.device.type == device
    assert seen.own_row.tolist() == W.sent_row(OWN, 1)
    if device == "cuda":
        plain, _ = count_syncs(lambda: gather(sent_rows(device), group, seen_through=False))
        through, _ = count_syncs(lambda: gather(sent_rows(device), group, seen_through=True))
        print(f"synchronizing CUDA calls in one gather and its host copy: upstream's "
              f"{plain}, through the plugin's handle {through}")
        assert plain >= 1, "the sync detector missed the host copy"
        assert through == plain


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_failed_pass_takes_this_ranks_row_from_the_device_copy(
    device: str, groups: dict[str, Any], request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device_case(device, request)
    group = groups[device]
    seen, host = gather(sent_rows(device), group, seen_through=True)
    host += W.STALE  # what a dead peer's stale receive buffer adds to every row
    info = W.GatherInfo(host, ROWS)
    monkeypatch.setattr(gather_repair, "failed_peers", lambda work: [VICTIM])
    monkeypatch.setattr(dist, "get_backend", lambda g: "mooncake-cpu")
    failed = gather_repair.repair_after_failed_gather(info, seen, group, checked=True)
    assert failed == [VICTIM]
    rows = info.tp0_info_cpu.tolist()
    assert rows[OWN] == W.sent_row(OWN, 1)  # from the device clone, not the stale sum
    assert rows[VICTIM] == W.IDLE
    assert rows[PEER] == W.IDLE  # its check fails on the stale bytes
    assert info.global_num_tokens == [row[0] for row in rows]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_failed_peers_row_is_its_row_of_the_last_healthy_gather(
    device: str, groups: dict[str, Any], request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another survivor may have received the dying peer's row and run a forward on it: its
    last row (it was serving) keeps this rank's decision the same more often than an idle
    one."""
    device_case(device, request)
    group = groups[device]
    monkeypatch.setattr(dist, "get_backend", lambda g: "mooncake-cpu")
    last = gather_repair.LastGatheredRows()
    monkeypatch.setattr(gather_repair, "failed_peers", lambda work: None)  # a healthy pass
    seen, host = gather(sent_rows(device), group, seen_through=True)
    assert gather_repair.repair_after_failed_gather(W.GatherInfo(host, ROWS), seen, group,
                                                    checked=True, last=last) == []
    assert last.rows.tolist() == sent_rows("cpu").tolist()
    monkeypatch.setattr(gather_repair, "failed_peers", lambda work: [VICTIM])
    seen, host = gather(sent_rows(device), group, seen_through=True)
    host += W.STALE
    info = W.GatherInfo(host, ROWS)
    assert gather_repair.repair_after_failed_gather(info, seen, group, checked=True,
                                                    last=last) == [VICTIM]
    rows = info.tp0_info_cpu.tolist()
    assert rows[OWN] == W.sent_row(OWN, 1)
    assert rows[VICTIM] == W.sent_row(VICTIM, 1)  # its last gathered row
    assert rows[PEER] == W.IDLE
    assert info.global_num_tokens == [row[0] for row in rows]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_fallback_without_a_gather_reduces_host_tensors_only(
    device: str, groups: dict[str, Any], request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device_case(device, request)
    proposal = Proposal(rank=0, kind=StepKind.GROW, ready=3, target=3, serving=2)
    monkeypatch.setattr(gather_agreement, "propose", lambda state, runner, batch_idle: proposal)
    monkeypatch.setattr(gather_agreement, "world_host_group", lambda: groups["cpu"])
    monkeypatch.setattr(expert_health, "local_contribution", lambda rank, size: [5, 6])
    taken: list[list[int]] = []
    monkeypatch.setattr(expert_health, "expert_health_state",
                        lambda state: SimpleNamespace(take_gathered=taken.append))
    state = SimpleNamespace(active_ranks=torch.ones(2, dtype=torch.int32, device=device))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        agreed = gather_agreement.agree_by_all_reduce(state, runner=None)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert agreed.verdict is LockstepVerdict.ENTER
    assert taken == [[5, 6]]

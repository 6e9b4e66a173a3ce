"""Torch versions of CPU-engine pieces, checked against straightforward references."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from sglang_elastic_ep_testbed.cpu import sgl_kernel_ops, torchvision_shim
from sglang_elastic_ep_testbed.cpu.collectives import reduce_scatterv


def test_assign_req_to_token_pool_matches_reference() -> None:
    torch.manual_seed(0)
    req_to_token = torch.zeros((5, 16), dtype=torch.int32)
    rows = torch.tensor([3, 0, 4])
    starts = torch.tensor([2, 0, 7])
    ends = torch.tensor([5, 4, 8])
    out_cache_loc = torch.arange(100, 108, dtype=torch.int64)
    expected = req_to_token.clone()
    expected[3, 2:5] = torch.tensor([100, 101, 102])
    expected[0, 0:4] = torch.tensor([103, 104, 105, 106])
    expected[4, 7:8] = torch.tensor([107])
    sgl_kernel_ops.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 16)
    assert torch.equal(req_to_token, expected)


def test_missing_sgl_kernel_op_imports_but_fails_loudly_when_called() -> None:
    module = sgl_kernel_ops._CpuKernelModule("sgl_kernel_test")
    op = module.fused_experts_cpu
    with pytest.raises(NotImplementedError, match="fused_experts_cpu"):
        op(torch.zeros(1))


def test_torchvision_stand_in_imports_and_refuses_use(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {k: v for k, v in sys.modules.items() if k.startswith("torchvision")}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    finder = torchvision_shim._Finder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    from torchvision.transforms.functional import InterpolationMode  # type: ignore

    assert "unavailable" in repr(InterpolationMode.BICUBIC)
    with pytest.raises(ImportError, match="torchvision is not available"):
        InterpolationMode.BICUBIC()
    for name in [k for k in sys.modules if k.startswith("torchvision")]:
        monkeypatch.delitem(sys.modules, name)


class _FakeGroup:
    """Two ranks whose all-reduce sums both inputs (as the real collective would)."""

    def __init__(self, rank: int, inputs: list[torch.Tensor]) -> None:
        self.world_size = 2
        self.rank_in_group = rank
        self._inputs = inputs

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return sum(t.clone() for t in self._inputs)


def test_reduce_scatterv_cpu_fallback_returns_this_ranks_slice() -> None:
    a = torch.arange(10, dtype=torch.float32).reshape(5, 2)
    b = torch.ones(5, 2)
    sizes = [3, 2]
    total = a + b
    for rank, expected in ((0, total[:3]), (1, total[3:])):
        group = _FakeGroup(rank, [a, b])
        got = reduce_scatterv(lambda *args: pytest.fail("CUDA path taken"), group, a, None, sizes)
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="do not cover"):
        reduce_scatterv(lambda *a: None, _FakeGroup(0, [a, b]), a, None, [1, 1])


def test_torch_compat_adds_cpu_empty_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep_testbed.cpu import torch_compat

    if hasattr(torch.cpu, "empty_cache"):
        monkeypatch.delattr(torch.cpu, "empty_cache")
    torch_compat.install()
    assert torch.cpu.empty_cache() is None


def test_shims_are_modules() -> None:
    assert isinstance(sgl_kernel_ops._CpuKernelModule("x"), types.ModuleType)


@pytest.mark.parametrize(("backend", "collective"), [("mooncake-cpu", "all_gather"),
                                                     ("gloo", "upstream")])
def test_the_dp_row_exchange_is_one_all_gather_on_mooncake_groups(
        monkeypatch: pytest.MonkeyPatch, backend: str, collective: str) -> None:
    import sglang.srt.distributed.utils as dist_utils
    import torch.distributed as dist

    from sglang_elastic_ep_testbed.cpu.collectives import exchange_sync_rows

    calls: list[str] = []
    monkeypatch.setattr(dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(dist_utils, "all_gather_single",
                        lambda out, row, group: calls.append("all_gather"))
    rows, row = torch.zeros(6), torch.ones(2)
    exchange_sync_rows(lambda *args: calls.append("upstream"), rows, row, object())
    assert calls == [collective]


@pytest.mark.parametrize(("window", "timeout_ms"), [(None, 30_000), ("10", 30_000),
                                                   ("35", 50_000)])
def test_the_cpu_nixl_buffer_waits_out_the_mooncake_fault_window(
        monkeypatch: pytest.MonkeyPatch, window: str | None, timeout_ms: int) -> None:
    """A survivor that reported a death sends nothing until the window closes: its peers must
    not mask it before then."""
    from sglang_elastic_ep.sglang.args import ENV_FAULT_WINDOW
    from sglang_elastic_ep_testbed.nixl_cpu.transport import default_timeout_ms

    if window is None:
        monkeypatch.delenv(ENV_FAULT_WINDOW, raising=False)
    else:
        monkeypatch.setenv(ENV_FAULT_WINDOW, window)
    assert default_timeout_ms() == timeout_ms

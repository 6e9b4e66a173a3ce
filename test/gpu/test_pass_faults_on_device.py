"""A peer lost during a forward, with the mask on the device as on a GPU server.

``forward_watched`` clones the mask, compares it after the model's forward and copies the flag
to pinned host memory without blocking: on CUDA that must add no synchronizing call, and the
flag must be on the host once the forward's own result copy is (``copy_done``), which is when
``end_requests_of_a_faulted_pass`` reads it. Each case also runs on the CPU, the twin CI runs.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cuda_syncs import count_syncs

from sglang_elastic_ep.sglang import pass_faults


class Req:
    def __init__(self) -> None:
        self.to_finish = None
        self.skip_radix_cache_insert = False

    def finished(self) -> bool:
        return False


@pytest.mark.parametrize("dies", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_flag_reaches_the_host_with_the_forwards_results_and_no_sync(
    device: str, dies: bool, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    if device == "cuda":
        request.getfixturevalue("cuda")  # skips, with the reason printed, without a GPU
    state = SimpleNamespace(active_ranks=torch.ones(4, dtype=torch.int32, device=device))
    monkeypatch.setattr(pass_faults, "elastic_state", lambda: state)
    monkeypatch.setattr(pass_faults, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(pass_faults, "abort_reason", lambda: "503")
    size = 4096 if device == "cuda" else 64
    work = torch.randn(size, size, device=device)
    nixl_mask = torch.zeros(4, dtype=torch.int32, device=device)  # 1 = masked

    def forward(worker: object) -> SimpleNamespace:
        work.matmul(work)  # device work ahead of the mask write, so the copy cannot be early
        state.active_ranks[:4].copy_(1 - nixl_mask[:4])  # upstream's _combine_core, as is
        return SimpleNamespace(copy_done=None)

    def one_pass() -> SimpleNamespace:
        result = pass_faults.forward_watched(forward, object())
        if device == "cuda":  # upstream's copy_to_cpu: an event after the forward's outputs
            result.copy_done = torch.cuda.Event()
            result.copy_done.record()
        return result

    one_pass()  # the first pass allocates the pinned flag (cached for every later one)
    if dies:
        nixl_mask[2] = 1  # NIXL gave up on rank 2 during the next forward
    if device == "cuda":
        syncs, result = count_syncs(one_pass)
        print(f"synchronizing CUDA calls of a watched forward: {syncs}")
        assert syncs == 0
        assert result.elastic_ep_peer_lost.is_pinned()
    else:
        result = one_pass()
    reqs = [Req(), Req()]
    pass_faults.end_requests_of_a_faulted_pass(lambda p, b, r: None, object(),
                                               SimpleNamespace(reqs=reqs), result)
    assert [r.to_finish for r in reqs] == (["503", "503"] if dies else [None, None])
    assert all(r.skip_radix_cache_insert == dies for r in reqs)

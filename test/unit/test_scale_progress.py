"""Where the per-pass lockstep agreement runs (never adding a device sync on GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_elastic_ep.sglang.upstream import lockstep_agreement_on


def test_agreement_only_with_cpu_state_and_room_to_grow() -> None:
    cpu_state = SimpleNamespace(active_ranks=torch.ones(4, dtype=torch.int32))
    grow = SimpleNamespace(max_ep_size=4, tp_size=2)
    full = SimpleNamespace(max_ep_size=2, tp_size=2)
    unset = SimpleNamespace(max_ep_size=None, tp_size=2)
    assert lockstep_agreement_on(cpu_state, grow) is True
    assert lockstep_agreement_on(cpu_state, full) is False
    assert lockstep_agreement_on(cpu_state, unset) is False
    assert lockstep_agreement_on(None, grow) is False
    meta_state = SimpleNamespace(active_ranks=torch.ones(4, device="meta"))  # not host memory
    assert lockstep_agreement_on(meta_state, grow) is False


def test_readiness_skew_holds_back_only_the_named_rank_for_its_passes() -> None:
    from sglang_elastic_ep.sglang.scale_progress import ReadinessSkew

    late = ReadinessSkew("1:3", rank=1)
    assert [late.apply(3) for _ in range(5)] == [0, 0, 0, 3, 3]
    assert late.apply(0) == 0  # nothing to be ready for
    assert [late.apply(4) for _ in range(4)] == [0, 0, 0, 4]  # a new target is late again
    on_time = ReadinessSkew("1:3", rank=0)
    assert on_time.apply(3) == 3
    assert ReadinessSkew(None, rank=1).apply(3) == 3


def test_readiness_skew_reads_the_environment_once_and_lives_on_the_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang_elastic_ep.sglang import scale_progress

    monkeypatch.setattr(scale_progress.dist, "get_rank", lambda: 1)
    monkeypatch.setenv(scale_progress.ENV_TEST_SKEW, "1:2")
    runner = SimpleNamespace()
    skew = scale_progress.readiness_skew(runner)
    assert skew.passes == 2
    monkeypatch.delenv(scale_progress.ENV_TEST_SKEW)  # later passes never read it again
    assert scale_progress.readiness_skew(runner) is skew
    assert scale_progress.readiness_skew(SimpleNamespace()).passes == 0  # another process

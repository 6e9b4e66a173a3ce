"""Where the per-pass lockstep agreement runs (never adding a device sync on GPUs)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sglang_elastic_ep.sglang.scale_progress import _lockstep_agreement_on


def test_agreement_only_with_cpu_state_and_room_to_grow() -> None:
    cpu_state = SimpleNamespace(active_ranks=torch.ones(4, dtype=torch.int32))
    grow = SimpleNamespace(max_ep_size=4, tp_size=2)
    full = SimpleNamespace(max_ep_size=2, tp_size=2)
    unset = SimpleNamespace(max_ep_size=None, tp_size=2)
    assert _lockstep_agreement_on(cpu_state, grow) is True
    assert _lockstep_agreement_on(cpu_state, full) is False
    assert _lockstep_agreement_on(cpu_state, unset) is False
    assert _lockstep_agreement_on(None, grow) is False
    meta_state = SimpleNamespace(active_ranks=torch.ones(4, device="meta"))  # not host memory
    assert _lockstep_agreement_on(meta_state, grow) is False


def test_readiness_skew_holds_back_only_the_named_rank_for_its_passes() -> None:
    from sglang_elastic_ep.sglang.scale_progress import ReadinessSkew

    late = ReadinessSkew("1:3", rank=1)
    assert [late.apply(3) for _ in range(5)] == [0, 0, 0, 3, 3]
    assert late.apply(0) == 0  # nothing to be ready for
    assert [late.apply(4) for _ in range(4)] == [0, 0, 0, 4]  # a new target is late again
    on_time = ReadinessSkew("1:3", rank=0)
    assert on_time.apply(3) == 3
    assert ReadinessSkew(None, rank=1).apply(3) == 3

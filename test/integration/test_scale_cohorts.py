"""A scale-down forgets the freed slots' scale cohorts (upstream never deletes one)."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch.distributed as dist  # noqa: E402

from sglang_elastic_ep_testbed.cluster.procs import free_port  # noqa: E402


def test_forgetting_deletes_only_the_freed_slots_cohorts(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    import sglang.srt.distributed.utils as dist_utils
    from sglang.srt.elastic_ep import elastic_ep

    from sglang_elastic_ep.sglang.tail_release import forget_cohorts

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    monkeypatch.setattr(dist_utils, "get_global_tcp_store", lambda: store)
    monkeypatch.setattr(elastic_ep, "get_global_tcp_store", lambda: store)
    for offset, target in ((2, 3), (3, 4)):
        store.set(f"{elastic_ep._SCALE_COHORT_KEY_PREFIX}/{offset}",
                  f'{{"target_ep_size": {target}, "cuda_graph_enabled": false, '
                  '"attn_tp_size": 1, "attn_cp_size": 1}')
    assert elastic_ep.get_scale_cohort(2).target_ep_size == 3

    forget_cohorts(range(3, 4))  # 4 -> 3: only slot 3's cohort goes
    assert elastic_ep.get_scale_cohort(3) is None
    assert elastic_ep.get_scale_cohort(2).target_ep_size == 3
    forget_cohorts(range(2, 4))  # 3 -> 2; slot 3 is already gone, which is fine
    assert elastic_ep.get_scale_cohort(2) is None

"""Only rank 0's scheduler reports shard liveness; the others still hand over scale results."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sglang_elastic_ep.sglang import shard_liveness


def scheduler_of(rank: int, pending: object = None, attn_dp: bool = True) -> Any:
    sent: list[object] = []
    runner = SimpleNamespace(_elastic_global_rank=lambda: rank,
                             _pending_elastic_scale_update=pending)
    return SimpleNamespace(
        attn_dp_enabled=attn_dp, tp_worker=SimpleNamespace(model_runner=runner),
        ipc_channels=SimpleNamespace(send_to_tokenizer=SimpleNamespace(send_output=sent.append)),
        sent=sent)


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_liveness, "elastic_ep_enabled", lambda: True)
    monkeypatch.setattr(shard_liveness, "elastic_state",
                        lambda: SimpleNamespace(active_ranks_cpu=[1, 0, 1]))


def test_rank_0_reports_as_upstream(elastic: None) -> None:
    calls: list[Any] = []
    scheduler = scheduler_of(0)
    shard_liveness.report_from_rank_zero_only(calls.append, scheduler)
    assert calls == [scheduler]


def test_another_rank_sends_no_liveness_but_its_pending_scale_result(elastic: None) -> None:
    calls: list[Any] = []
    scheduler = scheduler_of(2, pending="scale-update")
    shard_liveness.report_from_rank_zero_only(calls.append, scheduler)
    assert calls == []  # upstream's report (its liveness view) is not sent
    assert scheduler.sent == ["scale-update"]
    assert scheduler.tp_worker.model_runner._pending_elastic_scale_update is None
    shard_liveness.report_from_rank_zero_only(calls.append, scheduler)
    assert scheduler.sent == ["scale-update"]  # handed over once


def test_without_elastic_ep_or_dp_attention_upstream_runs_on_every_rank(
        monkeypatch: pytest.MonkeyPatch, elastic: None) -> None:
    calls: list[Any] = []
    shard_liveness.report_from_rank_zero_only(calls.append, scheduler_of(2, attn_dp=False))
    monkeypatch.setattr(shard_liveness, "elastic_ep_enabled", lambda: False)
    shard_liveness.report_from_rank_zero_only(calls.append, scheduler_of(2))
    assert len(calls) == 2

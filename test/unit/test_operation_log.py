"""The operation id on this plugin's scheduler log lines, while that operation is pending."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.sglang import operation_log
from sglang_elastic_ep.sglang.operation_log import (
    end_when_settled,
    get_logger,
    note_scale_request,
)


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    current = SimpleNamespace(pending_ep_size=None, scale_phase="idle")
    monkeypatch.setattr(operation_log, "elastic_state", lambda: current)
    return current


def logged(caplog: pytest.LogCaptureFixture, text: str) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eep.test"):
        get_logger("eep.test").info("%s", text)
    (record,) = caplog.records
    return record.getMessage()


def test_lines_carry_the_operation_id_while_it_is_pending(
    state: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    assert logged(caplog, "before") == "before"
    note_scale_request(state, SimpleNamespace(rid="ctl-1-grow-to-3", new_ep_size=3))
    state.pending_ep_size, state.scale_phase = 3, "waiting_for_cohort"
    end_when_settled(state)  # still pending: kept
    assert logged(caplog, "joiner ready") == "[op ctl-1-grow-to-3] joiner ready"
    state.pending_ep_size, state.scale_phase = None, "serving_expanded"
    assert logged(caplog, "committed") == "[op ctl-1-grow-to-3] committed"  # the commit pass
    end_when_settled(state)  # the next pass finds nothing pending
    assert logged(caplog, "rank 1 failed") == "rank 1 failed"


def test_a_drain_keeps_the_tag_until_it_commits(
    state: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    note_scale_request(state, SimpleNamespace(rid="op-down", new_ep_size=2))
    state.pending_ep_size, state.scale_phase = None, "draining"
    end_when_settled(state)
    assert logged(caplog, "drained") == "[op op-down] drained"


def test_a_request_without_an_id_tags_nothing(
    state: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    note_scale_request(state, SimpleNamespace(rid=None, new_ep_size=3))
    state.pending_ep_size = 3
    assert logged(caplog, "line") == "line"


def test_no_elastic_state_no_tag(monkeypatch: pytest.MonkeyPatch,
                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(operation_log, "elastic_state", lambda: None)
    assert logged(caplog, "line") == "line"

"""The operation id on the schedulers' log lines, so one operation can be followed across
processes (``grep <operation id>`` over every log of the deployment).

The HTTP process sends the operation id as the scale request's ``rid``; each scheduler keeps it
on its membership state while that operation is pending, and this plugin's loggers prefix
their lines with it. The tag is dropped on the first pass that finds no scale pending, so a
later, unrelated line (a rank failing on an idle cluster) never carries a finished operation's
id.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from sglang_elastic_ep.core.phases import Phase
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_state

_TAG_ATTR = "_sglang_eep_operation_tag"


@dataclass
class OperationTag:
    """The operation this scheduler works on, if any."""

    operation_id: str | None = None


def operation_tag(state: Any) -> OperationTag:
    return attached_state(state, _TAG_ATTR, OperationTag)


def request_operation_id(recv_req: Any) -> str | None:
    """The operation id a scale request carries (the HTTP process sends it as ``rid``)."""
    rid = getattr(recv_req, "rid", None)
    return rid if isinstance(rid, str) and rid else None


def note_scale_request(state: Any, recv_req: Any) -> None:
    """A scale request reached this scheduler: tag what follows with its operation id."""
    rid = request_operation_id(recv_req)
    if rid is not None:
        operation_tag(state).operation_id = rid


def end_when_settled(state: Any) -> None:
    """Once per pass: drop the tag when no scale is pending any more."""
    tag = getattr(state, _TAG_ATTR, None)
    if tag is None or tag.operation_id is None:
        return
    if state.pending_ep_size is None and state.scale_phase != Phase.DRAINING.value:
        tag.operation_id = None


def current_operation_id() -> str | None:
    try:
        state = elastic_state()
    except ImportError:  # no SGLang in this process (the CLI, unit tests of the core)
        return None
    tag = getattr(state, _TAG_ATTR, None) if state is not None else None
    return tag.operation_id if tag is not None else None


class OperationLogger(logging.LoggerAdapter):
    """A module logger whose lines name the operation in progress: ``[op <id>] ...``."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        operation_id = current_operation_id()
        return (f"[op {operation_id}] {msg}" if operation_id else msg), kwargs


def get_logger(name: str) -> OperationLogger:
    return OperationLogger(logging.getLogger(name), {})

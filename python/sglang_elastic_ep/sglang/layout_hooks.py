"""What follows an expert layout installed in place (``ExpertLocationMetadata.update``)."""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep.sglang.eplb_log import layout_log
from sglang_elastic_ep.sglang.expert_dispatch import refresh_replica_tables
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled, elastic_state


def layout_installed(result: Any, metadata: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ExpertLocationMetadata.update``: a layout was installed in place. The dispatch
    repair's replica tables follow it, and the install is counted."""
    if not elastic_ep_enabled():
        return None
    refresh_replica_tables(metadata)
    state = elastic_state()
    if state is not None:
        layout_log(state).updates += 1
    return None

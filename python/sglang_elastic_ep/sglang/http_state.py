"""What the elastic EP adapter keeps in the HTTP server process, and where it is found.

One ``HttpAdapterState`` per process, built by ``server_mount.mount_on_server`` and kept on
SGLang's tokenizer manager: every tokenizer-side hook receives that manager, so each finds the
state there. No state on the manager means elastic EP is off (or the server is not up yet), and
the hooks pass through.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from sglang_elastic_ep.api.control_plane import InProcessControlPlane
from sglang_elastic_ep.core.routing import LiveShardRouter

_STATE_ATTR = "_elastic_ep_http_state"


@dataclass
class HttpAdapterState:
    """The control plane, the tokenizer's shard router, and the shard liveness last acted on."""

    plane: InProcessControlPlane | None = None  # set once built (the engine needs the state)
    router: LiveShardRouter = field(default_factory=LiveShardRouter)
    # the shard liveness last acted on, with the effective size it was read against
    last_status: tuple[tuple[bool, ...], int] | None = None

    def control_plane(self) -> InProcessControlPlane:
        if self.plane is None:
            raise RuntimeError("the elastic EP control plane is not built yet")
        return self.plane


def adapter_state(tokenizer_manager: Any) -> HttpAdapterState | None:
    """The state mounted on ``tokenizer_manager``; None unless elastic EP is on and mounted."""
    return getattr(tokenizer_manager, _STATE_ATTR, None)


def attach_adapter_state(tokenizer_manager: Any, state: HttpAdapterState) -> None:
    setattr(tokenizer_manager, _STATE_ATTR, state)


def control_plane() -> InProcessControlPlane | None:
    """The process's control plane (None unless elastic EP is on and the server started)."""
    # Only a process that started SGLang's HTTP server can have one; importing the server
    # module just to look would load all of SGLang.
    http_server = sys.modules.get("sglang.srt.entrypoints.http_server")
    global_state = http_server.get_global_state() if http_server is not None else None
    if global_state is None:
        return None
    state = adapter_state(global_state.tokenizer_manager)
    return None if state is None else state.plane

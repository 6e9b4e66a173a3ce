"""The CPU EP buffer as a CPU-engine scheduler uses it.

A membership change connects the new ranks at the commit barrier, both sides at once
(``connect_ranks``). A serving rank can wait there for seconds while a joiner finishes its own
steps, and no Mooncake collective runs on it meanwhile; yet its Mooncake worker spins a core
all that time, on two cores shared with the joiner it waits for (docs/cpu-testbed.md, "Three
ranks on two cores"). This buffer keeps the process's spinning native threads parked through
that wait, as the idle sleeper does through an idle pass (``cpu/idle.py``;
``SGLANG_EEP_PARK_SPINNERS_IN_CONNECT=0`` turns it off). A joiner parks its own worker in its
handshake too: its scheduler searched for it at start-up, before the admission. A process whose
spinners were not found parks nothing.

The handshake also gives up on a peer once Mooncake's WORLD counts it out: a joiner that hung
after it acknowledged its admission and published its handshake key stays alive to NIXL, and
the serving ranks would wait the whole connect timeout for it and then fail.
"""

from __future__ import annotations

from typing import Any

from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled
from sglang_elastic_ep.sglang.world_view import world_members_alive
from sglang_elastic_ep_testbed.cpu.idle import (
    park_spinners_in_connect_enabled,
    process_thread_parker,
)
from sglang_elastic_ep_testbed.nixl_cpu.buffer import Buffer


class SchedulerBuffer(Buffer):
    """``Buffer`` whose connect handshake keeps this process's spinning threads parked and
    asks Mooncake's WORLD whether the peers it awaits are still members."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if elastic_ep_enabled():  # WORLD is Mooncake's then
            self.peers_alive = world_members_alive
        if park_spinners_in_connect_enabled():
            self.handshake_wait_parker = process_thread_parker()

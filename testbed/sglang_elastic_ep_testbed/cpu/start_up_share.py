"""A starting server gets a larger share of the CPU until its schedulers serve.

Each server of the CPU cluster runs in a session of its own, and Linux's scheduler autogroups
give every session the same share of the CPU (docs/cpu-testbed.md, "One session for every
server of a cluster"). A joiner starting beside three serving ranks on two cores then gets a
small share for its start-up, almost all of it Python importing SGLang in each of its processes
(docs/cpu-testbed.md, "Three ranks on two cores"). On a GPU host a joiner starts on a machine of
its own.

So the launcher gives a new server's session a heavier weight (``START_UP_NICE``, Linux's
autogroup nice), and each of its schedulers sets it back to 0 once its start-up work is done:
as it enters its event loop, or before, as it starts waiting for the serving ranks (a scale
joiner for its admission, a replacement for the survivors to take it back). A serving rank
must not outweigh its peers: they would wait for it in every DP gather with their Mooncake
workers spinning (docs/cpu-testbed.md). Nor may a waiting one: a survivor missed its Mooncake
heartbeat while two replacements waited at the heavier weight (docs/cpu-testbed.md, "Seen
once: a survivor starved by two waiting replacements"). ``SGLANG_EEP_START_UP_NICE=0`` turns
it off.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sglang_elastic_ep_testbed.cpu.settings import env_number

logger = logging.getLogger(__name__)

ENV_START_UP_NICE = "SGLANG_EEP_START_UP_NICE"
# An autogroup's weight follows the nice table: -10 is about 9x a normal session's. A starting
# server is mostly one importing process, so it can take at most one core of the two.
DEFAULT_START_UP_NICE = -10
NORMAL_NICE = 0


def start_up_nice() -> int:
    value = env_number(ENV_START_UP_NICE, DEFAULT_START_UP_NICE, low=-20, high=19)
    if value != int(value):
        raise ValueError(f"{ENV_START_UP_NICE} must be a whole nice value, got {value:g}")
    return int(value)


def autogroup_path(pid: int | str) -> Path:
    return Path(f"/proc/{pid}/autogroup")


def set_session_nice(pid: int | str, nice: int) -> bool:
    """Set the autogroup nice of the session ``pid`` belongs to; False where the kernel has no
    autogroups or refuses (a negative nice needs CAP_SYS_NICE)."""
    try:
        autogroup_path(pid).write_text(f"{nice}\n")
    except OSError as exc:
        logger.debug("autogroup nice %d for pid %s not set: %s", nice, pid, exc)
        return False
    return True


def session_nice(pid: int | str) -> int | None:
    """The autogroup nice of ``pid``'s session (``/autogroup-N nice K``), None without one."""
    try:
        return int(autogroup_path(pid).read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def favour_start_up(pid: int) -> bool:
    """Called by the launcher for a server it just started in a new session."""
    nice = start_up_nice()
    return nice != NORMAL_NICE and set_session_nice(pid, nice)


def serve_at_normal_share(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler.run_event_loop``: start-up is over, this session shares the CPU
    equally again."""
    _back_to_normal_share("it serves")


def wait_at_normal_share(*args: Any, **kwargs: Any) -> None:
    """BEFORE a joiner's or a replacement's wait for the serving ranks: its start-up work is
    done, and what it does while it waits must not outweigh them."""
    _back_to_normal_share("it waits for the serving ranks")


def _back_to_normal_share(why: str) -> None:
    nice = session_nice("self")
    if nice is not None and nice != NORMAL_NICE and set_session_nice("self", NORMAL_NICE):
        logger.info("start-up share: this server's session back from nice %d to %d (%s)",
                    nice, NORMAL_NICE, why)

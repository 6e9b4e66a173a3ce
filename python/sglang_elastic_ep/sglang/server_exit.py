"""A server above node 0 exits non-zero when one of its ranks crashed, so its orchestrator
relaunches it.

Upstream's ``launch_server`` on a node above 0 (every follower node, every joiner) blocks until
its DP controller exits and then returns, whatever ended the ranks: a scheduler killed by the
OOM killer or evicted by Mooncake left a server that exited 0, and an orchestrator that restarts
on failure (Kubernetes ``restartPolicy: OnFailure``) would not relaunch it. A released rank's
scheduler exits 0 (``tail_release.leave``); so does every scheduler an orderly shutdown stops.
Any other end is a crash (an end by SIGTERM or SIGINT is a stop), and it now shows at both
levels of the server:

- the DP controller watches its schedulers and exits 1 as soon as one crashes (the others
  are killed with it: SGLang's schedulers die with their parent), where upstream went on joining
  the others and then exited 0;
- the main process exits 1 when the DP controller crashed (or exited 1), where upstream
  returned.

Node 0's server hosts the HTTP server and serves on with a rank inside it failed, as upstream
does; nothing changes there.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import elastic_ep_enabled

logger = get_logger(__name__)

CRASH_EXIT_CODE = 1
# Not a crash: exit 0 (released, or an orderly shutdown), ``None`` (still running), and an end
# by SIGTERM or SIGINT, which a supervisor sends to every process of a server it stops
# (systemd's default), so that a stopped server does not read as a crashed one.
NOT_A_CRASH = frozenset({0, None, -signal.SIGTERM, -signal.SIGINT})


def crashed(exit_codes: Sequence[int | None]) -> list[int]:
    """The exit codes in ``exit_codes`` that mean a crash: any other non-zero code (SIGKILL
    from the OOM killer, SIGQUIT after an exception, SIGSEGV, an exit 1)."""
    return [code for code in exit_codes if code not in NOT_A_CRASH]


def _watched_server() -> bool:
    """A server above node 0 (a follower node or a joiner) of an elastic deployment."""
    from sglang.srt.runtime_context import get_parallel

    return elastic_ep_enabled() and int(get_parallel().node_rank or 0) >= 1


def watch_schedulers(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    """After ``DataParallelController.__init__``: on a server above node 0, end this controller
    with exit 1 once any of its schedulers crashes. Two watchers, one decision: a thread
    sees a crash while the controller's own thread still joins another scheduler, and each
    scheduler's ``join`` checks the code when the controller's thread reaped it first (it
    would otherwise return and exit 0 before the thread could read the code)."""
    if _watched_server():
        procs = [proc for proc in controller.scheduler_procs if proc is not None]
        for proc in procs:
            proc.join = functools.partial(_join_then_exit_on_crash, proc, proc.join, os._exit)
        threading.Thread(target=_exit_on_first_crash, args=(procs, os._exit), daemon=True,
                         name="elastic-ep-scheduler-exits").start()
    return result


def _join_then_exit_on_crash(proc: Any, join: Callable[..., None],
                             exit_process: Callable[[int], None], *args: Any,
                             **kwargs: Any) -> None:
    join(*args, **kwargs)
    _exit_if_crashed(proc, _exit_code(proc), exit_process)


def _exit_if_crashed(proc: Any, code: int | None, exit_process: Callable[[int], None]) -> bool:
    if not crashed([code]):
        return False
    logger.error("[elastic-ep] scheduler pid %d ended with exit code %s: this server exits %d "
                 "so that it is relaunched with --ep-join-mode recover",
                 proc.pid, code, CRASH_EXIT_CODE)
    exit_process(CRASH_EXIT_CODE)
    return True


def _exit_on_first_crash(procs: Sequence[Any], exit_process: Callable[[int], None]) -> None:
    """Wait on the processes' sentinels (no polling); a crash ends this process at once, any
    other end (a released rank's exit 0) is let go."""
    running = list(procs)
    while running:
        for sentinel in wait([proc.sentinel for proc in running]):
            proc = next(p for p in running if p.sentinel == sentinel)
            running.remove(proc)
            if _exit_if_crashed(proc, _exit_code(proc), exit_process):
                return


def _exit_code(proc: Any, tries: int = 100) -> int | None:
    """The exit code of ``proc``; None while it runs. The controller's thread and the watcher
    both reap it: the one that loses sees no code until the other has stored it, a moment
    later."""
    if not wait([proc.sentinel], timeout=0):
        return None
    for _ in range(tries):
        code = proc.exitcode
        if code is not None:
            return code
        time.sleep(0.05)
    return None


def exit_non_zero_after_a_crash(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Around ``Engine._launch_scheduler_processes``: on a server above node 0, the returned
    ``block_until_scheduler_exits`` raises ``SystemExit(1)`` when a child crashed."""
    result, procs = original(*args, **kwargs)
    if procs and _watched_server():
        block = result.block_until_scheduler_exits

        def block_then_exit_on_crash() -> None:
            block()
            codes = crashed([proc.exitcode for proc in procs])
            if codes:
                logger.error("[elastic-ep] this server's DP controller or scheduler ended with "
                             "exit code(s) %s: exiting %d so that it is relaunched with "
                             "--ep-join-mode recover", codes, CRASH_EXIT_CODE)
                raise SystemExit(CRASH_EXIT_CODE)

        result.block_until_scheduler_exits = block_then_exit_on_crash
    return result, procs

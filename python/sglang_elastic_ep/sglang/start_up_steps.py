"""Running the blocking start-up steps of a joiner or a replacement under its machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sglang_elastic_ep.core.phases import StartUpMachine
from sglang_elastic_ep.sglang.operation_log import get_logger

logger = get_logger(__name__)


def run_step(machine: StartUpMachine, who: str, step: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
    """``step(*args, **kwargs)``; one that raises ends ``machine`` in FAILED with the error,
    logged as ``who``'s, and the exception goes on."""
    try:
        return step(*args, **kwargs)
    except BaseException as exc:
        machine.fail(f"{type(exc).__name__}: {exc}", time.monotonic())
        logger.error("[elastic-ep] %s failed in its start-up (phase %s): %s", who,
                     machine.phase.value, machine.error)
        raise


def breakdown(machine: StartUpMachine) -> str:
    """How long each phase took, for the log line that says it serves."""
    return ", ".join(f"{phase.value} {seconds:.1f} s"
                     for phase, seconds in machine.seconds_in_phases().items())

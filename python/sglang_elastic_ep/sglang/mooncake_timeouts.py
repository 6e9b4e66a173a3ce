"""Mooncake's collective timeout and fault window from our flags, on any device.

``args.from_cli_args`` puts ``--elastic-ep-collective-timeout`` and ``--elastic-ep-fault-window``
into the environment, which the scheduler processes inherit; each process hands them to
Mooncake before its WORLD registers, since Mooncake reads them when it builds its groups and
(on rank 0) its coordinator. Unset flags leave Mooncake's defaults.
"""

from __future__ import annotations

import os
from typing import Protocol

from sglang_elastic_ep.sglang.args import ENV_COLLECTIVE_TIMEOUT, ENV_FAULT_WINDOW


class MooncakeProcessSettings(Protocol):
    """The process-wide setters of ``mooncake.pg`` used here."""

    def set_collective_timeout_us(self, us: int) -> None: ...

    def set_fault_reconciliation_window_us(self, us: int) -> None: ...


def timeouts_from_environment() -> tuple[float | None, float | None]:
    """(collective timeout, fault window) in seconds, each None when its flag was not given."""
    timeout = os.environ.get(ENV_COLLECTIVE_TIMEOUT)
    window = os.environ.get(ENV_FAULT_WINDOW)
    return (float(timeout) if timeout else None, float(window) if window else None)


def apply_timeouts(pg: MooncakeProcessSettings | None = None) -> None:
    """Give Mooncake the timeouts our flags set (``pg``: ``mooncake.pg`` unless given)."""
    timeout, window = timeouts_from_environment()
    if timeout is None and window is None:
        return
    if pg is None:
        from mooncake import pg as mooncake_pg

        pg = mooncake_pg
    if timeout is not None:
        pg.set_collective_timeout_us(int(timeout * 1e6))
    if window is not None:
        pg.set_fault_reconciliation_window_us(int(window * 1e6))

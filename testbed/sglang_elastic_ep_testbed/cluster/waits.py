"""One way to wait for a condition: poll until it holds or a timeout passes (tenacity)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None],
    timeout_s: float,
    what: str,
    poll_s: float = 0.5,
    describe: Callable[[], object] | None = None,
) -> T:
    """Call ``probe`` every ``poll_s`` until it returns something truthy; return that.

    Raises ``TimeoutError`` naming ``what`` (and ``describe()``, the state to show, if given)
    when ``timeout_s`` passes first. Exceptions from ``probe`` propagate at once.
    """
    try:
        for attempt in Retrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_fixed(poll_s),
            retry=retry_if_result(lambda value: not value),
        ):
            with attempt:
                value = probe()
            if not attempt.retry_state.outcome.failed and value:  # type: ignore[union-attr]
                return value
    except RetryError:
        pass
    state = f": {describe()}" if describe is not None else ""
    raise TimeoutError(f"{what} not within {timeout_s:g} s{state}")

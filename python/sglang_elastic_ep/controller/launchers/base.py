"""The one interface every launcher implements."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from sglang_elastic_ep.core.controller import JoinerSpec, Launch


class LauncherError(RuntimeError):
    """A launch or a termination could not be done (the controller logs it and goes on)."""


class LauncherUnavailable(LauncherError):
    """The launcher cannot work here at all (a missing package, a bad template)."""


@runtime_checkable
class Launcher(Protocol):
    name: str

    def launch_joiner(self, spec: JoinerSpec) -> Launch:
        """Start a joiner for ``spec.ranks`` (``spec.mode`` is ``scale``)."""
        ...

    def launch_replacement(self, spec: JoinerSpec, *, stuck: bool = False) -> Launch:
        """Stop what this launcher still runs for exactly ``spec.ranks`` (the server reports
        them failed, or they are stuck), then start a joiner in recover mode for them.
        ``stuck``: kill the old process at once, without the graceful stop's grace."""
        ...

    def terminate(self, ranks: Collection[int]) -> list[Launch]:
        """Stop every joiner whose ranks are all in ``ranks``, and nothing else."""
        ...

    def list(self) -> list[Launch]:
        """What this launcher runs, and recently ran, for this deployment."""
        ...


def within(launch: Launch, ranks: Collection[int]) -> bool:
    """All of ``launch``'s ranks are in ``ranks`` (a joiner is stopped whole or not at all)."""
    allowed = set(ranks)
    return bool(allowed) and set(launch.ranks) <= allowed

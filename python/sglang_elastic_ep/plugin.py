"""Entry point of the SGLang general plugin (group ``sglang.srt.plugins``).

SGLang calls :func:`load` early in every process (server, schedulers, DP controller,
detokenizer). It checks the SGLang version, then registers the hooks listed in
:mod:`sglang_elastic_ep.hooks` with SGLang's own ``HookRegistry``.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger("sglang_elastic_ep")

SUPPORTED_SGLANG_VERSION = "0.5.23"


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def supported_sglang_installed() -> bool:
    """Whether the installed SGLang is the one release these hooks were written against; logs
    one error line when it is not."""
    found = installed_sglang_version()
    if found != SUPPORTED_SGLANG_VERSION:
        logger.error(
            "sglang-elastic-ep supports sglang==%s only, found %s: plugin not installed, "
            "SGLang runs without elastic EP extensions",
            SUPPORTED_SGLANG_VERSION,
            found,
        )
        return False
    return True


class _Registration:
    """Hooks are registered once per process, however often SGLang calls the entry point."""

    done = False


def load() -> bool:
    """Register every hook of this plugin; returns whether hooks were installed."""
    if not supported_sglang_installed():
        return False
    if _Registration.done:
        return True
    from sglang_elastic_ep import hooks

    hooks.register(hooks.HOOKS)
    _Registration.done = True
    return True

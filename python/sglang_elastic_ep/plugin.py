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

_loaded = False


def installed_sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def load() -> bool:
    """Register every hook of this plugin; returns whether hooks were installed."""
    global _loaded
    found = installed_sglang_version()
    if found != SUPPORTED_SGLANG_VERSION:
        logger.error(
            "sglang-elastic-ep supports sglang==%s only, found %s: plugin not installed, "
            "SGLang runs without elastic EP extensions",
            SUPPORTED_SGLANG_VERSION,
            found,
        )
        return False
    if _loaded:
        return True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_elastic_ep import hooks

    for hook in hooks.active_hooks():
        HookRegistry.register(hook.target, hook.resolve(), HookType[hook.kind])
    for shim in hooks.active_import_shims():
        shim.install()
    _loaded = True
    return True

"""Entry point of the CPU testbed's SGLang plugin (group ``sglang.srt.plugins``, name
``elastic_ep_testbed``).

With ``SGLANG_USE_CPU_ENGINE=1`` it registers the CPU-engine hooks of
:mod:`sglang_elastic_ep_testbed.hooks`; otherwise it does nothing, so installing the testbed on
a GPU machine changes nothing.
"""

from __future__ import annotations

import os

from sglang_elastic_ep.plugin import supported_sglang_installed


def cpu_engine() -> bool:
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"


class _Registration:
    done = False


def load() -> bool:
    """Register the CPU hooks and import shims; returns whether they were installed."""
    if not cpu_engine() or not supported_sglang_installed():
        return False
    if _Registration.done:
        return True
    from sglang_elastic_ep.hooks import register
    from sglang_elastic_ep_testbed import hooks

    register(hooks.HOOKS)
    for shim in hooks.IMPORT_SHIMS:
        shim.install()
    _Registration.done = True
    return True

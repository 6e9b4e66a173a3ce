"""UCX settings that NIXL needs on a CPU-only machine, applied before any agent exists."""

from __future__ import annotations

import os

# UCX reads these when an agent's UCX context is created, so setting them before the first
# nixl_agent is enough; values the user already set are kept.
UCX_DEFAULTS: dict[str, str] = {
    # The InfiniBand transport modules segfault at process exit on machines without an HCA.
    "UCX_MODULES": "^ib",
    # Loopback only: every rank of the CPU testbed lives on this host.
    "UCX_NET_DEVICES": "lo",
    # TCP moves the bytes (shared memory alone does not work for NIXL's DRAM writes here).
    "UCX_TLS": "tcp",
}


def configure_ucx_env() -> dict[str, str]:
    """Set the UCX defaults that are not set yet; returns the values now in effect."""
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in UCX_DEFAULTS}

"""Several SGLang "nodes" on one host (the CPU cluster's multi-node primary).

Node ranks above 0 check that the node-0 ports derived from ``--dist-init-addr`` (port base,
detokenizer, NCCL) and their schedulers' input ports are free before starting, although with DP
attention they bind none of them (node 0's DP controller binds every scheduler input port and
the schedulers connect).
On separate machines the check passes; on one host it passes only by racing node 0, and a node
relaunched in recover mode always fails it (``port_base ... is used by a process already``).
The cluster launcher marks such nodes with ``SGLANG_EEP_SHARED_HOST_NODE=1``; for them the
check of those node-0 ports is skipped. Nothing changes for any other process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENV_SHARED_HOST_NODE = "SGLANG_EEP_SHARED_HOST_NODE"
NODE0_PORTS = frozenset({"port_base", "detokenizer_port", "nccl_port", "rpc_port",
                         "metrics_port", "load_collector_port", "scheduler_input_port"})


def wait_port_available(
    original: Callable[..., bool], port: int, port_name: str, *args: Any, **kwargs: Any
) -> bool:
    """AROUND ``server_args.wait_port_available``."""
    if os.environ.get(ENV_SHARED_HOST_NODE) == "1" and port_name in NODE0_PORTS:
        return True
    return original(port, port_name, *args, **kwargs)

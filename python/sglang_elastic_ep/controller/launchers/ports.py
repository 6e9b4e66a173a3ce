"""Free ports for servers started on this machine, picked below the kernel's ephemeral range.

Inside that range a port is free only for now: any outgoing connection (an HTTP client, a
store client) may take it as its local port. A joiner's port is picked when it is launched,
and the ports SGLang derives from it (its ``--port`` + 233..238) are bound later, by its
scheduler; a replacement is relaunched on the same ports as the rank it replaces. Taken in the
meantime, they fail its start-up with "scheduler_input_port ... is used by a process already".
Mooncake's transfer engine binds its RPC and TCP transport listeners on random ports of
15000..17000 (``findAvailableTcpPort``) in every rank: a port picked there may be taken before
the server binds it, so those are left out too.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection, Sequence
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 10000
# SGLang derives ports up to +238 from a joiner's --port: the whole run stays below the range.
DERIVED_HEADROOM = 300
# Where Mooncake's transfer engine listens (its RPC and TCP transport ports, per rank).
MOONCAKE_PORTS = range(15000, 17001)
# A joiner's port_base is its --port + ZMQ_TCP_PORT_DELTA (SGLang's server_args.py), with six
# ports from there (detokenizer, rpc, metrics, scheduler input, ...).
JOINER_PORT_DELTA = 233
DERIVED_PORTS = 6


def listen_ports() -> Sequence[int]:
    """Below the kernel's ephemeral range and outside Mooncake's ports, with room for derived
    ports; empty when that range starts too low to leave room below it (then any free port is
    taken)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    high = low - DERIVED_HEADROOM
    if high - LOWEST_PORT < 1000:
        return range(0)
    below = range(LOWEST_PORT, min(high, MOONCAKE_PORTS.start - DERIVED_HEADROOM))
    above = range(MOONCAKE_PORTS.stop, high)
    return [*below, *above]


def bind_free(sock: socket.socket, ports: Sequence[int], attempts: int = 200) -> int:
    """Bind ``sock`` to 127.0.0.1 on a free port of ``ports`` (any free port if it is empty)."""
    if not ports:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
    for _ in range(attempts):
        try:
            sock.bind(("127.0.0.1", random.choice(ports)))
        except OSError:
            continue
        return int(sock.getsockname()[1])
    raise RuntimeError(f"no free port in {min(ports)}..{max(ports)} in {attempts} tries")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return bind_free(sock, listen_ports())


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port_run(length: int, *, offset: int = 0, avoid: Collection[int] = frozenset(),
                  attempts: int = 200) -> int:
    """A free port ``p`` whose run ``p + offset .. p + offset + length - 1`` is free too, with
    neither ``p`` nor the run in ``avoid``.

    SGLang derives further ports from the ones it is given (``--dist-init-addr`` port + 1..6;
    a joiner's ``--port`` + 233..238), and two free ports asked for one after the other may
    be adjacent: a server's HTTP port must not be its own dist-init port + 1."""
    for _ in range(attempts):
        port = free_port()
        run = range(port + offset, port + offset + length)
        if run.stop > 65536 or port in avoid or any(q in avoid for q in run):
            continue
        if all(q == port or port_is_free(q) for q in run):
            return port
    raise RuntimeError(f"no free port with {length} free ports at +{offset} in {attempts} tries")


def free_joiner_port() -> int:
    """A joiner's ``--port``, with the ports SGLang derives from it free too."""
    return free_port_run(DERIVED_PORTS, offset=JOINER_PORT_DELTA)

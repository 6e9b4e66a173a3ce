"""Port picking for the CPU cluster: SGLang derives more ports from the ones it is given."""

from __future__ import annotations

import socket

import pytest

from sglang_elastic_ep.controller.launchers.ports import MOONCAKE_PORTS, free_joiner_port
from sglang_elastic_ep_testbed.cluster.procs import (
    free_port,
    free_port_run,
    free_ports,
    listen_ports,
    port_is_free,
)


def test_a_port_run_is_free_and_avoids_the_taken_ports() -> None:
    port = free_port_run(7)
    assert all(port_is_free(q) for q in range(port, port + 7))
    taken = set(range(port, port + 7))
    other = free_port_run(1, avoid=taken)
    assert other not in taken
    joiner = free_port_run(7, offset=233, avoid=taken)
    assert joiner not in taken and not taken & set(range(joiner + 233, joiner + 240))


def test_a_busy_port_is_not_free() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not port_is_free(sock.getsockname()[1])


def test_no_run_found_says_so() -> None:
    with pytest.raises(RuntimeError, match="no free port"):
        free_port_run(1, offset=70000, attempts=3)


def test_ports_and_their_derived_runs_stay_below_the_ephemeral_range_and_off_mooncakes(
) -> None:
    ports = listen_ports()
    if not ports:
        pytest.skip("the kernel's ephemeral range starts too low to pick ports below it")
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    joiners = [free_port_run(7, offset=233) for _ in range(20)]
    picked = [free_port(), *free_ports(3), free_port_run(7), *joiners, free_joiner_port()]
    assert all(min(ports) <= p < low for p in picked), (picked, low)
    assert all(j + 233 + 6 < low for j in joiners)
    # Mooncake's transfer engine listens on random ports of 15000..17000 in every rank.
    assert not [p for p in picked if set(range(p, p + 239)) & set(MOONCAKE_PORTS)], picked
    assert not set(ports) & set(MOONCAKE_PORTS)

"""The membership's wait for peers to reach the connect, on a real ``torch`` TCPStore (the store
``nixl_ep`` and the CPU buffer publish their metadata in): marks are seen across clients, a
withdrawn mark is gone, and a peer counted out is never connected."""

from __future__ import annotations

import threading
from datetime import timedelta

from torch.distributed import TCPStore

from sglang_elastic_ep.backends.nixl_membership import ARRIVAL_KEY_PREFIX, NixlMembership


class ConnectRecorder:
    """A buffer that only records ``connect_ranks`` (no peer needed for what is tested)."""

    def __init__(self, store: TCPStore) -> None:
        self.tcp_store_group = store
        self.connects: list[list[int]] = []

    def connect_ranks(self, ranks: list[int]) -> None:
        self.connects.append(list(ranks))


def _stores() -> tuple[TCPStore, TCPStore]:
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    return server, client


def test_a_peer_that_arrives_is_connected_and_a_dead_one_is_dropped() -> None:
    server, peer_store = _stores()
    buf = ConnectRecorder(server)
    alive = {1: True, 2: True}
    counted_out = threading.Event()
    m = NixlMembership(reconnect_grace_s=0.0,
                       members_alive=lambda ranks: [alive[r] for r in ranks])
    m.attach(buf, rank=0, max_ep_size=4, initial_ep_size=3)

    def peers() -> None:
        peer_store.set(f"{ARRIVAL_KEY_PREFIX}/1", b"1")  # rank 1 reaches its connect
        # rank 2 never does; Mooncake counts it out only once rank 0 is seen waiting for it
        while not server.check([f"{ARRIVAL_KEY_PREFIX}/0"]):
            pass
        alive[2] = False
        counted_out.set()

    t = threading.Thread(target=peers, daemon=True)
    t.start()
    m.ensure_connected()
    t.join(timeout=10)
    assert counted_out.is_set()
    assert buf.connects == [[0, 1]] and m.dropped == [2]
    assert m.connected_ep_size == 2
    assert not peer_store.check([f"{ARRIVAL_KEY_PREFIX}/0"])  # rank 0's mark is withdrawn

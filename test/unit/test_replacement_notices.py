"""The survivors' notices to a replacement, on a real rendezvous TCPStore: every serving rank
writes through its own client, the joiner reads through another."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from sglang_elastic_ep.sglang import replacement_notices
from sglang_elastic_ep.sglang.scale_up_joiner import counted_out_since
from sglang_elastic_ep_testbed.cluster.procs import free_port


@pytest.fixture
def stores() -> tuple[TCPStore, TCPStore, TCPStore]:
    """Rank 0's store (the host), rank 1's client, the joiner's client."""
    host = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=5))
    clients = [TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=5))
               for _ in range(2)]
    return host, clients[0], clients[1]


def test_a_joiner_reads_each_commit_that_counted_it_out_since_it_registered(
        stores: tuple[TCPStore, TCPStore, TCPStore], monkeypatch: pytest.MonkeyPatch) -> None:
    host, rank_1, joiner = stores
    def as_rank(store: TCPStore) -> None:
        """The client the next notice is written or read through."""
        monkeypatch.setattr(replacement_notices, "_rendezvous_store", lambda: store)

    as_rank(joiner)
    assert replacement_notices.times_counted_out(3) == 0  # none before any commit
    for serving in (host, rank_1):  # an earlier joiner of slot 3, counted out by both ranks
        as_rank(serving)
        replacement_notices.announce_counted_out([3])
    as_rank(joiner)
    registered = {3: replacement_notices.times_counted_out(3)}
    assert registered == {3: 2}
    assert counted_out_since(registered) is None  # only a later commit turns it away
    as_rank(rank_1)
    replacement_notices.announce_counted_out([3])
    as_rank(joiner)
    reason = counted_out_since(registered)
    assert reason is not None and "counted ranks [3] out" in reason, reason
    assert counted_out_since({2: 0}) is None  # another slot's joiner is not turned away

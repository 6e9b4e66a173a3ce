"""Which DP shard gets the next request, and which requests a dead shard took with it.

Upstream's DP controller routes round-robin in its own process, so when a shard's process dies
nobody knows which requests it held: their clients wait forever. Routing in the tokenizer
process instead (same round-robin, over the shards known to be alive) keeps that knowledge
next to the request states, so the requests of a dead shard can be ended with a clear error.
The same knowledge drains a scale-down: leaving shards get no new request, and the requests
they still run are known (and ended with a clear error if the drain times out).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field

PRUNE_AT = 4096  # tracked ids per shard before finished ones are dropped


@dataclass
class LiveShardRouter:
    down: frozenset[int] = frozenset()
    leaving: frozenset[int] = frozenset()  # a scale-down drains them: no new requests
    leaving_down: frozenset[int] = frozenset()  # leaving shards that died before the release
    _next: int = 0
    _by_shard: dict[int, list[str]] = field(default_factory=dict)

    def pick(self, shard_count: int) -> int | None:
        """Round-robin over shards ``[0, shard_count)`` neither down nor leaving; None if none."""
        live = [s for s in range(shard_count) if s not in self.down and s not in self.leaving]
        if not live:
            return None
        shard = live[self._next % len(live)]
        self._next += 1
        return shard

    def track(self, shard: int, request_id: str, in_flight: Container[str]) -> None:
        rids = self._by_shard.setdefault(shard, [])
        rids.append(request_id)
        if len(rids) > PRUNE_AT:
            rids[:] = [r for r in rids if r in in_flight]

    def start_drain(self, shards: Iterable[int], down: Iterable[int] = ()) -> None:
        """A scale-down drains ``shards``: no new request goes to them from now on. ``down``:
        those of them that failed before it (a scale-down past failed ranks), dead from the
        start of the drain."""
        self.leaving = frozenset(shards)
        self.leaving_down = self.leaving & frozenset(down)

    def stop_draining(self) -> None:
        """The scale-down ended without releasing its shards (refused, failed, called off):
        they take requests again, except those that died during the drain, which are down."""
        self.down = self.down | self.leaving_down
        self.leaving = frozenset()
        self.leaving_down = frozenset()

    def mark_down(self, shards: set[int], in_flight: Container[str]) -> dict[int, list[str]]:
        """Record the shards that are down now; returns the still-running requests of each
        shard that just went down (those are lost with it). Leaving shards go inactive on
        purpose (a scale-down releases them): not down. A released one holds no request (its
        drain ended before the release), so any it still runs died with it mid-drain: those
        are returned too, once each. A leaving shard seen dead stays so for the rest of the
        drain: each scheduler reports its own view after its pass, so a report from a peer
        one pass behind can still show it up, and it will not come back before the release."""
        shards = set(shards)
        self.leaving_down = self.leaving_down | frozenset(shards & self.leaving)
        lost_leaving: dict[int, list[str]] = {}
        for shard in sorted(shards & self.leaving):
            running = [r for r in self._by_shard.get(shard, []) if r in in_flight]
            if running:
                self._by_shard[shard] = [r for r in self._by_shard[shard] if r not in running]
                lost_leaving[shard] = running
        shards -= self.leaving
        newly_down = sorted(shards - self.down)
        self.down = frozenset(shards)
        lost = {
            shard: [r for r in self._by_shard.pop(shard, []) if r in in_flight]
            for shard in newly_down
        }
        return lost | lost_leaving

    def still_running(
        self, shards: Iterable[int], in_flight: Container[str]
    ) -> dict[int, list[str]]:
        """The tracked requests of ``shards`` that have not finished (a drain waits on these)."""
        return {
            shard: [r for r in self._by_shard.get(shard, []) if r in in_flight]
            for shard in sorted(set(shards))
        }

    def retire(self, shards: Iterable[int]) -> None:
        """The drained shards were removed where they are (holes below the tail): they get
        no request, and count as down until a report shows their relaunches up."""
        gone = frozenset(shards)
        self.down = self.down | gone
        self.leaving = self.leaving - gone
        self.leaving_down = self.leaving_down - gone

    def forget(self, shards: Iterable[int]) -> None:
        """The shards are gone for good (scaled away): drop their tracking and states."""
        gone = set(shards)
        for shard in gone:
            self._by_shard.pop(shard, None)
        self.down = self.down - gone
        self.leaving = self.leaving - gone
        self.leaving_down = self.leaving_down - gone

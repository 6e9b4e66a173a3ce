"""Around a Mooncake WORLD view change: the members meet before it, and each rank enters the
first collective after an admission only once its own view has it.

Mooncake PG (control-plane design) admits ranks through a view update that its coordinator
commits and each process's agent applies in the background. Applying a view resets the group's
collective counter (``taskCount``), whose parity picks the buffer slot of the next collective,
and sets the active set whose sync flags a collective waits for (``mooncake_worker_thread.cpp``).
``recover_ranks`` can return on a rank before that rank's agent applied the view. Upstream then
broadcasts the expert map at once (``_finalize_scale_up``): a rank still on the old view waits
in the old slot for the old members while the others, on the new view, complete the broadcast
without it and wait in the next barrier.

So after WORLD admits ranks, each rank waits (locally, no collective) until its own view shows
them active. On the usual path the view is already applied and the wait costs one call.

A view change also needs every member quiet before it (:class:`WorldQuiesce`). A Mooncake
collective ends with each rank writing a sync flag into every peer's flag array of the
collective's buffer slot; a rank that has seen all flags clears its whole array. Slots alternate
with ``taskCount``, so a peer's flag for the next collective normally lands in the other slot.
Applying a view that changes the active set resets ``taskCount`` to 0: the first collective after
it can reuse the slot of the last one before it. The coordinator commits an admission (or a
deactivation) on the first member's proposal, so a fast member (or the joiner it activates) can
write its flag for the expert-map broadcast while a slow member's worker has not yet cleared the
same slot after the previous collective: the clear wipes the flag, and the slow member waits in
the broadcast for it forever while every other rank completes it. So before any member proposes
the change, the members of the agreed step meet at a barrier in the rendezvous TCPStore (not a
Mooncake collective): a member arrives only after its last collective returned, and a
collective returns only after its flags were cleared.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from sglang_elastic_ep.sglang.operation_log import get_logger
from sglang_elastic_ep.sglang.upstream import attached_state, elastic_state

logger = get_logger(__name__)

VIEW_APPLY_TIMEOUT_S = 60.0
_POLL_S = 0.01
# The members act on the same agreed pass, so they arrive within one pass of each other; past
# this a member is taken to be gone or to have left the step (``WorldQuiesce``).
QUIESCE_TIMEOUT_S = 20.0
QUIESCE_KEY_PREFIX = "elastic-ep/quiesce"
_QUIESCE_ATTR = "_eep_world_quiesce"


class BarrierStore(Protocol):
    """The part of ``torch.distributed.TCPStore`` a barrier needs."""

    def add(self, key: str, amount: int) -> int: ...

    def get(self, key: str) -> bytes: ...

    def compare_set(self, key: str, expected_value: bytes, desired_value: bytes) -> bytes: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


_MET = b"met"
_GIVEN_UP = b"given-up"


def store_barrier(store: BarrierStore, key: str, parties: int, timeout_s: float) -> bool:
    """Wait until ``parties`` callers reached ``key``: True when all did within ``timeout_s``.

    A key is crossed again by each later change of the same kind, members and ranks (a shrink
    and regrow cycle repeats them): arrivals are counted, and the n-th arrival belongs to
    crossing ``ceil(n / parties)``. Each crossing is decided once, by whoever sets its done key
    first: its last arrival (met) or a waiter that timed out (given up). So every member of a
    crossing returns the same answer, even when the last one comes just as a waiter gives up.
    An arrival that finds its crossing already given up (members of an earlier step that left
    before it came) takes a place in the next crossing.

    The store (rank 0's, for the deployment's life) keeps one done key per barrier key: the
    last arrival of a met crossing drops the crossing before's, which every member has left,
    since each of them arrived at this one."""
    if parties < 1:
        raise ValueError(f"a barrier needs at least one party, got {parties}")
    while True:
        arrived = store.add(key, 1)
        crossing = (arrived - 1) // parties + 1
        done_key = f"{key}/done-{crossing}"
        last = arrived == crossing * parties
        if last:
            decision = store.compare_set(done_key, b"", _MET)
        elif store.check([done_key]):
            decision = store.get(done_key)
        else:
            try:
                store.wait([done_key], timedelta(seconds=timeout_s))
            except Exception:  # TCPStore raises on timeout (DistStoreError, a RuntimeError)
                decision = store.compare_set(done_key, b"", _GIVEN_UP)
            else:
                decision = store.get(done_key)
            return decision == _MET
        if decision == _MET:
            if last and crossing > 1:
                store.delete_key(f"{key}/done-{crossing - 1}")
            return True


def quiesce_key(change: str, participants: Sequence[int], ranks: Sequence[int]) -> str:
    """The barrier key of a view change: its kind, who meets, which ranks change."""
    def joined(values: Sequence[int]) -> str:
        return ",".join(str(v) for v in sorted(values))

    return (f"{QUIESCE_KEY_PREFIX}/{change}/members-{joined(participants)}"
            f"/ranks-{joined(ranks)}")


@dataclass
class WorldQuiesce:
    """Who meets before the next view change of WORLD: the ranks of the pass that agreed on the
    step (armed on that pass, used once by the change it leads to)."""

    participants: tuple[int, ...] = ()
    # The last change that backed out because a member never came (``take_backed_out``).
    backed_out: bool = False

    def arm(self, participants: Sequence[int]) -> None:
        self.participants = tuple(sorted(participants))
        self.backed_out = False

    def take(self) -> tuple[int, ...]:
        """The participants, once: a change upstream makes without an agreed step (none armed)
        keeps upstream's behaviour."""
        found, self.participants = self.participants, ()
        return found

    def take_backed_out(self) -> bool:
        """Whether the agreed step's change backed out (once)."""
        found, self.backed_out = self.backed_out, False
        return found

    def before_view_change(self, change: str, ranks: Sequence[int],
                           back_out: bool = False) -> bool:
        """Meet the step's other members in the rendezvous store before proposing ``change``:
        whether the change goes ahead. A member that does not come within
        :data:`QUIESCE_TIMEOUT_S` died, or left the agreed step alive (upstream returned
        before the change on it and it waits in the next pass's gather). The others go ahead
        without it, or with ``back_out`` (a change that is upstream's "not yet" when not
        made) propose nothing: going ahead alone in an admission leaves them waiting in the
        expert-map broadcast for a member that waits in the gather for them, for good, while
        backing out sends every member to the next pass's gather, whose agreement decides
        again with whoever is alive."""
        participants = self.take()
        if len(participants) < 2:
            return True
        from sglang.srt.distributed.utils import get_global_tcp_store

        store = get_global_tcp_store()
        if store is None:
            logger.warning("[elastic-ep] no rendezvous store: %s of %s without the quiesce "
                           "barrier", change, list(ranks))
            return True
        key = quiesce_key(change, participants, ranks)
        start = time.monotonic()
        met = store_barrier(store, key, len(participants), QUIESCE_TIMEOUT_S)
        waited = time.monotonic() - start
        if met:
            logger.info("[elastic-ep] rank %d: members %s quiet before %s of %s (waited %.2f s)",
                        dist.get_rank(), list(participants), change, list(ranks), waited)
            return True
        self.backed_out = back_out
        outcome = ("this rank proposes nothing on this pass, and the next pass's agreement "
                   "enters the step again with every live member" if back_out else "going ahead")
        logger.warning("[elastic-ep] rank %d: not every member of %s reached the quiesce "
                       "barrier before %s of %s within %.0f s: %s", dist.get_rank(),
                       list(participants), change, list(ranks), waited, outcome)
        return not back_out


def world_quiesce(state: Any) -> WorldQuiesce:
    """This process's :class:`WorldQuiesce`, kept on upstream's elastic state."""
    return attached_state(state, _QUIESCE_ATTR, WorldQuiesce)


def wait_for_local_view(
    active_ranks: Callable[[], Sequence[int]],
    ranks: Sequence[int],
    timeout_s: float = VIEW_APPLY_TIMEOUT_S,
    poll_s: float = _POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    gone: Callable[[], bool] = lambda: False,
) -> float | None:
    """Poll ``active_ranks()`` until every rank in ``ranks`` is active: the seconds waited, or
    None when the view did not show them within ``timeout_s``, or once ``gone()`` says one of
    them can no longer become active (its process died: the view will not come)."""
    start = clock()
    while True:
        view = list(active_ranks())
        if all(0 <= r < len(view) and view[r] for r in ranks):
            return clock() - start
        if clock() - start >= timeout_s or gone():
            return None
        sleep(poll_s)


def propose_then_wait_for_view(propose: Callable[[], bool],
                               view_waited: Callable[[], float | None],
                               ranks: Sequence[int]) -> tuple[bool, float | None]:
    """This rank's proposal to admit ``ranks`` (``propose``: False when they are not all
    registered yet), then the wait for the view that shows them (``view_waited``, as
    :func:`wait_for_local_view` answers): whether they were admitted, and the wait.

    Every rank of the agreed pass proposes the same admission and Mooncake applies it once; a
    rank's own proposal can fail (the coordinator's RPC times out while it handles the
    others'). Its error is raised only when the view does not show the admission either: when
    it does, this rank is in the same view as the others and goes on with them."""
    try:
        if not propose():
            return False, None
    except RuntimeError as exc:
        waited = view_waited()
        if waited is None:
            raise
        logger.warning("[elastic-ep] this rank's own Mooncake proposal to admit ranks %s "
                       "failed (%s), but the view shows them admitted: going on with the "
                       "others", list(ranks), exc)
        return True, waited
    return True, view_waited()


def admit_then_wait_for_view(original: Callable[[list[int]], bool], global_ranks: list[int]
                             ) -> bool:
    """AROUND ``elastic_ep._try_recover_world`` (scale-up admission and rank recovery)."""
    state = elastic_state()
    if state is not None and not world_quiesce(state).before_view_change(
            "admit", global_ranks, back_out=True):
        return False  # upstream's "not yet": nothing changed, a later pass tries again
    from mooncake.pg import get_active_ranks, get_current_epoch

    world = dist.group.WORLD
    admitted, waited = propose_then_wait_for_view(
        lambda: original(global_ranks),
        lambda: wait_for_local_view(lambda: get_active_ranks(world).tolist(), global_ranks,
                                    gone=lambda: not all(world_members_alive(global_ranks))),
        global_ranks)
    if not admitted:
        return False
    epoch = get_current_epoch(world)
    if waited is None:
        # Going on risks the hang this hook exists for; failing would strand the joiners. Say
        # which view this rank is on so the hang (if it comes) can be read from the log.
        logger.error("[elastic-ep] rank %d: Mooncake WORLD view (epoch %d, active %s, "
                     "activatable %s) lacks admitted ranks %s", dist.get_rank(), epoch,
                     get_active_ranks(world).tolist(), world_members_alive(global_ranks),
                     global_ranks)
    else:  # one line per admission: which view each rank entered the next collective on
        logger.info("[elastic-ep] rank %d: Mooncake WORLD view epoch %d has admitted ranks %s "
                    "(waited %.2f s for it)", dist.get_rank(), epoch, global_ranks, waited)
    return True


def world_members_alive(ranks: Sequence[int]) -> list[bool]:
    """Which of the global ``ranks`` this process's Mooncake WORLD view counts as live members:
    healthy, active or awaiting activation, with an endpoint (Mooncake's "activatable"). False
    once a member's agent went offline, at once or after the heartbeat timeout."""
    from mooncake.pg import get_peer_state

    return [bool(up) for up in get_peer_state(dist.group.WORLD, list(ranks))]


class ReplacementGone(RuntimeError):
    """A replacement being taken back died before its launch-time groups were ready for it."""


def wait_for_peers_in_world(peers_ready: Callable[[], bool], global_ranks: Sequence[int],
                            in_world: Callable[[Sequence[int]], list[bool]],
                            sleep: Callable[[float], None] = time.sleep,
                            poll_s: float = _POLL_S) -> None:
    """Wait until ``peers_ready()``; raise ``ReplacementGone`` once WORLD counts any of
    ``global_ranks`` out instead (upstream's wait has no end for a peer that died first)."""
    while not peers_ready():
        gone = [r for r, up in zip(global_ranks, in_world(global_ranks), strict=True) if not up]
        if gone:
            raise ReplacementGone(f"ranks {gone} left Mooncake's WORLD before they registered "
                                  "in every launch-time group")
        sleep(poll_s)


def wait_for_group_peers(original: Callable[[Any, list[int]], None], backend: Any,
                         ranks: list[int]) -> None:
    """AROUND ``elastic_ep._wait_for_peer_state`` (a launch-time group, while the survivors take
    replacements back): the same wait, given up when a replacement dies meanwhile."""
    if elastic_state() is None:
        return original(backend, ranks)
    from mooncake.pg import get_peer_state

    global_ranks = [dist.get_global_rank(backend, r) for r in ranks]
    wait_for_peers_in_world(lambda: all(get_peer_state(backend, ranks)), global_ranks,
                            world_members_alive)
    return None


def queue_ready_unless_gone(queue: Any, gone: Callable[[], list[int]],
                            poll_ms: int = 200) -> None:
    """Upstream's ``MessageQueue.wait_until_ready`` (the writer waits for every reader's
    subscription and answers READY; a reader waits for that READY), each receive polled so that
    the wait ends with ``ReplacementGone`` once ``gone()`` names a member that left WORLD."""

    def receive(socket: Any) -> bytes:
        while not socket.poll(poll_ms):
            dead = gone()
            if dead:
                raise ReplacementGone(f"ranks {dead} left Mooncake's WORLD before their "
                                      "launch-time group's message queue was ready")
        return socket.recv()

    if queue._is_writer:
        for socket, readers in ((queue.local_socket, queue.n_local_reader),
                                (queue.remote_socket, queue.n_remote_reader)):
            for _ in range(readers):
                receive(socket)
            if readers > 0:
                socket.send(b"READY")
    elif queue._is_local_reader or queue._is_remote_reader:
        socket = queue.local_socket if queue._is_local_reader else queue.remote_socket
        answer = receive(socket)
        if answer != b"READY":
            raise RuntimeError(f"message queue handshake: expected READY, got {answer!r}")


def group_queue_unless_gone(original: Callable[[Any], None], group: Any) -> None:
    """AROUND ``elastic_ep._maybe_create_message_queue`` (a launch-time group, while the
    survivors take replacements back): upstream's queue, whose readiness handshake waits on
    zmq with no end for a replacement that died after its group took it back, given up
    (``ReplacementGone``) once WORLD counts a member of the group out."""
    if elastic_state() is None:
        return original(group)
    from sglang.srt.distributed.device_communicators.shm_broadcast import MessageQueue

    members = list(group.ranks)

    def gone() -> list[int]:
        return [r for r, up in zip(members, world_members_alive(members), strict=True) if not up]

    upstream_wait = MessageQueue.wait_until_ready
    thread = threading.get_ident()

    def wait_until_ready(queue: Any) -> None:
        if threading.get_ident() != thread:
            return upstream_wait(queue)
        return queue_ready_unless_gone(queue, gone)

    MessageQueue.wait_until_ready = wait_until_ready
    try:
        return original(group)
    finally:
        MessageQueue.wait_until_ready = upstream_wait

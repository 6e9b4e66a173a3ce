"""Rank agreement before a collective membership step, without blocking a forward pass.

Problem: each rank learns about a membership change (a scale request, a joiner that
connected) on its own forward pass. If one rank enters a collective (admit, weight moves)
while another runs a normal forward, both hang.

Protocol, per round (step name + operation id + epoch), polled once per forward pass:

1. If the round's abort key exists: ABORT.
2. On the first poll, publish ``{intent, pass}`` under ``<round>/intent/<rank>``.
3. If every member has published: the entry pass is ``E = max(published passes) + 1``.
   ``pass == E``: ENTER. ``pass < E``: WAIT. ``pass > E``: this rank missed E; ABORT.
   A member that published a different intent: ABORT.
4. Otherwise WAIT, or ABORT once ``timeout_s`` has passed since this rank's first poll.
   Every ABORT this rank decides is written to the abort key, so the others abort too.

Why all ranks enter on the same pass: forward passes are lockstep (each contains a
collective over all active ranks), so a store write made during pass p is visible to every
rank's poll in pass p + 1. The last intent is written in pass max(p_i) = E - 1, so every rank
sees the full set by pass E and none sees it complete before it can compute E. Ranks that
already agree therefore enter on the first poll after the last publication. Aborts are
consistent for the same reason: a rank aborts on timeout only while it has not seen all
intents, which means E is at least one pass after its abort write, and every rank checks
the abort key before entering.

Requirement on the adapter: ``pass_id`` must be equal on all members for the same pass (keep
a counter advanced once per forward pass and reset on all ranks at every commit).

The SGLang adapter uses the simpler lockstep form at the end of this module instead: with DP
attention every scheduler pass already all-gathers one row per rank, so each rank appends its
:class:`Proposal` to that row (:func:`pack_row`) and every rank computes the same
:func:`gathered_round` from the same rows, on the same pass, with no store and no added
collective.
"""

from __future__ import annotations

import enum
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class KVStore(Protocol):
    """The subset of ``torch.distributed.TCPStore`` used here; a real TCPStore fits."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...  # TCPStore.get blocks for missing keys: check first

    def add(self, key: str, amount: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


class InMemoryKVStore:
    """KVStore for tests and single-process use; ``get`` of a missing key raises KeyError."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)


class Decision(str, enum.Enum):
    WAIT = "wait"  # keep serving; poll again next forward pass
    ENTER = "enter"  # enter the collective step now, in this pass
    ABORT = "abort"  # give the step up; every member reaches the same decision


@dataclass(frozen=True)
class Intent:
    """What a rank is about to do. Members must publish equal intents to enter."""

    step: str  # e.g. "admit", "scale_down_commit", "rejoin"
    operation_id: str
    epoch: int = 0  # bump to retry the same step after an abort
    target: int | None = None  # e.g. the new EP size, so mismatched requests never meet

    @property
    def round_id(self) -> str:
        return f"{self.step}/{self.operation_id}/{self.epoch}"

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "operation_id": self.operation_id,
            "epoch": self.epoch,
            "target": self.target,
        }


class RankAgreement:
    """One rank's view of one agreement round. Create one per round per rank."""

    def __init__(
        self,
        store: KVStore,
        *,
        rank: int,
        members: Sequence[int],
        intent: Intent,
        timeout_s: float = 30.0,
        prefix: str = "elastic_ep/agree",
    ) -> None:
        if rank not in members:
            raise ValueError(f"rank {rank} is not among the members {sorted(members)}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.store = store
        self.rank = rank
        self.members = tuple(sorted(set(members)))
        self.intent = intent
        self.timeout_s = timeout_s
        self._base = f"{prefix}/{intent.round_id}"
        self._started_at: float | None = None
        self._published = False
        self._decision: Decision | None = None
        self._last_wait_pass: int | None = None
        self.enter_pass: int | None = None
        self.abort_reason: str | None = None

    @property
    def decision(self) -> Decision | None:
        """The final decision, or None while still waiting."""
        return self._decision

    @property
    def published(self) -> bool:
        return self._published

    def _intent_key(self, rank: int) -> str:
        return f"{self._base}/intent/{rank}"

    @property
    def _abort_key(self) -> str:
        return f"{self._base}/abort"

    def poll(self, *, pass_id: int, now: float) -> Decision:
        """Non-blocking; call once per forward pass. Final decisions are sticky."""
        if self._decision is not None:
            return self._decision
        if self._started_at is None:
            self._started_at = now
        if self.check_abort() is not None:
            return Decision.ABORT

        if not self._published:
            payload = {"rank": self.rank, "pass": pass_id, "intent": self.intent.to_json()}
            self.store.set(self._intent_key(self.rank), json.dumps(payload))
            self._published = True

        keys = [self._intent_key(r) for r in self.members]
        if self.store.check(keys):
            return self._decide_with_all(pass_id, keys)
        if now - self._started_at >= self.timeout_s:
            missing = [r for r in self.members if not self.store.check([self._intent_key(r)])]
            return self._decide_abort(
                f"rank {self.rank} timed out after {self.timeout_s:g}s waiting for rank(s) "
                f"{missing} to agree on {self.intent.step}",
                write=True,
            )
        self._last_wait_pass = pass_id
        return Decision.WAIT

    def _decide_with_all(self, pass_id: int, keys: list[str]) -> Decision:
        mine = self.intent.to_json()
        passes: list[int] = []
        for key in keys:
            payload = json.loads(self.store.get(key))
            if payload["intent"] != mine:
                return self._decide_abort(
                    f"rank {payload['rank']} intends {payload['intent']} but rank "
                    f"{self.rank} intends {mine}",
                    write=True,
                )
            if payload["pass"] > pass_id:
                # Impossible with equal lockstep counters; entering would split the ranks.
                return self._decide_abort(
                    f"rank {payload['rank']} published at pass {payload['pass']} while rank "
                    f"{self.rank} is at pass {pass_id}: pass counters differ across ranks",
                    write=True,
                )
            passes.append(payload["pass"])
        enter_pass = max(passes) + 1
        if pass_id == enter_pass:
            self.enter_pass = enter_pass
            self._decision = Decision.ENTER
            return Decision.ENTER
        if pass_id < enter_pass:
            self._last_wait_pass = pass_id
            return Decision.WAIT
        return self._decide_abort(
            f"rank {self.rank} polled at pass {pass_id}, after the agreed entry pass "
            f"{enter_pass}; poll exactly once per forward pass",
            write=True,
        )

    def can_abort(self, pass_id: int) -> bool:
        """Whether aborting now cannot split the members.

        Safe before publishing, or in a pass whose poll returned WAIT: then the entry pass
        is later than this one, and every member reads the abort key before entering.
        """
        if self._decision is not None:
            return self._decision is Decision.ABORT
        return not self._published or self._last_wait_pass == pass_id

    def abort(self, reason: str, *, pass_id: int) -> None:
        """Give the round up from outside (peer death, operation timeout); others follow.

        Once published, call it only after this pass's poll() returned WAIT (see can_abort).
        """
        if not self.can_abort(pass_id):
            raise RuntimeError(
                f"rank {self.rank} cannot abort {self.intent.round_id} at pass {pass_id}: "
                "poll() first in this pass; abort only if it returned WAIT"
            )
        if self._decision is None:
            self._decide_abort(reason, write=True)

    def check_abort(self) -> str | None:
        """Reason if some member aborted the round (the decision becomes ABORT), else None."""
        if self._decision is Decision.ABORT:
            return self.abort_reason
        if self._decision is None and self.store.check([self._abort_key]):
            self._decide_abort(self._read_abort_reason(), write=False)
            return self.abort_reason
        return None

    def _read_abort_reason(self) -> str:
        try:
            return json.loads(self.store.get(self._abort_key))["reason"]
        except (KeyError, ValueError):
            return "aborted by another rank"

    def _decide_abort(self, reason: str, *, write: bool) -> Decision:
        if write and not self.store.check([self._abort_key]):
            # Racing writers may overwrite each other's reason; any of them is true.
            self.store.set(self._abort_key, json.dumps({"rank": self.rank, "reason": reason}))
        elif write:
            reason = self._read_abort_reason()
        self.abort_reason = reason
        self._decision = Decision.ABORT
        return Decision.ABORT

    def release(self) -> None:
        """Delete this rank's intent once every member is past the round.

        Call after the collective step finished (ENTER) or after an ABORT. The abort key
        is kept: a slow member must still find it.
        """
        self.store.delete_key(self._intent_key(self.rank))


class LockstepVerdict(str, enum.Enum):
    """What every rank does this pass, decided from the same gathered values on every rank."""

    NOTHING_PENDING = "nothing_pending"  # no rank sees a scale: run the normal per-pass step
    ENTER = "enter"  # every rank is ready for the same target: enter the membership step
    WAIT = "wait"  # some rank is not ready (saw the request later, or sees no joiner yet)
    ABORT = "abort"  # some rank calls the pending step off (cancelled, timed out): all drop it


def lockstep_verdict(max_ready: int, min_ready: int, max_target: int) -> LockstepVerdict:
    """Agreement for ranks that already run in lockstep (DP attention: every pass has a
    collective). Each rank contributes ``ready`` = the scale target it is ready to enter (it sees
    the request, the joining cohort and the joiners' peer state; else 0) and the target it sees.
    Every rank reduces the same contributions (the rows of the DP gather, or one all-reduce with
    MAX of ``(ready, -ready, target)``) to the same three numbers, hence the same verdict: no rank
    enters a membership collective that another rank skips on this pass, and every local check
    upstream makes afterwards already holds."""
    if min(max_ready, min_ready, max_target) < 0 or min_ready > max_ready:
        raise ValueError(f"bad reduced values: ready max={max_ready} min={min_ready}")
    if max_target == 0:
        return LockstepVerdict.NOTHING_PENDING
    if min_ready == max_ready == max_target:
        return LockstepVerdict.ENTER
    return LockstepVerdict.WAIT


# --------------------------------------------------------- the verdict's inputs as gather rows


class StepKind(enum.IntEnum):
    """The membership step a rank proposes; an integer column of its gather row."""

    NONE = 0  # no change seen
    GROW = 1  # a scale-up: upstream admits the joiners
    SHRINK = 2  # a scale-down: the tail leaves once drained
    LET_GO = 3  # the survivors let go of a failed tail of scale-joined ranks


class AbortReason(enum.IntEnum):
    """Why a rank calls its pending step off; an integer column of its gather row."""

    NONE = 0
    CANCELLED = 1  # the operation was cancelled (``DELETE /scale_elastic_ep/{id}``)
    TIMED_OUT = 2  # the step did not become ready within the scale timeout


@dataclass(frozen=True)
class Proposal:
    """One rank's input to the verdict of one pass.

    Schedulers carry no operation id, so ``(kind, serving, target)`` names the operation: the
    step, the membership it starts from and the size it goes to. Ranks enter only when they
    agree on all three.
    """

    rank: int  # EP rank
    kind: StepKind
    ready: int  # ``target`` when this rank can enter the step now, else 0
    target: int  # the size this rank sees requested (0: none)
    serving: int  # the EP size this rank serves on now
    abort: AbortReason = AbortReason.NONE  # this rank calls its pending step off

    def __post_init__(self) -> None:
        problem = _proposal_problem(self)
        if problem is not None:
            raise ValueError(problem)


PROPOSAL_COLUMNS = 6  # member (rank + 1; 0 = no row), kind, ready, target, serving, abort


def _proposal_problem(p: Proposal) -> str | None:
    if p.rank < 0 or p.serving < 1 or p.target < 0:
        return f"rank {p.rank}: bad sizes (serving {p.serving}, target {p.target})"
    if p.ready not in (0, p.target):
        return f"rank {p.rank}: ready {p.ready} is neither 0 nor its target {p.target}"
    if (p.kind is StepKind.NONE) != (p.target == 0):
        return f"rank {p.rank}: step {p.kind.name} with target {p.target}"
    if p.abort is not AbortReason.NONE and p.kind not in (StepKind.GROW, StepKind.SHRINK):
        return f"rank {p.rank}: abort of step {p.kind.name} (only a scale is called off)"
    return None


def pack_row(proposal: Proposal, timings: Sequence[int] = ()) -> list[int]:
    """This rank's columns of the gather: the proposal, then its own expert timings."""
    return [proposal.rank + 1, int(proposal.kind), proposal.ready, proposal.target,
            proposal.serving, int(proposal.abort), *timings]


def blank_row(timing_width: int) -> list[int]:
    """The columns of a row no rank wrote (upstream's fallback row for an inactive slot)."""
    return [0] * (PROPOSAL_COLUMNS + timing_width)


def unpack_rows(rows: Sequence[Sequence[int]]) -> tuple[list[Proposal], str | None]:
    """The proposals in gathered ``rows`` (rows with member 0 carry none: a slot no rank wrote,
    or one upstream blanked as inactive), and what is wrong with the first malformed row."""
    proposals: list[Proposal] = []
    seen: set[int] = set()
    for row in rows:
        member = int(row[0])
        if member == 0:
            continue
        head = [int(v) for v in row[:PROPOSAL_COLUMNS]]
        if member < 0 or len(head) < PROPOSAL_COLUMNS:
            return proposals, f"malformed gather row {head}"
        try:
            proposal = Proposal(rank=member - 1, kind=StepKind(head[1]), ready=head[2],
                                target=head[3], serving=head[4], abort=AbortReason(head[5]))
        except ValueError as exc:
            return proposals, f"malformed gather row {head}: {exc}"
        if proposal.rank in seen:
            return proposals, f"two gather rows for rank {proposal.rank}"
        seen.add(proposal.rank)
        proposals.append(proposal)
    return proposals, None


@dataclass(frozen=True)
class GatheredRound:
    """The verdict of one pass, reached from the gathered rows alone (equal on every rank)."""

    verdict: LockstepVerdict
    proposals: tuple[Proposal, ...] = ()
    problem: str | None = None  # why the rows forbid entering although they may look ready
    abort: AbortReason = AbortReason.NONE  # on ABORT: why (a cancel wins over a timeout)


def verdict_from_proposals(proposals: Sequence[Proposal],
                           problem: str | None = None) -> GatheredRound:
    """:func:`lockstep_verdict` over every rank's proposal, entering only when the ranks also
    agree on the membership they serve and on the step. ``problem`` (a malformed row) forces
    WAIT: an unreadable row may be a rank that is not ready."""
    found = tuple(proposals)
    if problem is not None:
        return GatheredRound(LockstepVerdict.WAIT, found, problem)
    if not found:
        return GatheredRound(LockstepVerdict.WAIT, found, "no rank's row in the gather")
    aborting = sorted({(p.abort, p.target) for p in found if p.abort is not AbortReason.NONE})
    if aborting:
        # Before anything else: a rank that calls the step off never enters it, so no rank may.
        reason, target = aborting[0]
        return GatheredRound(LockstepVerdict.ABORT, found,
                             f"the scale to {target} is called off ({reason.name.lower()})",
                             abort=reason)
    serving = sorted({p.serving for p in found})
    if len(serving) > 1:
        return GatheredRound(LockstepVerdict.WAIT, found,
                             f"ranks serve on different EP sizes {serving}")
    readies = [p.ready for p in found]
    verdict = lockstep_verdict(max(readies), min(readies), max(p.target for p in found))
    kinds = sorted({p.kind.name for p in found})
    if verdict is LockstepVerdict.ENTER and len(kinds) > 1:
        return GatheredRound(LockstepVerdict.WAIT, found,
                             f"ranks ready for size {found[0].target} propose steps {kinds}")
    return GatheredRound(verdict, found)


def gathered_round(rows: Sequence[Sequence[int]]) -> GatheredRound:
    """The verdict from gathered rows (each starting with :data:`PROPOSAL_COLUMNS` columns)."""
    return verdict_from_proposals(*unpack_rows(rows))


def gathered_timings(rows: Sequence[Sequence[int]], *, slots_per_rank: int,
                     capacity: int) -> list[int]:
    """Every rank's expert timings as one vector, ``[ns per row..., rows...]`` over
    ``capacity * slots_per_rank`` physical slots (zeros where no row has them): each row carries
    its own ``slots_per_rank`` ns values then as many row counts after the proposal."""
    total = capacity * slots_per_rank
    ns = [0] * total
    counts = [0] * total
    if not slots_per_rank:
        return ns + counts
    for row in rows:
        rank = int(row[0]) - 1
        if rank < 0 or rank >= capacity:
            continue
        start = rank * slots_per_rank
        own = [int(v) for v in row[PROPOSAL_COLUMNS:PROPOSAL_COLUMNS + 2 * slots_per_rank]]
        if len(own) != 2 * slots_per_rank:
            continue
        ns[start:start + slots_per_rank] = own[:slots_per_rank]
        counts[start:start + slots_per_rank] = own[slots_per_rank:]
    return ns + counts

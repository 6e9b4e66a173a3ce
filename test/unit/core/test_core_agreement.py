"""Agreement simulated on ranks in lockstep forward passes.

Within a pass the ranks poll in a random order and see every write made so far, which
covers every interleaving allowed by "a write in pass p is visible to all by pass p + 1".
"""

import random

import pytest

from sglang_elastic_ep.core.agreement import Decision, InMemoryKVStore, Intent, RankAgreement

DT = 0.05  # seconds per forward pass
INTENT = Intent(step="admit", operation_id="op-1", target=4)


def make(
    store: InMemoryKVStore, ranks: list[int], timeout_s: float = 5.0, intent: Intent = INTENT
) -> dict[int, RankAgreement]:
    return {
        r: RankAgreement(store, rank=r, members=ranks, intent=intent, timeout_s=timeout_s)
        for r in ranks
    }


def simulate(
    agreements: dict[int, RankAgreement],
    start_pass: dict[int, int],
    rng: random.Random,
    max_passes: int = 400,
    dead: frozenset[int] = frozenset(),
) -> dict[int, tuple[Decision, int]]:
    """Run passes until every live rank decided; returns rank -> (decision, pass)."""
    decided: dict[int, tuple[Decision, int]] = {}
    live = [r for r in agreements if r not in dead]
    for p in range(max_passes):
        order = live[:]
        rng.shuffle(order)
        for r in order:
            if p < start_pass[r]:
                continue  # this rank has not seen the change yet: no poll
            d = agreements[r].poll(pass_id=p, now=p * DT)
            if d is not Decision.WAIT and r not in decided:
                decided[r] = (d, p)
        if len(decided) == len(live):
            return decided
    raise AssertionError(f"undecided after {max_passes} passes: {decided}")


def test_ranks_that_already_agree_enter_on_the_first_poll_after_publication() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1, 2])
    for r in (0, 1, 2):
        assert ags[r].poll(pass_id=10, now=0.0) is Decision.WAIT  # publishing pass
    for r in (2, 0, 1):
        assert ags[r].poll(pass_id=11, now=0.1) is Decision.ENTER
    assert {a.enter_pass for a in ags.values()} == {11}


def test_single_member_enters_on_next_pass() -> None:
    ag = make(InMemoryKVStore(), [0])[0]
    assert ag.poll(pass_id=0, now=0.0) is Decision.WAIT
    assert ag.poll(pass_id=1, now=0.0) is Decision.ENTER


def test_skewed_ranks_all_enter_on_the_same_pass() -> None:
    for seed in range(300):
        rng = random.Random(seed)
        n = rng.randint(2, 8)
        ranks = list(range(n))
        first = rng.randint(0, 20)
        start = {r: first + rng.randint(0, 5) for r in ranks}  # 0..5 passes late
        decided = simulate(make(InMemoryKVStore(), ranks), start, rng)
        assert {d for d, _ in decided.values()} == {Decision.ENTER}, f"seed {seed}"
        assert {p for _, p in decided.values()} == {max(start.values()) + 1}, f"seed {seed}"


def test_enter_is_not_blocked_by_timeout_once_everyone_published() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1], timeout_s=1.0)
    ags[0].poll(pass_id=0, now=0.0)
    ags[1].poll(pass_id=0, now=0.0)
    assert ags[0].poll(pass_id=1, now=50.0) is Decision.ENTER


def test_rank_that_never_publishes_makes_every_live_rank_abort() -> None:
    for seed in range(50):
        rng = random.Random(seed)
        ranks = list(range(4))
        dead = frozenset({rng.choice(ranks)})
        start = {r: rng.randint(0, 5) for r in ranks}
        ags = make(InMemoryKVStore(), ranks, timeout_s=1.0)
        decided = simulate(ags, start, rng, dead=dead)
        assert {d for d, _ in decided.values()} == {Decision.ABORT}, f"seed {seed}"
        first_live_start = min(start[r] for r in ranks if r not in dead)
        for r, (_, p) in decided.items():
            # Nobody waits much past the first rank's timeout: the abort key spreads it.
            assert p <= first_live_start + 1.0 / DT + 2, f"seed {seed}"
            assert f"[{next(iter(dead))}]" in (ags[r].abort_reason or ""), f"seed {seed}"


def test_abort_key_spreads_before_other_ranks_time_out() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1, 2], timeout_s=1.0)
    ags[0].poll(pass_id=0, now=0.0)
    ags[1].poll(pass_id=15, now=0.75)  # started later, its own timeout is far away
    assert ags[0].poll(pass_id=21, now=1.05) is Decision.ABORT  # rank 2 never came
    assert ags[1].poll(pass_id=22, now=1.1) is Decision.ABORT
    assert "rank 0 timed out" in (ags[1].abort_reason or "")
    # A rank arriving late aborts on its very first poll instead of publishing.
    assert ags[2].poll(pass_id=23, now=1.15) is Decision.ABORT
    assert not store.check([f"elastic_ep/agree/{INTENT.round_id}/intent/2"])


def test_external_abort_after_wait_spreads_to_all() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1, 2])
    assert ags[0].poll(pass_id=0, now=0.0) is Decision.WAIT
    assert ags[1].poll(pass_id=0, now=0.0) is Decision.WAIT
    assert ags[0].can_abort(0)
    ags[0].abort("rank 2 died", pass_id=0)
    assert ags[1].poll(pass_id=1, now=0.1) is Decision.ABORT
    assert ags[1].abort_reason == "rank 2 died"
    assert ags[2].poll(pass_id=1, now=0.1) is Decision.ABORT


def test_abort_is_refused_when_it_could_split_the_ranks() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1])
    ags[0].poll(pass_id=0, now=0.0)
    ags[1].poll(pass_id=0, now=0.0)
    # Pass 1 is the entry pass: rank 1 may already be inside the collective.
    assert not ags[0].can_abort(1)
    with pytest.raises(RuntimeError, match="poll\\(\\) first"):
        ags[0].abort("too late", pass_id=1)
    assert ags[1].poll(pass_id=1, now=0.1) is Decision.ENTER
    assert ags[0].poll(pass_id=1, now=0.1) is Decision.ENTER
    assert not ags[0].can_abort(1)


def test_abort_before_publishing_is_always_allowed() -> None:
    ags = make(InMemoryKVStore(), [0, 1])
    ags[1].abort("cohort mismatch", pass_id=7)
    assert ags[1].decision is Decision.ABORT
    assert ags[0].poll(pass_id=8, now=0.0) is Decision.ABORT


def test_mismatched_intents_abort_everyone() -> None:
    store = InMemoryKVStore()
    a = RankAgreement(store, rank=0, members=[0, 1], intent=INTENT)
    b = RankAgreement(store, rank=1, members=[0, 1], intent=Intent("admit", "op-1", target=5))
    a.poll(pass_id=0, now=0.0)
    assert b.poll(pass_id=0, now=0.0) is Decision.ABORT
    assert "intends" in (b.abort_reason or "")
    assert a.poll(pass_id=1, now=0.1) is Decision.ABORT


def test_rounds_with_different_epochs_do_not_interfere() -> None:
    store = InMemoryKVStore()
    old = make(store, [0, 1])
    old[0].abort("first attempt failed", pass_id=0)
    retry = make(store, [0, 1], intent=Intent("admit", "op-1", epoch=1, target=4))
    retry[0].poll(pass_id=5, now=0.0)
    retry[1].poll(pass_id=5, now=0.0)
    assert retry[0].poll(pass_id=6, now=0.0) is Decision.ENTER
    assert retry[1].poll(pass_id=6, now=0.0) is Decision.ENTER


def test_polling_after_the_entry_pass_is_detected() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1])
    ags[0].poll(pass_id=0, now=0.0)
    ags[1].poll(pass_id=0, now=0.0)
    assert ags[0].poll(pass_id=1, now=0.0) is Decision.ENTER
    assert ags[1].poll(pass_id=2, now=0.0) is Decision.ABORT  # skipped pass 1
    assert "after the agreed entry pass 1" in (ags[1].abort_reason or "")


def test_unequal_pass_counters_are_detected() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1])
    ags[0].poll(pass_id=100, now=0.0)
    assert ags[1].poll(pass_id=3, now=0.0) is Decision.ABORT
    assert "pass counters differ" in (ags[1].abort_reason or "")


def test_decisions_are_sticky_and_release_deletes_only_own_intent() -> None:
    store = InMemoryKVStore()
    ags = make(store, [0, 1])
    for p in (0, 1):
        for r in (0, 1):
            ags[r].poll(pass_id=p, now=0.0)
    assert ags[0].poll(pass_id=9, now=99.0) is Decision.ENTER
    ags[0].release()
    keys = store.keys()
    assert keys == [f"elastic_ep/agree/{INTENT.round_id}/intent/1"]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="not among the members"):
        RankAgreement(InMemoryKVStore(), rank=3, members=[0, 1], intent=INTENT)
    with pytest.raises(ValueError, match="positive"):
        RankAgreement(InMemoryKVStore(), rank=0, members=[0], intent=INTENT, timeout_s=0)


def test_in_memory_store_matches_tcpstore_semantics() -> None:
    store = InMemoryKVStore()
    store.set("a", "x")
    assert store.get("a") == b"x"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["a", "n"]) and not store.check(["a", "zz"])
    assert store.delete_key("a") and not store.delete_key("a")
    with pytest.raises(KeyError):
        store.get("a")

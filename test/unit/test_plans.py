"""Phase plans (test/plans/*.json, run by the suite, and test/plans/long/*.json, run with
``--long``): each step's change is derived from the sets, and what the plugin does not do is
refused before a cluster starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster.plans import PlanError, load_plan, plan_spec, steps_of

PLANS_DIR = Path(__file__).parents[1] / "plans"
PLANS = sorted(PLANS_DIR.glob("*.json"))
LONG_PLANS = sorted((PLANS_DIR / "long").glob("*.json"))


def kinds(plan: list[list[int]]) -> list[tuple[str, list[int], list[int], list[int]]]:
    return [(s.kind, list(s.ranks), list(s.active), list(s.failed)) for s in steps_of(plan)]


def test_the_suites_plans_exist_and_parse() -> None:
    assert PLANS, "test/plans/ holds no plan"
    assert LONG_PLANS, "test/plans/long/ holds no plan"
    for path in [*PLANS, *LONG_PLANS]:
        assert load_plan(path)[0].kind == "launch", path


def test_every_plan_is_run_by_an_e2e_scenario() -> None:
    """A plan no scenario loads would sit in test/plans/ unchecked."""
    sources = "".join(path.read_text() for path in
                      (Path(__file__).parents[1] / "e2e").glob("test_*.py"))
    unused = [path.name for path in [*PLANS, *LONG_PLANS] if f'"{path.name}"' not in sources]
    assert not unused, f"plans no e2e scenario runs: {unused}"


def test_grow_kill_the_joiner_recover_and_shrink() -> None:
    assert kinds([[0, 1], [0, 1, 2], [0, 1, -2], [0, 1, 2], [0, 1]]) == [
        ("launch", [0, 1], [0, 1], []),
        ("grow", [2], [0, 1, 2], []),
        ("kill", [2], [0, 1], [2]),
        ("recover", [2], [0, 1, 2], []),
        ("shrink", [2], [0, 1], []),
    ]


def test_a_joiner_killed_below_a_live_one_is_shrunk_past_and_the_slots_refilled() -> None:
    assert kinds([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1], [0, 1, 2]])[3:] == [
        ("kill", [2], [0, 1, 3], [2]),
        ("shrink", [2, 3], [0, 1], []),  # the dead rank 2 with the live rank 3
        ("grow", [2], [0, 1, 2], []),
    ]


def test_a_shrink_past_a_dead_joiner_waits_for_the_live_ones_to_exit_only() -> None:
    """The killed joiner's server exited by SIGKILL already; the live one must exit 0."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster.plans import PlanRunner

    steps = steps_of([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1]])
    waited: list[str] = []
    joiner = {r: SimpleNamespace(name=f"joiner{r}",
                                 wait_exit=lambda t, r=r: waited.append(f"joiner{r}") or 0)
              for r in (2, 3)}
    runner = PlanRunner(cluster=SimpleNamespace(followers={}), steps=steps,  # type: ignore[arg-type]
                        load=None)  # type: ignore[arg-type]
    runner.joiners = dict(joiner)
    scaled: list[tuple[int, str]] = []
    runner._scale = lambda step, size, operation_id: scaled.append((size, operation_id))  # type: ignore[method-assign]
    runner._shrink(steps[4])
    assert scaled == [(2, "plan-4-shrink")] and waited == ["joiner3"] and runner.joiners == {}


@pytest.mark.parametrize("grow_order", ["joiner_first", "post_first"])
def test_a_grow_step_calls_back_with_the_answer_before_it_waits(
        monkeypatch: pytest.MonkeyPatch, grow_order: str) -> None:
    """``on_scale_posted`` sees each grow's answer while its operation runs, then the wait;
    each joiner starts before its POST, or after the callback when the POST comes first."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster import plans

    steps = steps_of([[0, 1], [0, 1, 2, 3]])
    calls: list[tuple] = []
    monkeypatch.setattr(plans, "post_scale", lambda url, size, op: {"new_ep_size": size})

    def start_joiner(mode: str, rank_offset: int) -> str:
        calls.append(("started", rank_offset))
        return f"joiner{rank_offset}"

    cluster = SimpleNamespace(url="http://127.0.0.1:1", followers={}, start_joiner=start_joiner)
    runner = plans.PlanRunner(
        cluster=cluster, steps=steps, load=None,  # type: ignore[arg-type]
        on_scale_posted=lambda r, step, op, answer: calls.append((step.index, op, answer)),
        grow_order=grow_order)  # type: ignore[arg-type]
    runner._wait_succeeded = lambda op, what: calls.append(("waited", op))  # type: ignore[method-assign]
    runner._grow(steps[1])
    posted = [[(1, f"plan-1-grow-{rank}", {"new_ep_size": rank + 1})] for rank in (2, 3)]
    started = [[("started", rank)] for rank in (2, 3)]
    waited = [[("waited", f"plan-1-grow-{rank}")] for rank in (2, 3)]
    order = ((started, posted, waited) if grow_order == "joiner_first"
             else (posted, started, waited))
    expected = [call for i in (0, 1) for part in order for call in part[i]]
    assert calls == expected
    assert runner.joiners == {2: "joiner2", 3: "joiner3"}


def test_a_chained_plan_posts_operation_ids_with_its_own_prefix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two plans on one cluster both have a step 1 grow: their ids must differ, since the
    server answers a reused id with the earlier operation."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster import plans

    steps = steps_of([[0, 1], [0, 1, 2]])
    posted: list[str] = []
    monkeypatch.setattr(plans, "post_scale",
                        lambda url, size, op: posted.append(op) or {"new_ep_size": size})
    cluster = SimpleNamespace(url="http://127.0.0.1:1", followers={},
                              start_joiner=lambda mode, rank_offset: f"joiner{rank_offset}")
    for prefix in ("plan", "second"):
        runner = plans.PlanRunner(cluster=cluster, steps=steps, load=None,  # type: ignore[arg-type]
                                  operation_prefix=prefix)
        runner._wait_succeeded = lambda op, what: None  # type: ignore[method-assign]
        runner._grow(steps[1])
    assert posted == ["plan-1-grow-2", "second-1-grow-2"]


def test_two_ranks_killed_at_once_and_a_stay_step_keeps_them_failed() -> None:
    assert kinds([[0, 1, 2], [0, -1, -2], [0], [0, 1, 2]])[1:] == [
        ("kill", [1, 2], [0], [1, 2]),
        ("stay", [], [0], [1, 2]),
        ("recover", [1, 2], [0, 1, 2], []),
    ]


def test_a_failed_launch_rank_below_a_serving_rank_is_removed_then_refilled() -> None:
    steps = steps_of([[0, 1], [0, 1, 2], [0, -1, 2], [0, 2], [0, 1, 2], [0, 1]])
    assert [(s.kind, list(s.ranks), list(s.active), list(s.failed), list(s.holes))
            for s in steps[2:]] == [
        ("kill", [1], [0, 2], [1], []),
        ("remove", [1], [0, 2], [], [1]),
        ("recover", [1], [0, 1, 2], [], []),
        ("shrink", [2], [0, 1], [], []),
    ]


def test_a_joiner_below_a_serving_rank_is_removed_then_refilled_and_a_tail_takes_its_hole_in(
) -> None:
    steps = steps_of([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 3], [0, 1, 2, 3], [0, 1, -2, 3],
                      [0, 1, 3], [0, 1, -3], [0, 1, 2, 3]])
    assert [(s.kind, list(s.ranks), list(s.active), list(s.failed), list(s.holes))
            for s in steps[3:]] == [
        ("remove", [2], [0, 1, 3], [], [2]),
        ("recover", [2], [0, 1, 2, 3], [], []),
        ("kill", [2], [0, 1, 3], [2], []),
        ("remove", [2], [0, 1, 3], [], [2]),
        ("kill", [3], [0, 1], [2, 3], []),  # one failed tail with the hole below
        ("recover", [2, 3], [0, 1, 2, 3], [], []),
    ]


def test_a_plan_killing_a_launch_rank_gets_one_node_per_rank(tmp_path: Path) -> None:
    assert plan_spec(tmp_path, steps_of([[0, 1], [0, -1], [0, 1]])).nodes == 2
    assert plan_spec(tmp_path, steps_of([[0, 1], [0, 1, 2], [0, 1]])).nodes == 1


@pytest.mark.parametrize(("plan", "window"), [
    ([[0, 1], [0, -1]], 10.0),  # the one survivor is below the dead rank
    ([[0, 1], [0, 1, 2], [0, 1, -2]], 10.0),  # the top rank dies: the tie goes its way
    ([[0, 1], [0, 1, 2], [0, -1, -2]], 10.0),
    ([[0, 1, 2], [0, -1, 2]], 35.0),  # rank 2's report alone would evict rank 2
    ([[0, 1], [0, 1, 2], [0, -1, 2]], 35.0),
])
def test_a_plan_that_kills_a_rank_below_a_survivor_outwaits_mooncakes_heartbeat_timeout(
        tmp_path: Path, plan: list[list[int]], window: float) -> None:
    assert plan_spec(tmp_path, steps_of(plan)).fault_window_s == window


@pytest.mark.parametrize(("launch", "redundant"), [([0, 1], "16"), ([0, 1, 2], "32")])
def test_every_launch_rank_holds_every_expert(tmp_path: Path, launch: list[int],
                                              redundant: str) -> None:
    """16 experts: (16 + redundant) / launch size = 16 slots per rank, so any one rank serves
    every expert, at any size a plan shrinks to or while others are down."""
    args = plan_spec(tmp_path, steps_of([launch, [*launch, len(launch)]])).extra_args
    assert args[args.index("--ep-num-redundant-experts") + 1] == redundant


@pytest.mark.parametrize(("plan", "reason"), [
    ([[0, 1]], "at least two"),
    ([[0, 1], "x"], "not a list of rank numbers"),
    ([[0, 1], [0, 1, 1]], "twice"),
    ([[1, 2], [1, 2, 3]], "launch set"),
    ([[0], [0, 1]], "launch set"),
    ([[0, 1], [1]], "rank 0 must stay active"),
    ([[0, 1], [0, -2]], "only active ranks can be killed"),
    ([[0, 1, 2], [0, -1]], "a kill step only kills"),
    ([[0, 1], [0, 1, 2], [0, -1, 2]], None),  # rejoins in place
    ([[0, 1], [0, 1, 2], [0, -1, -2]], None),  # the joiner is let go, rank 1 rejoins
    ([[0, 1], [0, 1, 2], [0, -1, 2], [0, -2]], None),
    ([[0, 1], [0, 1, 2], [0, -1, -2], [0, 1, 2]], None),  # rank 1 first, then rank 2
    ([[0, 1], [0, 1, 2], [0, -1, -2], [0, 2]], "recover launch-time ranks [1] first"),
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3]], None),
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, 2, 3]], None),  # rank 2 rejoins in place
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1]], None),  # or a shrink past it
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, 2]], "one change per step"),
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, -3]], None),  # now a failed tail
    ([[0, 1], [0, 1, 2, 3], [0, -1, -2, 3], [0, 1, 3]], "rejoin in place together"),
    ([[0, 1], [0, 1, 2, 3], [0, -1, -2, 3], [0, 1, 2, 3]], None),
    ([[0, 1, 2], [0, -1, -2], [0, 1]], "rejoin in place together"),
    # Rank 3 killed too: the failed joiners are a tail, and rank 1 rejoins first.
    ([[0, 1], [0, 1, 2, 3], [0, 1, -2, 3], [0, -1, 3], [0, -3], [0, 1], [0, 1, 2, 3]], None),
    ([[0, 1], [0, 1, 2], [0, 1]], None),
    ([[0, 1, 2], [0, 1], [0, 1, 2]], None),  # a released launch slot refilled by a joiner
    ([[0, 1], [0, 2]], "one change per step"),
    # A refilled launch slot holds a joiner: killed, it is held to the joiners' tail rule.
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, -2]], None),
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1]], None),
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, -1, 2, 3], [0, 2, 3]], None),
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, -1, -2], [0, 2]], "recover launch-time ranks [1]"),
    ([[0, 1, 2], [0, -1, 2], [0, 1, 2, 3]], "recover [1] first"),
    ([[0, 1, 2], [0, 1, -2], [0, 1, 2, 3]], "recover [2] first"),
    ([[0, 1, 2], [0, 1, -2], [0, 1]], None),
    ([[0, 1, 2], [0, 1, -2], [0]], "failed or removed: recover them first"),
    ([[0, 1], [0, 1, 2], [0, -1, 2], [0, 2], [0, 2, 3]], "[1] are failed or removed"),
    ([[0, 1], [0, 1, 2], [0, -1, 2], [0, 2], [0]], "[1] are failed or removed"),
    ([[0, 1], [0, 1, 3]], "next free slots"),
    ([[0, 1, 2], [0, 2]], None),  # a live launch-time rank removed where it is
    ([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 3]], None),  # a live joiner removed in place
    ([[0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 2]], "remove the tail first"),
    # A refilled launch slot holds a joiner: removed where it is below a serving rank.
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 3]], None),
    ([[0, 1, 2], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, -2, 3], [0, 1, 3]], None),
    ([[0, 1, 2], [0, 2], [0]], "[1] are failed or removed"),
    ([[0, 1], [0]], "two ranks"),
])
def test_bad_or_unsupported_plans_are_refused_with_the_reason(plan: object,
                                                              reason: str | None) -> None:
    if reason is None:
        steps_of(plan)
        return
    with pytest.raises(PlanError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        steps_of(plan)


def test_the_cli_refuses_a_plan_before_starting_anything(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    from sglang_elastic_ep_testbed.cluster import plans

    bad = tmp_path / "bad.json"
    bad.write_text("[[0, 1], [0, 1, 2], [0, -1, -2], [0, 2]]")
    assert plans.main([str(bad)]) == 2
    assert "recover launch-time ranks [1] first" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text("[[0, 1],")
    assert plans.main([str(tmp_path / "broken.json")]) == 2
    assert "not a readable JSON plan" in capsys.readouterr().err


def test_a_plan_chained_after_another_runs_only_the_steps_after_its_start() -> None:
    """``run(from_step)``: the cluster already is in ``steps[from_step]``'s state (an earlier
    plan left it there), so only the later steps are driven, in order, each then checked."""
    from sglang_elastic_ep_testbed.cluster.plans import PlanRunner

    steps = steps_of([[0, 1], [0, 1, 2], [0, -1, -2], [0, 1, 2]])
    done: list[tuple[str, int]] = []
    runner = PlanRunner(cluster=None, steps=steps, load=None)  # type: ignore[arg-type]
    for kind in ("grow", "kill", "recover"):
        setattr(runner, f"_{kind}", lambda step, kind=kind: done.append((kind, step.index)))
    runner.check = lambda step: done.append(("check", step.index)) or {}  # type: ignore
    runner.run(from_step=1)
    assert done == [("kill", 2), ("check", 2), ("recover", 3), ("check", 3)]
    done.clear()
    runner.run()
    assert done[:2] == [("grow", 1), ("check", 1)] and len(done) == 6


def test_a_relaunch_hook_sees_each_launch_time_replacement_before_the_wait_for_it() -> None:
    """``on_relaunch``: the fault a scenario injects into a recovery runs right after the
    replacement started, before the runner waits for the rank to serve."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster.plans import PlanRunner

    steps = steps_of([[0, 1], [0, -1], [0, 1]])
    done: list[object] = []
    cluster = SimpleNamespace(
        start_node=lambda rank, recover: done.append(("start", rank, recover)) or f"node{rank}")
    runner = PlanRunner(cluster=cluster, steps=steps, load=None,  # type: ignore[arg-type]
                        on_relaunch=lambda r, rank, server: done.append(("hook", rank, server)))
    runner._wait_rejoined = lambda rank, nodes: done.append(("wait", rank))  # type: ignore
    runner._recover(steps[2])
    assert done == [("start", 1, True), ("hook", 1, "node1"), ("wait", 1)]


class FakeReplacement:
    """A replacement server for the runner's wait: alive until ``crash()``."""

    def __init__(self, name: str) -> None:
        self.name, self.killed, self.code = name, False, None

    def crashed(self) -> bool:
        return self.code not in (None, 0) and not self.killed

    def state(self) -> str:
        return "alive" if self.code is None else f"exited with {self.code}"

    def first_exception(self) -> str:
        return "ConnectionError: joinGroup failed"

    def digest(self) -> str:
        return f"{self.name}: {self.state()}"


@pytest.mark.parametrize("crashes", [1, 2])
def test_a_replacement_that_crashes_before_it_serves_is_relaunched_once(
        crashes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """As an orchestrator restarting failed servers would: the first crash of a replacement
    before its rank serves is relaunched and noted; a second one fails the step, naming the
    replacement and its first exception."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster import plans

    steps = steps_of([[0, 1], [0, -1], [0, 1]])
    started: list[FakeReplacement] = []
    followers: dict[int, FakeReplacement] = {}

    def start_node(rank: int, recover: bool) -> FakeReplacement:
        started.append(FakeReplacement(f"node{rank}-recover-{len(started)}"))
        followers[rank] = started[-1]
        return started[-1]

    def status_then_crash(url: str, accept, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
        # Each replacement up to ``crashes`` exits 1 while rank 1 shows failed; the next serves.
        if len(started) <= crashes:
            started[-1].code = 1
            return accept({"ranks": [{"state": "active"}, {"state": "failed"}]})
        return accept({"ranks": [{"state": "active"}, {"state": "active"}]})

    noted: list[str] = []
    monkeypatch.setattr(plans, "wait_status", status_then_crash)
    monkeypatch.setattr(plans, "note_crash_relaunch", lambda what, digest: noted.append(what))
    cluster = SimpleNamespace(url="http://127.0.0.1:1", start_node=start_node,
                              followers=followers)
    hooked: list[str] = []
    runner = plans.PlanRunner(cluster=cluster, steps=steps, load=None,  # type: ignore[arg-type]
                              on_relaunch=lambda r, rank, server: hooked.append(server.name))
    if crashes == 1:
        runner._recover(steps[2])
        assert [s.name for s in started] == ["node1-recover-0", "node1-recover-1"]
        assert hooked == ["node1-recover-0"]  # the scenario's fault is not injected again
        assert noted == ["rank 1's replacement node1-recover-0 exited with 1 before it served: "
                         "first exception 'ConnectionError: joinGroup failed'"]
    else:
        with pytest.raises(plans.ReplacementCrashed, match="node1-recover-1 exited with 1"):
            runner._recover(steps[2])
        assert len(started) == 2 and len(noted) == 1


@pytest.mark.parametrize(("exit_code", "accepted"), [(1, True), (0, False), (None, False)])
def test_a_scheduler_only_kill_requires_the_server_to_exit_non_zero_by_itself(
        exit_code: int | None, accepted: bool) -> None:
    """``kill="scheduler"``: only the rank's scheduler is killed, and a server that then exits
    0 (or keeps running) fails the step: an orchestrator would not relaunch it."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cluster.plans import PlanRunner

    steps = steps_of([[0, 1], [0, -1], [0, 1]])
    crashed: list[str] = []
    cluster = SimpleNamespace(
        followers={1: SimpleNamespace(name="node1")},
        crash_schedulers=lambda server, timeout_s: crashed.append(server.name) or exit_code)
    runner = PlanRunner(cluster=cluster, steps=steps, load=None,  # type: ignore[arg-type]
                        kill="scheduler")
    if accepted:
        runner._kill(steps[1])
    else:
        with pytest.raises(AssertionError, match="would not relaunch it"):
            runner._kill(steps[1])
    assert crashed == ["node1"] and len(runner.kills) == 1


def test_a_live_launch_rank_removed_below_the_tail_leaves_a_hole_a_recover_refills(
        tmp_path: Path) -> None:
    steps = steps_of([[0, 1, 2], [0, 2], [0, 1, 2]])
    assert [(s.kind, list(s.ranks), list(s.active), list(s.holes)) for s in steps] == [
        ("launch", [0, 1, 2], [0, 1, 2], []),
        ("remove", [1], [0, 2], [1]),
        ("recover", [1], [0, 1, 2], []),
    ]
    assert plan_spec(tmp_path, steps).nodes == 3  # rank 1 leaves alone: a server of its own

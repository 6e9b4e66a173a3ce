"""Phase plans: a scenario as data, run on the CPU cluster under load.

A plan is a JSON list of active-rank sets, the format of NIXL EP's elastic tests: the first is
the launch set, each later one the set after one step, and a negative number is that rank
killed with SIGKILL at that step (its whole server; with ``run_plan(kill="scheduler")`` only
its scheduler process, and its server must then exit non-zero by itself).
``[[0, 1], [0, 1, 2], [0, 1, -2], [0, 1, 2], [0, 1]]`` grows to 3, kills the joiner, brings its
replacement in, and shrinks back to 2.

Each step is one change, derived from the sets (:func:`steps_of`): ``kill`` (the negative
ranks), ``recover`` (failed or removed ranks come back: relaunched with
``--ep-join-mode recover``; a failed tail of joiners is re-admitted, every other failed rank
rejoins in place, all of those in one step), ``grow`` (the next free slots: one joiner each,
then ``POST /scale_elastic_ep``), ``shrink`` (the tail: ``POST /scale_elastic_ep``; the
released servers exit 0; a tail holding failed joiners below a live rank is shrunk past
them), ``remove`` (ranks below a serving one removed where they are, ``{"remove_ranks": [...]}``,
leaving holes that a later ``recover`` refills:
``POST /scale_elastic_ep`` to the size with them, then their relaunches. Live ones: a set
without them that is not a prefix; their servers exit 0. Failed ones: the same set again
right after a kill of ranks with a serving rank above them; otherwise the same set again is
``stay``, and failed ranks stay failed). A kill that leaves a scale joiner's hole with no
serving rank above makes it failed again: the survivors let it go with the failed tail above.
What the plugin does not do is refused before the cluster starts, with the reason: a removal
of scale-joined ranks with no serving rank above them other than the tail, a killed rank 0
(it hosts the HTTP
server), growing while ranks are failed or removed, a failed scale-joined tail brought back
before the launch-time ranks that failed with it.

After every step the runner checks what an orchestrator would: the status shows exactly the
step's set active (killed ranks ``failed``, everything else inactive) and every active shard
serves the load again. At the end: no request failed except those a killed rank was running
(503 with a message, started before the fault was seen), and every completed request decoded
the reference tokens.

``python -m sglang_elastic_ep_testbed.cluster.plans test/plans/FILE.json`` runs one plan on a
fresh cluster.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import psutil

from sglang_elastic_ep.sglang.args import FAULT_WINDOW_PAST_HEARTBEAT_S
from sglang_elastic_ep_testbed.cluster.launcher import (
    ClusterSpec,
    LocalCluster,
    ServerProcess,
    note_crash_relaunch,
)
from sglang_elastic_ep_testbed.cluster.load import (
    LoadClient,
    RequestResult,
    greedy_reference,
    most_lost_to_a_kill,
)
from sglang_elastic_ep_testbed.cluster.observe import (
    post_scale,
    wait_each_shard_serves,
    wait_operation,
    wait_rank_state,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cpu.fault_injection import ENV_STALL_S
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_NUM_EXPERTS

StepKind = Literal["launch", "kill", "recover", "grow", "shrink", "remove", "stay"]
# "server": a kill takes the rank's whole server (the machine died); "scheduler": only its
# scheduler process (the OOM killer), and the server must then exit non-zero by itself;
# "hang_first": the lowest rank of the step hangs in its pass instead (SIGUSR1: its process
# and Mooncake agent stay alive, ``cpu.fault_injection``), the others' servers are killed, and
# the runner then does what the status's stall report says: it kills every server the report
# lists in ``ranks_to_relaunch`` once that names the hung rank (each dead one named there too
# or shown failed).
KillHow = Literal["server", "scheduler", "hang_first"]
# The order a recover step relaunches failed ranks in. "lowest_first": launch-time ranks
# together, then the joiners one at a time from the lowest, each awaited before the next (what
# the survivors admit first). "highest_first": the reverse, as an orchestrator restarting
# failed pods in any order may: joiners before launch-time ranks, from the highest rank down,
# each started once the one before waits for the survivors (its start-up done), so the
# survivors must hold the higher ones back until the lower ones are in.
RelaunchOrder = Literal["lowest_first", "highest_first"]
# When a grow step starts each joiner: before its POST (the default), or after it
# (the operation then waits for the joiner, so ``on_scale_posted`` surely finds it running).
GrowOrder = Literal["joiner_first", "post_first"]
# How often a recover step relaunches a replacement that crashed before it served.
CRASH_RELAUNCHES = 1
# What a replacement logs once its start-up is done and it waits for the survivors: a let-go
# tail's joiner in its admission, a rank that rejoins in place in upstream's rejoin.
WAITING_FOR_THE_SURVIVORS = ("registered its cohort: waits for the serving ranks to admit it",
                             "waits for the survivors to take it back")


class PlanError(ValueError):
    """A plan that is malformed or asks for a change the plugin does not make."""


class ReplacementCrashed(AssertionError):
    """A relaunched rank's server exited non-zero before the rank served again."""


@dataclass(frozen=True)
class Step:
    """One entry of a plan: the change it makes and the state it must end in."""

    index: int
    kind: StepKind
    ranks: tuple[int, ...]  # the ranks the change concerns (killed, recovered, added, removed)
    active: tuple[int, ...]  # active after the step
    failed: tuple[int, ...]  # killed and not yet recovered after the step
    holes: tuple[int, ...] = ()  # failed ranks removed where they were, not yet refilled


def load_plan(path: Path) -> list[Step]:
    """The steps of the plan in ``path`` (JSON); ``PlanError`` names what is wrong."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"{path}: not a readable JSON plan: {exc}") from None
    return steps_of(data)


def steps_of(plan: object) -> list[Step]:
    """Validate ``plan`` (a list of rank lists) and derive each step's change."""
    if not isinstance(plan, list) or len(plan) < 2:
        raise PlanError("a plan is a list of at least two active-rank sets")
    sets = []
    for i, entry in enumerate(plan):
        if not isinstance(entry, list) or not all(type(r) is int for r in entry):
            raise PlanError(f"step {i}: {entry!r} is not a list of rank numbers")
        if len({abs(r) for r in entry}) != len(entry):
            raise PlanError(f"step {i}: {entry} names a rank twice")
        sets.append(entry)
    launch = sorted(sets[0])
    if launch != list(range(len(launch))) or len(launch) < 2:
        raise PlanError(f"step 0: the launch set must be ranks 0..n-1 with n >= 2, got {sets[0]}")
    steps = [Step(0, "launch", tuple(launch), tuple(launch), ())]
    # Slots held by scale joiners: every slot a grow adds, a released launch slot too.
    joined: set[int] = set()
    for i, entry in enumerate(sets[1:], start=1):
        step = _step(i, entry, steps[-1], frozenset(joined))
        if step.kind == "grow":
            joined.update(step.ranks)
        elif step.kind == "shrink":
            joined.difference_update(step.ranks)
        steps.append(step)
    return steps


def _step(i: int, entry: list[int], prev: Step, joined: frozenset[int]) -> Step:
    killed = sorted(-r for r in entry if r < 0)
    active = sorted(r for r in entry if r >= 0)
    before, failed, holes = set(prev.active), set(prev.failed), set(prev.holes)
    if 0 not in active:  # -0 is 0: rank 0 cannot even be written as killed
        raise PlanError(f"step {i}: rank 0 must stay active (it hosts the HTTP server)")
    if killed:
        if not set(killed) <= before:
            raise PlanError(f"step {i}: only active ranks can be killed; {killed} vs {prev.active}")
        if set(active) != before - set(killed):
            raise PlanError(f"step {i}: a kill step only kills: expected the others "
                            f"{sorted(before - set(killed))} active, got {active}")
        failed |= set(killed)
        # Holes of joiners with no live rank above them any more: one failed tail with the
        # ranks above, which the survivors let go; they are awaited again.
        down = failed | holes
        tail_from = _failed_tail_start(down, joined, max(before | down) + 1)
        taken_in = {r for r in holes if r >= tail_from}
        return Step(i, "kill", tuple(killed), tuple(active), tuple(sorted(failed | taken_in)),
                    tuple(sorted(holes - taken_in)))
    added, removed = sorted(set(active) - before), sorted(before - set(active))
    if (not added and not removed and prev.kind == "kill" and failed
            and max(failed) < max(active)):
        # Failed ranks with a serving rank above them: removed where they are.
        return Step(i, "remove", tuple(sorted(failed)), tuple(active), (),
                    tuple(sorted(holes | failed)))
    if added and removed:
        raise PlanError(f"step {i}: one change per step; {added} added and {removed} removed")
    if added:
        back = [r for r in added if r in failed or r in holes]
        if back:
            if back != added:
                raise PlanError(f"step {i}: recover {back} first, then grow by "
                                f"{sorted(set(added) - failed)}")
            # A failed tail of joiners is let go and re-admitted; every other failed rank
            # rejoins in place, and the survivors take those back together.
            tail_from = _failed_tail_start(failed, joined, max(before | failed) + 1)
            in_place = {r for r in failed if r < tail_from}
            if in_place & set(back) and not in_place <= set(back):
                raise PlanError(f"step {i}: ranks {sorted(in_place)} rejoin in place together: "
                                "recover them in one step")
            still_down = sorted(r for r in failed - set(back) if r not in joined)
            if still_down and any(r in joined for r in back):
                raise PlanError(f"step {i}: recover launch-time ranks {still_down} first: the "
                                f"replacement of a let-go tail {back} waits for them")
            return Step(i, "recover", tuple(back), tuple(active), tuple(sorted(failed - set(back))),
                        tuple(sorted(holes - set(back))))
        if failed or holes:
            raise PlanError(f"step {i}: ranks {sorted(failed | holes)} are failed or removed: "
                            "recover them first")
        if active != list(range(len(active))):
            raise PlanError(f"step {i}: a scale-up adds the next free slots "
                            f"{list(range(len(before), len(active)))}, not {added}")
        return Step(i, "grow", tuple(added), tuple(active), ())
    if removed and failed and not holes and failed <= joined \
            and active == list(range(len(active))) and min(failed) < max(removed) \
            and sorted(failed | set(removed)) == list(range(len(active), max(before | failed) + 1)):
        # Failed joiners below a live rank: a shrink past them removes them with the tail.
        return Step(i, "shrink", tuple(sorted(failed | set(removed))), tuple(active), ())
    if removed:
        if failed or holes:
            raise PlanError(f"step {i}: ranks {sorted(failed | holes)} are failed or removed: "
                            "recover them first")
        if active != list(range(len(active))):
            if any(r in joined and r > max(active) for r in removed):
                raise PlanError(f"step {i}: {removed} is not the tail, and scale-joined ranks "
                                "are removed below a serving rank only: remove the tail first")
            # Live ranks below a serving one: removed where they are, leaving holes.
            return Step(i, "remove", tuple(removed), tuple(active), (),
                        tuple(sorted(holes | set(removed))))
        if len(active) < 2:
            raise PlanError(f"step {i}: attention DP needs two ranks; cannot shrink to "
                            f"{len(active)}")
        return Step(i, "shrink", tuple(removed), tuple(active), ())
    return Step(i, "stay", (), tuple(active), tuple(sorted(failed)), prev.holes)


def _failed_tail_start(down: set[int], joined: frozenset[int], size: int) -> int:
    """The first slot of the run of down scale-joined ranks at the top of ``size`` (``size``
    itself: none), as the survivors find it (``core.membership.failed_tail``)."""
    first = size
    while first - 1 in down & joined:
        first -= 1
    return first


def plan_spec(tiny_model: Path, steps: Sequence[Step], max_ep_size: int = 4,
              extra_args: Sequence[str] = ()) -> ClusterSpec:
    """A cluster for ``steps``: NIXL EP, every launch rank holding every expert (outputs stay
    identical while ranks are down, at any size the plan shrinks to); one node per launch rank
    when the plan kills a launch-time rank (it then dies and comes back alone), else one
    server."""
    launch = len(steps[0].active)
    # A launch-time rank that dies or leaves alone needs a server of its own.
    kills_launch_rank = any(s.kind in ("kill", "remove") and min(s.ranks) < launch
                            for s in steps)
    redundant = DEFAULT_NUM_EXPERTS * (launch - 1)  # one slot per expert on every launch rank
    spec = ClusterSpec(
        tiny_model, ep_size=launch, max_ep_size=max_ep_size, moe_a2a_backend="nixl",
        nodes=launch if kills_launch_rank else 1,
        extra_args=["--ep-num-redundant-experts", str(redundant), *extra_args],
    )
    if any(s.kind == "kill" and min(s.ranks) < max(s.active) for s in steps):
        # A survivor above the dead rank may be the only one to report it before the window
        # closes, and Mooncake then evicts that survivor (docs/operations.md, "Fault timing").
        spec.fault_window_s = FAULT_WINDOW_PAST_HEARTBEAT_S
    return spec


FAULT_SEEN_S = 90
# A hang beside a death: the stall timeout, then Mooncake's count-out of the dead rank.
STALL_NAMED_S = 300
CHANGE_S = 420  # a joiner or replacement starting beside the ranks on two busy cores
SERVES_S = 180  # for every active shard to serve after a change


@dataclass
class PlanRunner:
    """Drives ``cluster`` (started for the plan's launch set) through ``steps`` under ``load``.

    ``after_step(step, status)`` runs once each step is checked (scenario-specific checks).
    ``on_relaunch(runner, rank, server)`` runs right after a launch-time rank's replacement
    started (a fault to inject into its recovery: it may kill it and start another, noting the
    kill in ``kills``); the runner then waits for the rank to serve as usual.
    ``on_scale_posted(runner, step, operation_id, answer)`` runs right after a grow or shrink
    step's POST was accepted, while its operation runs (checks of the answer, and of what the
    server refuses meanwhile)."""

    cluster: LocalCluster
    steps: Sequence[Step]
    load: LoadClient
    after_step: Callable[[Step, dict], None] | None = None
    reference: dict[str, list[int]] = field(default_factory=dict)  # prompt -> greedy tokens
    joiners: dict[int, ServerProcess] = field(default_factory=dict)  # rank -> its server
    kills: list[float] = field(default_factory=list)  # monotonic times of the kill steps
    on_relaunch: Callable[[PlanRunner, int, ServerProcess], None] | None = None
    on_scale_posted: Callable[[PlanRunner, Step, str, dict], None] | None = None
    kill: KillHow = "server"
    relaunch_order: RelaunchOrder = "lowest_first"
    grow_order: GrowOrder = "joiner_first"
    # Operation ids are ``{operation_prefix}-{step}-{kind}``: plans chained on one cluster
    # need prefixes of their own (a reused id is answered with the earlier operation).
    operation_prefix: str = "plan"

    def run(self, from_step: int = 0) -> None:
        for step in self.steps[from_step + 1:]:
            print(f"[plan] step {step.index}: {step.kind} {list(step.ranks)} -> active "
                  f"{list(step.active)}", flush=True)
            started = time.monotonic()
            getattr(self, f"_{step.kind}")(step)
            changed = time.monotonic()
            current = self.check(step)
            if self.after_step is not None:
                self.after_step(step, current)
            print(f"[plan] step {step.index} done: change {changed - started:.0f} s, checks "
                  f"{time.monotonic() - changed:.0f} s", flush=True)

    def _server_of(self, rank: int) -> ServerProcess | None:
        """The server process of ``rank`` alone: a joiner or a node; None for the primary's."""
        if rank in self.joiners:
            return self.joiners[rank]
        return self.cluster.followers.get(rank)

    def _own_server(self, rank: int) -> ServerProcess:
        server = self._server_of(rank)
        if server is None:
            raise PlanError(f"rank {rank} runs inside the primary server: it cannot be killed "
                            "alone (launch with one node per rank)")
        return server

    def _kill(self, step: Step) -> None:
        self.kills.append(time.monotonic())
        if self.kill == "hang_first":
            self._hang_then_follow_the_stall(step)
            return
        for rank in step.ranks:
            server = self._own_server(rank)
            if self.kill == "server":
                self.cluster.kill_server(server)
                continue
            code = self.cluster.crash_schedulers(server, FAULT_SEEN_S)
            if code in (0, None):
                raise AssertionError(f"rank {rank}'s server {server.name}, its scheduler "
                                     f"killed, {'still runs' if code is None else 'exited 0'}: "
                                     "an orchestrator would not relaunch it")

    def _hang_then_follow_the_stall(self, step: Step) -> None:
        """The lowest rank of ``step`` hangs, the others die; the stall report then has to
        name the hung rank too (its end frees the survivors' collective), and the runner ends
        what it names, as an orchestrator would."""
        hung, *killed = step.ranks
        server = self._own_server(hung)
        if ENV_STALL_S not in server.env:
            raise PlanError(f"rank {hung}'s server was started without {ENV_STALL_S}: it would "
                            "hang only for the default 30 s (give it in ClusterSpec.extra_env)")
        for pid in server.scheduler_pids().values():
            psutil.Process(pid).send_signal(signal.SIGUSR1)
        for rank in killed:
            self.cluster.kill_server(self._own_server(rank))

        def names_the_hung_rank(current: dict) -> dict | None:
            """The report names the hung rank, and each dead one is named or shown failed."""
            stalled = current.get("stalled")
            if not stalled or hung not in stalled["ranks_to_relaunch"]:
                return None
            failed = {r["rank"] for r in current["ranks"] if r["state"] == "failed"}
            return stalled if set(killed) <= failed | set(stalled["ranks_to_relaunch"]) else None

        stalled = wait_status(self.cluster.url, names_the_hung_rank, STALL_NAMED_S,
                              f"the stall report naming rank {hung} to relaunch")
        end_what_the_stall_names(self.cluster, stalled, self._server_of)

    def _recover(self, step: Step) -> None:
        launch = len(self.steps[0].active)
        prev = self.steps[step.index - 1]
        holes = [r for r in step.ranks if r in prev.holes]
        refill = f"{self.operation_prefix}-{step.index}-refill"
        if holes:  # a scale-up adds the holes first; it commits when their relaunches serve
            size = len(prev.active) + len(prev.failed) + len(holes)
            post_scale(self.cluster.url, size, refill)
        # A refilled launch slot is a joiner's.
        nodes = [r for r in step.ranks if r < launch and r not in self.joiners]
        if self.relaunch_order == "highest_first":
            self._relaunch_highest_first(step, nodes)
        else:
            self._relaunch_lowest_first(step, nodes)
        if holes:
            self._wait_succeeded(refill, f"the refill of {holes}")

    def _relaunch(self, rank: int, nodes: Sequence[int], inject: bool = True) -> ServerProcess:
        """Start ``rank``'s replacement: its node's server, or a joiner in recover mode.
        ``inject``: run ``on_relaunch`` (not for the relaunch of a crashed replacement)."""
        if rank in nodes:
            server = self.cluster.start_node(rank, recover=True)
            if inject and self.on_relaunch is not None:
                self.on_relaunch(self, rank, server)
            return server
        server = self.joiners[rank] = self.cluster.start_joiner("recover", rank_offset=rank)
        return server

    def _relaunch_highest_first(self, step: Step, nodes: Sequence[int]) -> None:
        order = sorted(step.ranks, key=lambda r: (r in nodes, -r))
        for rank in order:
            log = self._relaunch(rank, nodes).log_path
            if rank != order[-1]:
                wait_until(lambda log=log: any(line in log.read_text(errors="replace")
                                               for line in WAITING_FOR_THE_SURVIVORS) or None,
                           CHANGE_S, f"rank {rank}'s replacement waiting for the survivors")
        for rank in step.ranks:
            self._wait_rejoined(rank, nodes)

    def _wait_rejoined(self, rank: int, nodes: Sequence[int]) -> None:
        """Wait until ``rank`` serves again. A replacement that crashes first (exits non-zero,
        not killed by the scenario) is relaunched, at most ``CRASH_RELAUNCHES`` times, as an
        orchestrator restarting failed servers does: the plugin's contract is that such a
        server exits non-zero to be relaunched. Each relaunch is printed and noted in
        ``RELAUNCHED_AFTER_A_CRASH``; one crash more fails the step at once, naming its
        first exception."""
        for relaunches in range(CRASH_RELAUNCHES + 1):
            server = self._server_of(rank)

            def active(current: dict, server: ServerProcess | None = server) -> dict | None:
                if current["ranks"][rank]["state"] == "active":
                    return current
                if server is not None and server.crashed():
                    raise ReplacementCrashed(f"rank {rank}'s replacement {server.name} "
                                             f"{server.state()} before it served: first "
                                             f"exception {server.first_exception()!r}")
                return None

            try:
                wait_status(self.cluster.url, active, CHANGE_S, f"rank {rank} active")
                return
            except ReplacementCrashed as crash:
                if relaunches == CRASH_RELAUNCHES:
                    raise
                print(f"[plan] {crash}; relaunched", flush=True)
                note_crash_relaunch(str(crash), server.digest() if server else "")
                self._relaunch(rank, nodes, inject=False)

    def _relaunch_lowest_first(self, step: Step, nodes: Sequence[int]) -> None:
        # Launch-time ranks first, all at once: the survivors take them back together, once
        # every replacement is in WORLD. Then the joiners, one at a time, from the lowest:
        # a let-go tail of several comes back one rank at a time.
        for rank in nodes:
            self._relaunch(rank, nodes)
        for rank in nodes:
            self._wait_rejoined(rank, nodes)
        for rank in step.ranks:
            if rank not in nodes:
                self._relaunch(rank, nodes)
                self._wait_rejoined(rank, nodes)

    def _grow(self, step: Step) -> None:
        for rank in step.ranks:  # one joiner at a time (docs/cpu-testbed.md)
            operation_id = f"{self.operation_prefix}-{step.index}-grow-{rank}"
            if self.grow_order == "post_first":
                self._scale(step, rank + 1, operation_id,
                            before_wait=lambda rank=rank: self._start_scale_joiner(rank))
            else:
                self._start_scale_joiner(rank)
                self._scale(step, rank + 1, operation_id)

    def _start_scale_joiner(self, rank: int) -> None:
        self.joiners[rank] = self.cluster.start_joiner("scale", rank_offset=rank)

    def _shrink(self, step: Step) -> None:
        self._scale(step, len(step.active), f"{self.operation_prefix}-{step.index}-shrink")
        dead = self.steps[step.index - 1].failed  # shrunk past: killed, they exit no more
        for rank in step.ranks:
            server = self._server_of(rank)
            if rank in dead:
                self.joiners.pop(rank, None)
                continue
            if server is None:  # a launch rank of the primary's own tree ends its scheduler alone
                continue
            code = server.wait_exit(SERVES_S)
            if code != 0:
                raise AssertionError(f"released rank {rank}'s server {server.name} exited with "
                                     f"{code}, not 0")
            self.joiners.pop(rank, None)

    def _remove(self, step: Step) -> None:
        operation_id = f"{self.operation_prefix}-{step.index}-remove"
        live = [r for r in step.ranks if r not in self.steps[step.index - 1].failed]
        httpx.post(self.cluster.url + "/scale_elastic_ep",
                   json={"remove_ranks": list(step.ranks), "operation_id": operation_id},
                   timeout=60).raise_for_status()
        self._wait_succeeded(operation_id, f"removal of {list(step.ranks)}")
        for rank in live:  # a live rank leaves as a released one: its server exits 0
            server = self._own_server(rank)
            code = server.wait_exit(SERVES_S)
            if code != 0:
                raise AssertionError(f"removed rank {rank}'s server {server.name} exited with "
                                     f"{code}, not 0")

    def _stay(self, step: Step) -> None:
        pass

    def _scale(self, step: Step, size: int, operation_id: str,
               before_wait: Callable[[], None] | None = None) -> None:
        answer = post_scale(self.cluster.url, size, operation_id)
        if self.on_scale_posted is not None:
            self.on_scale_posted(self, step, operation_id, answer)
        if before_wait is not None:
            before_wait()
        self._wait_succeeded(operation_id, f"scale to {size} ({operation_id})")

    def _wait_succeeded(self, operation_id: str, what: str) -> None:
        done = wait_operation(self.cluster.url, operation_id, CHANGE_S)
        if done["result"] != "succeeded":
            raise AssertionError(f"{what} did not succeed: {done}")

    def check(self, step: Step) -> dict:
        """The status shows exactly ``step``'s active and failed ranks; every active shard
        serves the load. The status then."""
        def matches(current: dict) -> dict | None:
            states = {r["rank"]: r["state"] for r in current["ranks"]}
            active = sorted(r for r, s in states.items() if s == "active")
            failed = sorted(r for r, s in states.items() if s == "failed")
            return current if (active, failed) == (list(step.active), list(step.failed)) \
                else None

        timeout = FAULT_SEEN_S if step.kind == "kill" else CHANGE_S
        current = wait_status(self.cluster.url, matches, timeout,
                              f"step {step.index}: active {list(step.active)}, failed "
                              f"{list(step.failed)}")
        # A joiner's and a node's responses carry no dp_rank: their schedulers' logs show it.
        servers = {r: self._server_of(r) for r in step.active}
        logs = {r: server.log_path for r, server in servers.items() if server is not None}
        wait_each_shard_serves(self.load, list(step.active), SERVES_S, logs=logs)
        return current


def wait_failed_or_follow_the_stall(cluster: LocalCluster, rank: int,
                                    server: ServerProcess) -> float | None:
    """After ``rank`` (its ``server``) died on a two-node cluster: wait until it shows failed;
    or, when a stall report names a survivor first (the survivors wait on each other inside
    Mooncake), do what the report says, relaunch node 1 in recover mode and wait for it to
    serve again, and then for ``rank`` to show failed. When the report was followed, the
    monotonic time it was (node 1 ended: one more kill); else None."""
    url = cluster.url

    def failed_or_a_survivor_named(current: dict) -> dict | None:
        if current["ranks"][rank]["state"] == "failed":
            return current
        stalled = current.get("stalled")
        named = set(stalled["ranks_to_relaunch"]) if stalled else set()
        return current if named - {rank} else None

    seen = wait_status(url, failed_or_a_survivor_named, STALL_NAMED_S,
                       f"rank {rank} failed, or a stall report naming a survivor")
    if seen["ranks"][rank]["state"] == "failed":
        return None
    servers = {1: cluster.followers[1], rank: server}
    ended_at = time.monotonic()
    end_what_the_stall_names(cluster, seen["stalled"], servers.get)
    wait_rank_state(url, 1, "failed", FAULT_SEEN_S)
    cluster.start_node(1, recover=True)
    wait_rank_state(url, 1, "active", CHANGE_S)
    wait_rank_state(url, rank, "failed", FAULT_SEEN_S)
    return ended_at


def end_what_the_stall_names(cluster: LocalCluster, stalled: dict,
                             server_of: Callable[[int], ServerProcess | None]) -> None:
    """Kill the servers of the ranks a stall report lists in ``ranks_to_relaunch`` that still
    run, as an orchestrator following it does (their relaunches are the caller's)."""
    print(f"[stall] report: {stalled['message']}", flush=True)
    for rank in stalled["ranks_to_relaunch"]:
        server = server_of(rank)
        if server is None:
            raise PlanError(f"the stall report names rank {rank}, which runs in the primary "
                            f"server: only a restart ends it ({stalled['message']})")
        if server.popen.poll() is None:
            cluster.kill_server(server)


def assert_only_killed_requests_lost(results: Sequence[RequestResult], kills: Sequence[float],
                                     reference: dict[str, list[int]], in_flight: int) -> None:
    """No request failed except what a killed rank was running (503 naming it, started before
    the fault was seen), at most ``most_lost_to_a_kill(in_flight)`` per kill (``in_flight``:
    the load's concurrency); every
    completed request decoded the reference tokens."""
    lost = [r for r in results if not r.ok]
    for r in lost:
        assert r.lost_to_a_fault, r
        assert any(r.started < k + FAULT_SEEN_S for k in kills), r
    assert len(lost) <= most_lost_to_a_kill(in_flight) * len(kills), \
        f"more requests lost than a kill may cost: {lost}"
    changed = [r for r in results if r.ok and r.output_ids != reference[r.prompt]]
    assert not changed, f"outputs changed: {changed[:3]}"
    assert any(r.ok for r in results), "no request completed"


def run_plan(cluster: LocalCluster, steps: Sequence[Step], *, concurrency: int = 2,
             after_step: Callable[[Step, dict], None] | None = None,
             after: PlanRunner | None = None, from_step: int = 0,
             on_relaunch: Callable[[PlanRunner, int, ServerProcess], None] | None = None,
             on_scale_posted: Callable[[PlanRunner, Step, str, dict], None] | None = None,
             kill: KillHow = "server",
             relaunch_order: RelaunchOrder = "lowest_first",
             grow_order: GrowOrder = "joiner_first",
             operation_prefix: str = "plan") -> PlanRunner:
    """Run ``steps`` on the started ``cluster`` under a greedy load and check everything; the
    runner (its reference outputs, kills and joiners) for further checks.

    ``kill``: how a kill step kills (``KillHow``); ``relaunch_order``: in which order a
    recover step relaunches the failed ranks (``RelaunchOrder``); ``grow_order``: whether a
    grow step starts each joiner before or after its POST (``GrowOrder``).

    ``operation_prefix``: the start of the operation ids of its steps.

    ``after``, ``from_step``: go on where an earlier plan on this cluster (its runner) left
    off, which must be the state of ``steps[from_step]`` (checked): the steps after it run,
    with that runner's joiners and reference outputs. Chaining saves a cluster start and the
    steps that only rebuild a state."""
    reference = after.reference if after is not None else greedy_reference(cluster.url)
    load = LoadClient(cluster.url, concurrency=concurrency, max_new_tokens=8).start()
    runner = PlanRunner(cluster, steps, load, after_step, reference, on_relaunch=on_relaunch,
                        on_scale_posted=on_scale_posted, kill=kill,
                        relaunch_order=relaunch_order, grow_order=grow_order,
                        operation_prefix=operation_prefix)
    if after is not None:
        runner.joiners = after.joiners
    try:
        runner.check(steps[from_step])
        runner.run(from_step)
    finally:
        results = load.stop()
    assert_only_killed_requests_lost(results, runner.kills, reference, concurrency)
    return runner


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan", type=Path, help="a JSON plan (test/plans/*.json)")
    parser.add_argument("--model", type=Path, default=None,
                        help="model directory (default: the testbed's tiny model)")
    parser.add_argument("--max-ep-size", type=int, default=4)
    parser.add_argument("--relaunch-order", choices=["lowest_first", "highest_first"],
                        default="lowest_first",
                        help="how a recover step relaunches several failed ranks")
    args = parser.parse_args(argv)
    try:
        steps = load_plan(args.plan)
    except PlanError as exc:
        print(f"plan refused: {exc}", file=sys.stderr)
        return 2
    if args.model is None:
        from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model

        args.model = write_tiny_model(DEFAULT_DIR)
    with LocalCluster(plan_spec(args.model, steps, args.max_ep_size)) as cluster:
        run_plan(cluster, steps, relaunch_order=args.relaunch_order)
    print(f"[plan] {args.plan}: every step checked", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

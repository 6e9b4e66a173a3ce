"""Whether serving has stalled: a scheduler is stuck and passes no longer complete.

A scheduler stuck in a collective (a peer that never arrives) stops every rank's passes: no
token reaches the HTTP process, while the status may still read "waiting" or "serving". Two
verdicts, one for each load:
- requests wait (``StallDetector``): the HTTP process sees requests in flight and the time of
  the last answer from the schedulers. The stall clock starts at the later of that answer and
  the moment requests began to wait (an idle server's last answer may be an hour old);
- nothing waits (``stuck_in_a_pass``): no answer is due, so silence says nothing; the
  schedulers' published steps do. An idle scheduler still runs a pass now and then (each starts
  with the DP gather) and rests in ``idle`` between them, so one that has sat in a step of a
  pass for longer than the threshold is stuck there.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from sglang_elastic_ep.core.api_models import RankPosition


class StallDetector:
    """Fed once per check; says since when serving is stalled, or None."""

    def __init__(self, threshold_s: float) -> None:
        if not threshold_s > 0:
            raise ValueError(f"the stall threshold must be > 0 seconds, got {threshold_s}")
        self.threshold_s = threshold_s
        self._waiting_since: float | None = None

    def observe(self, now: float, waiting_requests: int,
                last_answer_at: float | None) -> float | None:
        """``now`` and ``last_answer_at`` on one clock; the time the stall began, or None."""
        if waiting_requests <= 0:
            self._waiting_since = None
            return None
        if self._waiting_since is None:
            self._waiting_since = now
        since = max(self._waiting_since,
                    last_answer_at if last_answer_at is not None else -math.inf)
        return since if now - since > self.threshold_s else None


STOPPED_AFTER_S = 5.0  # a scheduler publishes once a second: silence this long means stopped
# Steps that are not part of a pass: resting between passes, or before the first one.
RESTING_STEPS = frozenset({"idle", "starting"})


def stuck_in_a_pass(positions: list[RankPosition], ranks: Collection[int],
                    threshold_s: float) -> float | None:
    """How long the longest-stuck live scheduler of ``ranks`` has been in one step of a pass,
    when that is more than ``threshold_s``; else None. A scheduler that stopped reporting is
    stopped or dead, not stuck: the failure handling covers it."""
    stuck = [p.in_step_s for p in positions
             if p.rank in ranks and p.report_age_s <= STOPPED_AFTER_S
             and p.step not in RESTING_STEPS and p.in_step_s > threshold_s]
    return max(stuck) if stuck else None


def in_their_forward_since(positions: list[RankPosition], seconds: float) -> list[int]:
    """The live schedulers (reporting) that entered a forward at most ``seconds`` ago and are
    in it still. A peer that completed the same DP gather as this rank can only be in that
    pass's forward (its next one needs this rank's dispatch); entering it after this rank's
    gather began tells it from the previous pass's forward, whose report may be a second old."""
    return [p.rank for p in positions
            if p.step == "forward" and p.in_step_s <= seconds
            and p.report_age_s <= STOPPED_AFTER_S]


def positions_from_reports(reports: list[dict], now: float) -> list[RankPosition]:
    """Each scheduler's published report (``{rank, step, since, passes, at}``, Unix times) as
    where it is ``now``, by rank."""
    positions = [
        RankPosition(rank=int(r["rank"]), step=str(r["step"]),
                     in_step_s=round(max(0.0, now - float(r["since"])), 3),
                     passes=int(r["passes"]), report_age_s=round(max(0.0, now - float(r["at"])), 3))
        for r in reports
    ]
    return sorted(positions, key=lambda p: p.rank)


def describe_positions(positions: list[RankPosition]) -> str:
    """One clause per step, naming the ranks in it: what an operator reads first."""
    if not positions:
        return ("where each scheduler is could not be read (the reports live in the rendezvous "
                "store that rank 0 hosts: start with --dist-init-addr; rank 0 may be stopped)")
    stopped = [p.rank for p in positions if p.report_age_s > STOPPED_AFTER_S]
    by_step: dict[str, list[RankPosition]] = {}
    for p in positions:
        if p.rank not in stopped:
            by_step.setdefault(p.step, []).append(p)
    clauses = [
        f"ranks {[p.rank for p in ranks]} in step '{step}' for "
        f"{max(p.in_step_s for p in ranks):.0f} s"
        for step, ranks in sorted(by_step.items(), key=lambda kv: kv[1][0].rank)
    ]
    if stopped:
        clauses.append(f"ranks {stopped} stopped reporting (process stopped or dead)")
    return "; ".join(clauses)


# Mooncake's coordinator takes a rank whose agent sent no heartbeat for this long out of every
# group (``kHeartbeatTimeout`` in its coordinator), whatever the link reports say.
MOONCAKE_HEARTBEAT_TIMEOUT_S = 30.0
# Mooncake's own values of the two timeouts the server may set (its defaults when unset).
MOONCAKE_DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
MOONCAKE_DEFAULT_FAULT_WINDOW_S = 30.0


def mooncake_count_out_s(collective_timeout_s: float | None, fault_window_s: float | None
                         ) -> float:
    """How long after its last report a silent member is out of every Mooncake group: its
    heartbeat times out, a fault window opened by then closes, and a collective that waited on
    it times out and probes it. A stall longer than this is not a silent member's: the live
    ranks in it wait on each other."""
    timeout = (MOONCAKE_DEFAULT_COLLECTIVE_TIMEOUT_S if collective_timeout_s is None
               else collective_timeout_s)
    window = MOONCAKE_DEFAULT_FAULT_WINDOW_S if fault_window_s is None else fault_window_s
    return MOONCAKE_HEARTBEAT_TIMEOUT_S + window + timeout


def outlasted_count_out(stalled_s: float, count_out_s: float | None) -> bool:
    """Whether a stall of ``stalled_s`` is past ``mooncake_count_out_s`` (unknown: never)."""
    return count_out_s is not None and stalled_s > count_out_s


def ranks_to_end(positions: list[RankPosition], active: Collection[int],
                 own_from: int, counted_out: bool = False) -> dict[int, str]:
    """The schedulers of a stalled deployment whose end lets the others' passes go on, each
    with why; ``own_from``: the lowest rank an orchestrator may end and relaunch (the ranks
    below are the launch-time server's, only named); ``counted_out``: the stall has outlasted
    ``mooncake_count_out_s``.

    The one holding the others up: a scheduler that stopped reporting, else one a pass behind
    the rest, else (all in the same step of the same pass) each of them. Once the stall is
    counted out, Mooncake has taken the silent ones out of its groups, so the others no longer
    wait on them: the live ones are looked at as if the silent ones were gone, and the silent
    ones are still named (dead or stopped, each needs its relaunch). When that names no rank
    from ``own_from`` on, the highest live one from there is ended instead: a collective
    waiting on a peer whose process ended goes on without it (Mooncake probes a silent peer's
    liveness once the collective times out), so ending any member frees the others."""
    live = [p for p in positions if p.rank in active]
    stopped = [p for p in live if p.report_age_s > STOPPED_AFTER_S]
    reporting = [p for p in live if p.report_age_s <= STOPPED_AFTER_S]
    silent = {p.rank: f"stopped reporting {p.report_age_s:.0f} s ago while serving stalled"
              for p in stopped}
    if silent and not counted_out:
        culprits = silent
    else:
        ahead = max((p.passes for p in reporting), default=0)
        behind = [p for p in reporting if p.passes < ahead]
        stuck = behind or [p for p in reporting if p.step not in RESTING_STEPS]
        culprits = {p.rank: f"stuck in step '{p.step}' for {p.in_step_s:.0f} s"
                            + (", a pass behind the others," if behind else "")
                            + " while serving stalled"
                            + (" past the time Mooncake takes to count a silent member out"
                               if silent else "") for p in stuck}
    own = {rank: why for rank, why in culprits.items() if rank >= own_from}
    if not own:
        peers = [p for p in reporting if p.rank >= own_from]
        if culprits and peers:
            freer = max(peers, key=lambda p: p.rank)
            own = {freer.rank: f"waits with rank(s) {sorted(culprits)} while serving stalled: "
                               "ending it frees their collective"}
    chosen = own or culprits
    # Listed once Mooncake counted them out: freeing the others does not bring them back.
    gone = {rank: why for rank, why in silent.items() if counted_out and rank not in chosen}
    return dict(sorted({**chosen, **gone}.items()))


def stall_action(to_end: dict[int, str], first_apart: int = 1) -> str:
    """What an operator does about a stall, from ``ranks_to_end(own_from=first_apart)``.
    ``first_apart``: the lowest rank outside rank 0's server (the launch-time ranks per node).
    ``ranks_to_end`` names a rank of rank 0's server only when no other rank's end frees it;
    such a rank comes back only with a restart, since rank 0 hosts the HTTP server."""

    def listed(ranks: dict[int, str]) -> str:
        return (f"rank(s) {sorted(ranks)} ("
                + "; ".join(f"rank {rank} {why}" for rank, why in ranks.items()) + ")")

    relaunch = {rank: why for rank, why in to_end.items() if rank >= first_apart}
    primary = {rank: why for rank, why in to_end.items() if rank < first_apart}
    if primary:
        also = f"; {listed(relaunch)} need a relaunch as well" if relaunch else ""
        return (f"Serving resumes by itself if the peer arrives; else restart the deployment: "
                f"{listed(primary)} of rank 0's server, which hosts the HTTP server, hold the "
                f"others up{also}")
    if relaunch:
        return (f"Serving resumes by itself if the peer arrives; else end {listed(relaunch)} and "
                "relaunch each with --ep-join-mode recover and its original arguments (a "
                "launch-time rank: its node's server): the others serve on meanwhile")
    return ("Serving resumes by itself if the peer arrives; else restart the deployment: no "
            "position says which rank holds the others up")

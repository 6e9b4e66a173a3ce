"""Real ``nixl_ep`` on one GPU: EP ranks as processes, phases 2 -> 3 -> 2 -> 3, driven by our
membership module, with dispatch/combine checked against a reference in every phase.

The test process is the orchestrator: it owns the TCPStore, launches ranks 0 and 1, launches
rank 2 for phase 1 (it leaves in phase 2), and launches a new rank 2 for phase 3 once the old
one has exited. The ranks coordinate phases through store barriers (``_nixl_ep_worker.py``).
``connect_ranks`` has no timeout of its own, so every process is bounded (faulthandler exit in
the workers, a deadline here). Needs the ``nixl-cu12`` wheel (import name ``nixl_ep_cu12``) and
``libcudart.so.12`` on ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_nixl_ep_worker.py")
DEADLINE_S = 420.0
GRACE_S = 5.0
# Experiments: EEP_NIXL_WORKER_ARGS="--fixed-layout --hang-timeout 90" passes flags to workers.
EXTRA_WORKER_ARGS = os.environ.get("EEP_NIXL_WORKER_ARGS", "").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_nixl_ep() -> None:
    for name in ("nixl_ep_cu12", "nixl_ep"):
        if importlib.util.find_spec(name) is not None:
            return
    reason = "needs nixl_ep: install the nixl-cu12==1.5.1 wheel (import name nixl_ep_cu12)"
    print(reason)
    pytest.skip(reason)


class Cluster:
    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.port = tmp, port
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def launch(self, name: str, *args: str, extra: list[str] | None = None) -> None:
        out = (self.tmp / f"{name}.out").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(WORKER), "--port", str(self.port), "--log-dir", str(self.tmp)]
            + ["--grace", str(GRACE_S), *EXTRA_WORKER_ARGS, *(extra or []), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def wait(self, names: list[str], deadline: float) -> None:
        for name in names:
            left = max(1.0, deadline - time.monotonic())
            try:
                rc = self.procs[name].wait(timeout=left)
            except subprocess.TimeoutExpired:
                self.kill_all()
                pytest.fail(f"{name} did not finish in time (hang?)\n{self.tails()}")
            if rc != 0:
                self.kill_all()
                pytest.fail(f"{name} exited with {rc}\n{self.tails()}")

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the group we started for this worker
                p.wait()

    def tails(self) -> str:
        parts = []
        for name in self.procs:
            text = (self.tmp / f"{name}.out").read_text(errors="replace")
            parts.append(f"----- {name} -----\n{text[-6000:]}")
        return "\n".join(parts)


def load_events(tmp: Path) -> list[dict[str, Any]]:
    events = []
    for f in sorted(tmp.glob("rank*.jsonl")):
        events += [json.loads(line) for line in f.read_text().splitlines() if line]
    return sorted(events, key=lambda e: e["t"])


def first(events: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    for e in events:
        if all(e.get(k) == v for k, v in match.items()):
            return e
    raise AssertionError(f"no event {match}")


@pytest.mark.parametrize("layout", ["upstream", "fixed"])
def test_phases_2_3_2_3_with_real_nixl_ep(tmp_path: Path, cuda: None, layout: str) -> None:
    """``upstream``: dispatch with num_experts for the connected ranks (as SGLang 0.5.23);
    ``fixed``: num_experts for --max-ep-size ranks in every phase (a layout that a CUDA graph
    captured before the scale can keep)."""
    require_nixl_ep()
    extra = ["--fixed-layout"] if layout == "fixed" else []
    port = free_port()
    store = torch.distributed.TCPStore(  # noqa: F841  (the master must outlive the workers)
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    cluster = Cluster(tmp_path, port)
    deadline = time.monotonic() + DEADLINE_S
    try:
        cluster.launch("rank0", "--rank", "0", "--role", "founder", extra=extra)
        cluster.launch("rank1", "--rank", "1", "--role", "founder", extra=extra)
        cluster.launch(
            "rank2a", "--rank", "2", "--role", "joiner", "--tag", "a",
            "--join-phase", "1", "--leave-phase", "2", extra=extra,
        )  # fmt: skip
        cluster.wait(["rank2a"], deadline)
        # The orchestrator starts a replacement only after the removed rank is gone.
        cluster.launch(
            "rank2b", "--rank", "2", "--role", "joiner", "--tag", "b", "--join-phase", "3",
            extra=extra,
        )  # fmt: skip
        cluster.wait(["rank0", "rank1", "rank2b"], deadline)
    finally:
        cluster.kill_all()

    ev = load_events(tmp_path)
    print(f"\nlayout={layout}")
    print("\n".join(f"{e['t']:.3f} rank{e['rank']}{e['tag']} {e['event']}" for e in ev))

    # Every phase was served and checked on every rank that took part in it.
    ok = {(e["rank"], e["tag"], e["phase"], e["label"]) for e in ev if e["event"] == "phase_ok"}
    for r in (0, 1):
        for phase in (0, 1, 2, 3):
            assert (r, "", phase, "serve") in ok, (r, phase)
        assert (r, "", 2, "drain") in ok
        assert (r, "", 1, "serving_while_joiner_loads") in ok
        assert (r, "", 3, "serving_while_joiner_loads") in ok
    assert {(2, "a", 1, "serve"), (2, "a", 2, "drain"), (2, "b", 3, "serve")} <= ok
    # num_experts passed to dispatch: always 4 ranks x 8 (fixed) or 8 x the connected ranks.
    assert all(
        (e["num_experts"] == 32) == (layout == "fixed") for e in ev if e["event"] == "phase_ok"
    )

    for r in (0, 1):
        act1 = first(ev, rank=r, event="activated", phase=1)
        act3 = first(ev, rank=r, event="activated", phase=3)
        drained = first(ev, rank=r, event="drained", phase=2)
        connects = [e for e in ev if e["rank"] == r and e["event"] == "connect_begin"]
        disconnects = [e for e in ev if e["rank"] == r and e["event"] == "disconnect_begin"]
        assert [c["ranks"] for c in connects] == [[0, 1], [2], [2]]
        assert [d["ranks"] for d in disconnects] == [[2]]
        c1, c3, d2 = connects[1], connects[2], disconnects[0]
        # connect only after activation, disconnect only after the drain ...
        assert c1["t"] > act1["activated_at"] and c3["t"] > act3["activated_at"]
        assert d2["t"] > drained["t"]
        # ... and the buffer was untouched while the joiner loaded (it served at 2 meanwhile).
        loads = first(ev, rank=r, event="phase_ok", phase=3, label="serving_while_joiner_loads")
        assert d2["t"] < loads["t"] < c3["t"]
        # the same rank id was reconnected only after the grace period
        assert c3["t"] - first(ev, rank=r, event="disconnect_end")["t"] >= GRACE_S - 0.05
        applied = first(ev, rank=r, event="applied")["steps"]
        assert applied == [["connect", [0, 1]], ["connect", [2]], ["disconnect", [2]],
                           ["connect", [2]]]  # fmt: skip
    for tag, phase in (("a", 1), ("b", 3)):
        act = first(ev, rank=2, tag=tag, event="activated", phase=phase)
        conn = first(ev, rank=2, tag=tag, event="connect_begin")
        assert conn["ranks"] == [0, 1, 2] and conn["t"] > act["activated_at"]
    assert first(ev, rank=2, tag="a", event="removed")
    assert not [e for e in ev if e["rank"] == 2 and e["event"] == "disconnect_begin"]


def test_a_middle_rank_is_replaced_while_the_rank_above_it_serves(tmp_path: Path,
                                                                  cuda: None) -> None:
    """The plan ``[[0,1,2],[0,-1,2],[0,1,2]]``: rank 1 is killed (SIGKILL) after serving at 3,
    a new process takes rank 1, and ranks 0 and 2 replace it (disconnect, then connect rank 1
    alone). Rank 2 stays connected throughout: the dispatch spans every rank up to the highest
    connected one. ``nixl_ep`` documents that disconnected ranks "must be at the end of the
    current remote_ranks list": on rank 0, rank 1 is not."""
    require_nixl_ep()
    port = free_port()
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    cluster = Cluster(tmp_path, port)
    deadline = time.monotonic() + DEADLINE_S
    try:
        for rank, tag in ((0, ""), (1, "a"), (2, "")):
            cluster.launch(f"rank{rank}{tag}", "--rank", str(rank), "--role", "member",
                           "--tag", tag)
        store.wait(["eep/p0/end/done"], timedelta(seconds=max(1.0, deadline - time.monotonic())))
        victim = cluster.procs["rank1a"]
        os.killpg(victim.pid, signal.SIGKILL)  # the group we started for this worker
        assert victim.wait(timeout=30) == -signal.SIGKILL
        cluster.launch("rank1b", "--rank", "1", "--role", "replacement", "--tag", "b")
        cluster.wait(["rank0", "rank2", "rank1b"], deadline)
    finally:
        cluster.kill_all()

    ev = load_events(tmp_path)
    print("\n".join(f"{e['t']:.3f} rank{e['rank']}{e['tag']} {e['event']} "
                    f"{e.get('ranks', '')}" for e in ev))
    ok = {(e["rank"], e["tag"], e["phase"]) for e in ev if e["event"] == "phase_ok"}
    assert {(0, "", 0), (1, "a", 0), (2, "", 0), (0, "", 1), (2, "", 1), (1, "b", 1)} <= ok
    for r in (0, 2):
        applied = first(ev, rank=r, event="applied")["steps"]
        assert applied == [["connect", [0, 1, 2]], ["disconnect", [1]], ["connect", [1]]]
        assert all(e["ranks"] == [0, 1, 2] for e in ev
                   if e["rank"] == r and e["event"] == "phase_ok")
    assert first(ev, rank=1, tag="b", event="applied")["steps"] == [["connect", [0, 1, 2]]]

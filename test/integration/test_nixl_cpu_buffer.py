"""The CPU EP buffer (``backends/nixl_cpu``) on real NIXL transfers between processes.

Multi-process tests are driven by phase plans, as data, like NIXL EP's elastic suite: each
phase lists the active ranks, ``-r`` means rank ``r`` is killed during the phase. Every rank is
its own process (``nixl_cpu_workers.py``), rendezvous is a TCPStore on a free port, and the
membership changes go through the plugin's ``NixlMembership``. In every phase each surviving
rank's dispatch + experts + combine must equal a dense single-process reference computed here;
dispatched rows and counts must equal what the phase's routing implies, bit for bit.

Light on purpose (2 shared cores): at most 3 ranks alive at once. Every process is tracked by
pid and killed by pid in teardown, also on failure.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import nixl_cpu_workers as W  # noqa: E402

from sglang_elastic_ep_testbed.nixl_cpu import fp8 as fp8_mod  # noqa: E402
from sglang_elastic_ep_testbed.nixl_cpu.layout import (  # noqa: E402
    RegionLayout,
    max_rows_per_message,
    message_bytes,
    rdma_size_hint,
)
from sglang_elastic_ep_testbed.nixl_cpu.moe_runner import (  # noqa: E402
    dense_moe_reference,
    run_packed_experts,
)

pytest.importorskip("nixl._api")

WORKER = Path(__file__).parent / "nixl_cpu_workers.py"
SITE = Path(inspect.getfile(torch)).parent.parent


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The reference math is tiny; with the ranks (and anything else) on 2 shared cores,
    torch's OpenMP threads spin against them and made the checks ~50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- process driver


class Cluster:
    """Spawns rank processes against one TCPStore; kills every one of them by pid on close."""

    def __init__(self, logdir: Path, plan: list[list[int]], timeout_ms: int) -> None:
        from torch.distributed import TCPStore

        self.logdir = logdir
        self.plan = plan
        self.timeout_ms = timeout_ms
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=60),
        )
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        self.env: dict[str, str] = {}

    def spawn(self, rank: int, phase: int, *extra: str) -> subprocess.Popen[bytes]:
        log = self.logdir / f"rank{rank}_phase{phase}.log"
        self.logs.append(log)
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [
                    sys.executable, str(WORKER), "--port", str(self.store.port),
                    "--rank", str(rank), "--start-phase", str(phase),
                    "--plan", json.dumps(self.plan), "--incarnation", f"{rank}.{phase}",
                    "--timeout-ms", str(self.timeout_ms), *extra,
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        self.procs.append(proc)
        return proc

    def get(self, key: str, timeout_s: float = 60) -> Any:
        self.store.wait([key], timedelta(seconds=timeout_s))
        return pickle.loads(self.store.get(key))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def log_tails(self) -> str:
        out = []
        for log in self.logs:
            lines = [ln for ln in log.read_text(errors="replace").splitlines()
                     if "NIXL INFO" not in ln]
            out.append(f"--- {log.name}\n" + "\n".join(lines[-15:]))
        return "\n".join(out)


@pytest.fixture
def cluster_factory(tmp_path: Path):
    """Clusters made in a test; teardown kills every process by pid (pytest shows the printed
    log tails only when the test failed)."""
    made: list[Cluster] = []

    def make(plan: list[list[int]], timeout_ms: int = 3000) -> Cluster:
        c = Cluster(tmp_path, plan, timeout_ms)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
            print(c.log_tails())


def run_plan(
    cluster: Cluster, victim_signal: int = signal.SIGKILL
) -> tuple[list[dict[int, dict[str, Any]]], dict[int, list[int]]]:
    """Run the cluster's plan: spawn the ranks each phase needs, signal victims once they have
    dispatched, collect the survivors' reports. Returns (reports per phase, pids per rank)."""
    alive: dict[int, subprocess.Popen[bytes]] = {}
    pids: dict[int, list[int]] = {}
    reports: list[dict[int, dict[str, Any]]] = []
    t0 = time.monotonic()

    def note(what: str) -> None:  # shown by pytest when a test fails
        print(f"[{time.monotonic() - t0:6.2f}s] {what}", flush=True)

    for i, phase in enumerate(cluster.plan):
        note(f"phase {i}: {phase}")
        size = W.ep_size_of(phase)
        for r in range(size):
            if r not in alive:
                alive[r] = cluster.spawn(r, i)
                pids.setdefault(r, []).append(alive[r].pid)
        victims = sorted(-r for r in phase if r < 0)
        for v in victims:
            cluster.store.wait([W.store_key("victim", i, v)], timedelta(seconds=60))
            os.kill(alive[v].pid, victim_signal)
            note(f"phase {i}: signalled rank {v}")
        survivors = [r for r in range(size) if r not in victims]
        reports.append({r: cluster.get(W.store_key("res", i, r)) for r in survivors})
        note(f"phase {i}: reports from {survivors}")
        for v in victims:
            os.kill(alive[v].pid, signal.SIGKILL)
            alive.pop(v).wait(timeout=10)
        for r in [r for r in alive if r >= size]:  # scaled away: leaves on its own
            assert alive[r].wait(timeout=30) == 0, f"departing rank {r} failed"
            assert cluster.store.check([W.store_key("left", i, r)])
            del alive[r]
    for r, proc in alive.items():
        assert proc.wait(timeout=30) == 0, f"rank {r} exited with {proc.returncode}"
        note(f"rank {r} exited")
    return reports, pids


# ----------------------------------------------------------------------------- expectations


def expected_rows(phase: int, rank: int, size: int, sources: list[int], variant: str):
    """Rows (and per-local-expert counts) ``rank`` must receive: expert-major, then source rank,
    then token order."""
    rows, counts = [], []
    for e in range(W.LOCAL_EXPERTS):
        n = 0
        for s in sources:
            x, ids, _ = W.phase_inputs(phase, s, size, variant)
            tok = (ids == rank * W.LOCAL_EXPERTS + e).any(dim=1).nonzero().squeeze(1)
            if W.VARIANTS[variant][2]:
                q, sc = fp8_mod.quantize(x[tok])
                rows.append(q.view(torch.uint8))
            else:
                rows.append(x[tok])
            n += tok.numel()
        counts.append(n)
    return torch.cat(rows), counts


def reference_out(phase: int, rank: int, size: int, variant: str, dropped_ranks: list[int]):
    hidden, dtype, use_fp8, _ = W.VARIANTS[variant]
    x, ids, weights = W.phase_inputs(phase, rank, size, variant)
    w13, w2 = W.expert_weights(hidden)
    if use_fp8:
        q, sc = fp8_mod.quantize(x)
        x_in = fp8_mod.dequantize(q, sc, torch.float32)
    else:
        x_in, w13, w2 = x, w13.to(dtype), w2.to(dtype)
    dropped = [r * W.LOCAL_EXPERTS + e for r in dropped_ranks for e in range(W.LOCAL_EXPERTS)]
    return dense_moe_reference(x_in, ids, weights, w13, w2, dropped_experts=dropped).to(dtype)


TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 2e-2), "fp8": (2e-2, 2e-2)}


def check_phase(i: int, phase: list[int], reports: dict[int, dict[str, Any]]) -> None:
    size = W.ep_size_of(phase)
    victims = sorted(-r for r in phase if r < 0)
    survivors = [r for r in range(size) if r not in victims]
    assert sorted(reports) == survivors
    for r, rep in reports.items():
        assert rep["connected_ep_size"] == size, (i, r)
        for v in victims:
            assert rep["mask"][v] == 1, f"phase {i}: rank {r} did not mask killed rank {v}"
        for s in survivors:
            assert rep["mask"][s] == 0, f"phase {i}: rank {r} masks live rank {s}: {rep}"
        assert rep["mask"][size:] == [1] * (W.MAX_RANKS - size), (i, r, rep["mask"])
        for variant in [v for v in W.VARIANTS if v in rep]:
            got = rep[variant]
            ref = reference_out(i, r, size, variant, victims)
            atol, rtol = TOLERANCE[variant]
            assert got["out"].dtype == ref.dtype
            where = f"phase {i} rank {r} {variant}"
            torch.testing.assert_close(got["out"], ref, atol=atol, rtol=rtol,
                                       msg=lambda m, where=where: f"{where}: {m}")
            if victims:
                continue  # the victim's tokens may or may not have arrived before it died
            rows, counts = expected_rows(i, r, size, survivors, variant)
            assert got["counts"] == counts, (i, r, variant)
            assert torch.equal(got["rows"], rows), f"phase {i} rank {r} {variant}: packed rows"


# ----------------------------------------------------------------------------- multi-process


# Scale 2 -> 3 -> 2 -> 3 (the departed rank's slot taken by a new process), then rank 2 is
# SIGKILLed mid-phase, disconnected, and its slot taken by yet another process.
ELASTIC_PLAN = [[0, 1], [0, 1, 2], [0, 1], [0, 1, 2], [0, 1, -2], [0, 1], [0, 1, 2]]


@pytest.mark.timeout(150)
def test_elastic_plan_matches_dense_reference(cluster_factory) -> None:
    timeout_ms = 4000
    plan = ELASTIC_PLAN
    cluster = cluster_factory(plan, timeout_ms)
    reports, pids = run_plan(cluster)
    for i, phase in enumerate(plan):
        check_phase(i, phase, reports[i])

    # Rank 2 was three different processes (joined, left gracefully, new one killed, new one);
    # the founders never restarted and always talk to the current agent of rank 2.
    assert len(set(pids[2])) == 3
    agents = [reports[i][2]["agent"] for i in (1, 3, 6)]
    assert len(set(agents)) == 3
    for r in (0, 1):
        assert pids[r] == [reports[6][r]["pid"]]
        assert reports[1][r]["peers"][2] == agents[0]
        assert 2 not in reports[2][r]["peers"] and 2 not in reports[5][r]["peers"]
        assert reports[3][r]["peers"][2] == agents[1]
        assert reports[6][r]["peers"][2] == agents[2]

    # The kill: survivors masked rank 2 because NIXL reported the disconnect (a mask by the
    # timeout says "timeout"; no time limit needed to tell them apart) and finished the phase
    # (outputs checked above without rank 2's experts).
    for r in (0, 1):
        rep = reports[4][r]
        assert "NIXL_ERR_REMOTE_DISCONNECT" in rep["reasons"][2], rep["reasons"]


@pytest.mark.timeout(90)
def test_silent_rank_is_masked_after_timeout(cluster_factory) -> None:
    """A rank that stops answering (SIGSTOP: alive, connection open) is masked when the
    timeout expires instead of hanging the caller."""
    timeout_ms = 1500
    plan = [[0, 1], [0, -1]]
    cluster = cluster_factory(plan, timeout_ms)
    reports, _ = run_plan(cluster, victim_signal=signal.SIGSTOP)
    for i, phase in enumerate(plan):
        check_phase(i, phase, reports[i])
    rep = reports[1][0]
    assert rep["reasons"][1].startswith("timeout"), rep["reasons"]
    # It waited the timeout out (no upper limit: that it returned at all is the point).
    assert rep["fp32"]["elapsed_s"] >= 0.9 * timeout_ms / 1000, rep["fp32"]["elapsed_s"]


def test_joiner_dying_in_its_first_handshake_does_not_hang_the_others(cluster_factory) -> None:
    """Rank 1 joins (phase 1), publishes its handshake key and is killed before it answers:
    rank 0's connect gives up on it once its agent refuses writes (instead of waiting out the
    connect timeout inside a forward pass), masks it, and serves on."""
    gone_s = 2.0
    plan = [[0], [0, 1]]
    cluster = cluster_factory(plan)
    cluster.env["SGLANG_EEP_NIXL_CPU_PEER_GONE_S"] = str(gone_s)
    rank0 = cluster.spawn(0, 0)
    assert cluster.get(W.store_key("res", 0, 0))["fp32"]["counts"] is not None
    joiner = cluster.spawn(1, 1, "--die-in-connect")
    cluster.store.wait([W.store_key("victim", 1, 1)], timedelta(seconds=60))
    os.kill(joiner.pid, signal.SIGKILL)
    joiner.wait(timeout=10)
    report = cluster.get(W.store_key("res", 1, 0))
    assert report["mask"][1] == 1, report["mask"]
    # Killed after publishing its key: rank 0 either loaded its agent and then had its writes
    # refused (masked with this reason), or could not load it at all (never connected).
    reason = report["reasons"].get(1)
    assert reason is None or "refused the handshake" in reason, report["reasons"]
    # A connect that waits out its timeout (40 s) raises: no report. So a report means rank 0
    # gave up on the refusals, with no time limit to check.
    x, ids, _ = W.phase_inputs(1, 0, 2, "fp32")
    assert report["fp32"]["out"].shape == x.shape
    assert rank0.wait(timeout=30) == 0


def test_a_joiner_hung_in_its_first_handshake_is_given_up_once_the_membership_counts_it_out(
        cluster_factory) -> None:
    """Rank 1 joins, publishes its handshake key and is stopped (SIGSTOP: alive to NIXL, never
    answering), as a joiner that hung right after its admission: rank 0's connect gives up on it
    once the membership counts it out (Mooncake's WORLD on a server), instead of waiting out
    the connect timeout and raising, masks it, and serves on."""
    plan = [[0], [0, 1]]
    cluster = cluster_factory(plan)
    rank0 = cluster.spawn(0, 0, "--membership-in-store")
    assert cluster.get(W.store_key("res", 0, 0))["fp32"]["counts"] is not None
    joiner = cluster.spawn(1, 1, "--die-in-connect")
    try:
        cluster.store.wait([W.store_key("victim", 1, 1)], timedelta(seconds=60))
        os.kill(joiner.pid, signal.SIGSTOP)
        cluster.store.set(W.store_key("out", 1), b"1")
        report = cluster.get(W.store_key("res", 1, 0))
    finally:
        os.kill(joiner.pid, signal.SIGKILL)
        joiner.wait(timeout=10)
    assert report["mask"][1] == 1, report["mask"]
    # A connect that waits out its timeout (40 s) raises: no report. A stopped agent takes
    # writes, so nothing but the membership ends the wait.
    assert "left the membership" in report["reasons"][1], report["reasons"]
    x, _, _ = W.phase_inputs(1, 0, 2, "fp32")
    assert report["fp32"]["out"].shape == x.shape
    assert rank0.wait(timeout=30) == 0


# ----------------------------------------------------------------------------- single process


@pytest.fixture
def solo_buffer():
    from sglang_elastic_ep_testbed.nixl_cpu import Buffer

    buf = Buffer(rank=0, timeout_ms=500)
    buf.update_memory_buffers(
        num_ranks=W.MAX_RANKS,
        num_experts_per_rank=W.LOCAL_EXPERTS,
        num_rdma_bytes=Buffer.get_rdma_size_hint(W.MAX_TOKENS, 128, W.MAX_RANKS, 16),
    )
    yield buf
    buf.destroy()


def test_single_rank_round_trip_and_mask_semantics(solo_buffer) -> None:
    buf = solo_buffer
    assert buf.group_size == W.MAX_RANKS
    mask = torch.full((W.MAX_RANKS,), 7, dtype=torch.int32)
    buf.query_mask_buffer(mask)
    assert mask.tolist() == [0, 1, 1, 1]  # self live, unconnected ranks masked
    with pytest.raises(ValueError):
        buf.update_mask_buffer(0, True)  # the local rank cannot be masked
    with pytest.raises(ValueError):
        buf.update_mask_buffer(2, False)  # unmasking needs a connection

    # Only this rank's experts exist (num_experts = 1 rank's worth): the local path.
    x, ids, weights = W.phase_inputs(0, 0, 1)
    w13, w2 = W.expert_weights()
    recv, count, handle, event, hook = buf.dispatch(
        x, ids, W.MAX_TOKENS, W.LOCAL_EXPERTS, use_fp8=False, async_finish=True,
        return_recv_hook=False, round_scale=False, use_ue8m0=False,
    )
    event.current_stream_wait()
    hook()
    assert recv.shape == (W.LOCAL_EXPERTS, W.MAX_TOKENS, W.HIDDEN)
    assert int(count.sum()) == int((ids >= 0).sum())
    out_e = run_packed_experts(recv, count, w13[: W.LOCAL_EXPERTS], w2[: W.LOCAL_EXPERTS])
    out, event, hook = buf.combine(x=out_e, topk_idx=ids, topk_weights=weights, handle=handle,
                                   async_finish=False, return_recv_hook=True)
    hook()
    torch.testing.assert_close(out, dense_moe_reference(x, ids, weights, w13, w2))
    # nixl_ep-compatible handle views
    assert handle.layout_range.shape == (W.LOCAL_EXPERTS, 1)
    assert (handle.layout_range & 0xFFFFFFFF).squeeze(1).tolist() == count.tolist()

    # No tokens at all (an idle DP rank, a joiner's first batch), in every dtype path.
    for use_fp8, hidden, dtype in ((False, 64, torch.float32), (True, 128, torch.bfloat16)):
        empty = torch.empty(0, hidden, dtype=dtype)
        no_ids = torch.empty(0, 2, dtype=torch.int64)
        recv, count, handle, _, _ = buf.dispatch(empty, no_ids, W.MAX_TOKENS, W.LOCAL_EXPERTS,
                                                 use_fp8=use_fp8)
        assert count.tolist() == [0] * W.LOCAL_EXPERTS
        q = recv[0].float() if use_fp8 else recv
        out, _, _ = buf.combine(x=q, topk_idx=no_ids, topk_weights=torch.empty(0, 2),
                                handle=handle)
        assert out.shape == (0, hidden) and out.dtype == dtype


def test_refusals_are_clear(solo_buffer) -> None:
    x, ids, _ = W.phase_inputs(0, 0, 1)  # hidden 64: no per-128 scales
    with pytest.raises(ValueError, match="SGLANG_NIXL_EP_BF16_DISPATCH"):
        solo_buffer.dispatch(x, ids, W.MAX_TOKENS, W.LOCAL_EXPERTS, use_fp8=True)
    x128 = torch.randn(x.shape[0], 128)
    with pytest.raises(NotImplementedError, match="ue8m0"):
        solo_buffer.dispatch(x128, ids, W.MAX_TOKENS, W.LOCAL_EXPERTS, use_fp8=True,
                             round_scale=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="same expert twice"):
        solo_buffer.dispatch(x[:2], torch.tensor([[1, 1], [0, 2]]), W.MAX_TOKENS,
                             W.LOCAL_EXPERTS, use_fp8=False)
    with pytest.raises(ValueError, match="exceed"):
        solo_buffer.dispatch(torch.randn(W.MAX_TOKENS + 1, 64),
                             torch.zeros(W.MAX_TOKENS + 1, 2, dtype=torch.int64),
                             W.MAX_TOKENS, W.LOCAL_EXPERTS, use_fp8=False)


class _DictStore:
    """The three TCPStore calls ``connect_ranks`` makes, on a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


class _WaitEnded(Exception):
    pass


class _RecordingParker:
    """Records the calls; ends the wait (raises) at the third renewal."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def keep_parked(self) -> None:
        self.calls.append("keep_parked")
        if self.calls.count("keep_parked") == 3:
            raise _WaitEnded

    def unpark(self) -> None:
        self.calls.append("unpark")


def test_a_connect_keeps_the_spinners_parked_while_it_waits_and_releases_them(
        solo_buffer) -> None:
    """Rank 1 never answers: the handshake renews the park on every round of its wait and
    releases it once, however the wait ends (here by an error out of the wait)."""
    parker = _RecordingParker()
    solo_buffer.handshake_wait_parker = parker
    solo_buffer.set_tcp_store_group(_DictStore())
    with pytest.raises(_WaitEnded):
        solo_buffer.connect_ranks([1])
    assert parker.calls == ["keep_parked"] * 3 + ["unpark"], parker.calls


def test_the_cpu_engine_buffer_parks_the_process_spinners_in_its_connect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep_testbed.cpu import idle
    from sglang_elastic_ep_testbed.cpu.nixl_ep import load_nixl_ep
    from sglang_elastic_ep_testbed.cpu.scheduler_buffer import SchedulerBuffer

    buffer_class, _ = load_nixl_ep()
    assert buffer_class is SchedulerBuffer
    parking = SchedulerBuffer(rank=0, timeout_ms=500)
    try:
        assert parking.handshake_wait_parker is idle.process_thread_parker()
    finally:
        parking.destroy()
    monkeypatch.setenv(idle.ENV_PARK_SPINNERS_IN_CONNECT, "0")
    not_parking = SchedulerBuffer(rank=0, timeout_ms=500)
    try:
        assert not_parking.handshake_wait_parker is None
    finally:
        not_parking.destroy()


def test_layout_is_sized_for_the_maximum() -> None:
    t, h, ranks, experts = 128, 64, 4, 16
    nbytes = rdma_size_hint(t, h, ranks, experts)
    layout = RegionLayout(ranks, experts // ranks, nbytes)
    worst = message_bytes(max_rows_per_message(t, experts // ranks), 4 * h, experts // ranks, True)
    assert worst <= layout.slot_bytes
    starts = sorted(
        f(r) for f in (layout.dispatch_recv, layout.combine_recv, layout.dispatch_send,
                       layout.combine_send) for r in range(ranks)
    )
    assert starts[0] >= layout.ctrl_bytes
    assert all(b - a >= layout.slot_bytes for a, b in zip(starts, starts[1:], strict=False))
    assert starts[-1] + layout.slot_bytes <= nbytes
    with pytest.raises(RuntimeError, match="get_rdma_size_hint"):
        layout.check_fits(layout.slot_bytes + 1, "too big")


def _sglang_calls() -> tuple[set[str], set[str]]:
    """Methods SGLang 0.5.23's nixl.py calls on a buffer instance and on the Buffer class."""
    path = SITE / "sglang" / "srt" / "layers" / "moe" / "token_dispatcher" / "nixl.py"
    tree = ast.parse(path.read_text())
    inst, cls = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr == "buffer":
                inst.add(node.func.attr)
            if isinstance(owner, ast.Name) and owner.id == "buffer":
                inst.add(node.func.attr)
            if isinstance(owner, ast.Name) and owner.id == "Buffer":
                cls.add(node.func.attr)
    return inst, cls


def test_interface_covers_sglang_and_nixl_ep() -> None:
    from sglang_elastic_ep_testbed.nixl_cpu import Buffer, load_nixl_ep

    if not (SITE / "sglang").exists():
        pytest.skip("sglang not installed")
    inst, cls = _sglang_calls()
    assert {"dispatch", "combine", "connect_ranks", "set_tcp_store_group",
            "query_mask_buffer", "clean_buffer"} <= inst
    assert "get_rdma_size_hint" in cls
    for name in inst | cls:
        assert callable(getattr(Buffer, name)), name
    assert load_nixl_ep() == (Buffer, torch.int64)

    # nixl_ep's own signatures: every parameter, in order, for the methods both have.
    nixl_ep_src = SITE / "nixl_ep_cu12" / "buffer.py"
    if not nixl_ep_src.exists():
        pytest.skip("nixl_ep sources not installed")
    tree = ast.parse(nixl_ep_src.read_text())
    cls_node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Buffer")
    for fn in cls_node.body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in {
            "__init__", "low_latency_dispatch", "low_latency_combine", "connect_ranks",
            "disconnect_ranks", "update_memory_buffers", "update_mask_buffer",
            "query_mask_buffer", "clean_mask_buffer", "set_tcp_store_group",
            "get_rdma_size_hint", "get_low_latency_buffer_size_hint", "barrier", "destroy",
        }:
            continue
        theirs = [a.arg for a in fn.args.args]
        ours = list(inspect.signature(getattr(Buffer, fn.name)).parameters)
        if theirs and theirs[0] == "self":
            theirs = theirs[1:]
        if ours and ours[0] == "self":
            ours = ours[1:]
        assert ours[: len(theirs)] == theirs, (fn.name, ours, theirs)


MOE_NATIVE_CHECK = r"""
import sys, torch
from types import SimpleNamespace
torch.set_num_threads(1)
from sglang_elastic_ep_testbed import hooks
for shim in hooks.IMPORT_SHIMS:
    shim.install()
from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
from sglang.srt.layers.moe.topk import StandardTopKOutput
from sglang_elastic_ep_testbed.nixl_cpu.moe_runner import run_packed_experts, dense_moe_reference
g = torch.Generator().manual_seed(0)
E, H, I, N, K = 4, 64, 32, 24, 2
w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
w2 = torch.randn(E, H, I, generator=g) * 0.2
x = torch.randn(N, H, generator=g)
ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
w = torch.rand(N, K, generator=g)
layer = SimpleNamespace(num_experts=E, w13_weight=w13, w2_weight=w2)
ref = moe_forward_native(layer, x, StandardTopKOutput(w, ids, None), MoeRunnerConfig())
# packed layout: rows per expert in token order, then weighted sum back
M = N
packed = torch.zeros(E, M, H); count = torch.zeros(E, dtype=torch.int32); where = []
for e in range(E):
    tok, slot = (ids == e).nonzero(as_tuple=True)
    packed[e, : tok.numel()] = x[tok]; count[e] = tok.numel(); where.append((tok, slot))
out_e = run_packed_experts(packed, count, w13, w2)
assert torch.count_nonzero(out_e[0, int(count[0]):]) == 0
out = torch.zeros(N, H)
for e, (tok, slot) in enumerate(where):
    out.index_add_(0, tok, out_e[e, : tok.numel()] * w[tok, slot].unsqueeze(1))
err1 = (out - ref).abs().max().item()
err2 = (dense_moe_reference(x, ids, w, w13, w2) - ref).abs().max().item()
print("ERR", err1, err2)
sys.exit(0 if max(err1, err2) < 1e-5 else 1)
"""


@pytest.mark.timeout(60)
def test_moe_runner_matches_sglang_moe_forward_native() -> None:
    """The packed-layout runner and the dense reference equal upstream's native MoE (in a
    subprocess: importing SGLang on CPU installs the plugin's import shims)."""
    if not (SITE / "sglang").exists():
        pytest.skip("sglang not installed")
    res = subprocess.run([sys.executable, "-c", MOE_NATIVE_CHECK], capture_output=True,
                         text=True, timeout=55)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "ERR" in res.stdout


def test_fp8_round_trip_accuracy() -> None:
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    q, s = fp8_mod.quantize(x, round_scale=True)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 2)
    assert torch.equal(torch.log2(s), torch.round(torch.log2(s)))  # powers of two
    back = fp8_mod.dequantize(q, s, torch.float32)
    assert (back - x.float()).abs().max() <= 0.07 * x.float().abs().max()


def test_the_progress_thread_sleeps_instead_of_spinning() -> None:
    """NIXL's Python API hard-codes a busy progress thread; ours waits on UCX's descriptors."""
    code = (
        "from sglang_elastic_ep_testbed.nixl_cpu._env import configure_ucx_env\n"
        "configure_ucx_env()\n"
        "from sglang_elastic_ep_testbed.nixl_cpu.buffer import make_nixl_agent\n"
        "from sglang_elastic_ep_testbed.cpu.idle import find_spinning_native_threads\n"
        "import os\n"
        "before = set(os.listdir('/proc/self/task'))\n"
        "agent = make_nixl_agent('spin-check', progress_thread=True)\n"
        "new = set(os.listdir('/proc/self/task')) - before\n"
        "assert new, 'no progress thread started'\n"
        "spinning = set(map(str, find_spinning_native_threads(window_s=0.5, min_share=0.2)))\n"
        "print('NEW', sorted(new), 'SPINNING', sorted(spinning & new))\n"
        "assert not spinning & new\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

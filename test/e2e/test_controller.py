"""``sglang-eep controller`` runs a CPU cluster by itself (local launcher, no human action).

A 2-rank server (NIXL EP, ``--max-ep-size 3``) and a controller allowed 2..3 ranks, launching
joiners from a command template. A load client starts: the controller posts a scale-up and
launches the joiner for rank 2, and the cluster serves on three shards. The joiner's scheduler
then stops in its pass while its process lives on (``cpu/fault_injection.py``): every rank
waits for it and serving stalls. Once the status has said ``stalled`` for
``--heal-stall-after``, the controller ends the joiner and relaunches it in recover mode, and
the cluster is back at full size. The load stops: the controller shrinks back to 2 and the
joiner exits 0. Throughout, no request fails except those the stall held when the rank ended
(503 with a message), and every completed request decoded the reference tokens.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from sglang_elastic_ep_testbed.cluster import ClusterSpec, LoadClient, LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import (
    JOINER_PORT_DELTA,
    ServerProcess,
    server_env,
)
from sglang_elastic_ep_testbed.cluster.load import (
    DEFAULT_PROMPTS,
    generate,
    greedy_reference,
    most_lost_to_a_kill,
)
from sglang_elastic_ep_testbed.cluster.observe import (
    operation_events,
    sse_events,
    wait_each_shard_serves,
    wait_rank_state,
    wait_status,
)
from sglang_elastic_ep_testbed.cluster.procs import kill_tree
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cpu.fault_injection import ENV_STALL_S

JOINED_S = 600  # load seen, POST, the joiner started beside two busy ranks, committed
RECOVERED_S = 600
SHRUNK_S = 240
SERVES_S = 180
FAULT_SEEN_S = 90
LOAD_CLIENTS = 6
STALL_TIMEOUT_S = 10  # the server reports the stall
HEAL_STALL_AFTER_S = 15  # the controller ends the stuck joiner
KILL_GRACE_S = 30
# From the stall to the stuck joiner's end: reported, then healed (a stuck rank is killed at
# once, without the grace).
STALL_ENDED_S = STALL_TIMEOUT_S + HEAL_STALL_AFTER_S + 15


class ControllerProcess:
    """The controller as its own process, its JSON decision log in a file; stopped by pid."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "sglang_elastic_ep.cli.main", "controller", "--json", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def records(self) -> list[dict]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                found.append(record)
        return found

    def wait_record(self, accept, what: str, timeout_s: float,
                    server: Callable[[], str] | None = None) -> dict:
        """The first record ``accept`` takes. On a timeout the error shows ``server()`` (what
        the server says now) first, then the controller's last records, kept short: CI shows
        only part of a long failure."""
        def probe() -> dict | None:
            assert self.popen.poll() is None, f"the controller exited: {self.tail()}"
            return next((r for r in self.records() if accept(r)), None)

        def describe() -> str:
            return (f"{server()}\n" if server is not None else "") + self.tail()

        return wait_until(probe, timeout_s, what, poll_s=1.0, describe=describe)

    def tail(self, lines: int = 12) -> str:
        """The last records: time, type and message only."""
        return "\n".join(f"{r.get('time')} {r.get('type')}: {str(r.get('message'))[:200]}"
                         for r in self.records()[-lines:])

    def stop(self) -> int:
        """SIGTERM, as an operator would; the exit code (SIGKILL after 30 s)."""
        try:
            self.popen.terminate()
            return self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.popen.pid, hard=True)
            return self.popen.wait(timeout=30)
        finally:
            self._log.close()


def server_now(cluster: LocalCluster) -> str:
    """The status's ranks and operation, then each survivor's last log events, briefly."""
    try:
        now = httpx.get(cluster.url + "/elastic_ep/status", timeout=10).json()
        said = (f"status: size {now['effective_ep_size']}, ranks "
                f"{[r['state'] for r in now['ranks']]}, operation {now['current_operation']}")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        said = f"status unreadable: {exc!r}"
    logs = [f"--- {server.log_path.name}:\n{server.log_events(8)}"
            for server in (cluster.primary, *cluster.followers.values()) if server is not None]
    return "\n".join([said, *logs])


def result_for(message_start: str, rank: int):
    """A launcher outcome record (``launched``/``relaunched``) for ``rank``."""
    def accept(record: dict) -> bool:
        message = record.get("message", "")
        return (record.get("type") == "result" and record.get("ok") is True
                and message.startswith(message_start) and f"rank(s) {rank}" in message)

    return accept


@pytest.mark.timeout(2400)
def test_the_controller_grows_heals_and_shrinks_a_cluster_by_itself(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = ClusterSpec(
        tiny_model, ep_size=2, max_ep_size=3, moe_a2a_backend="nixl",
        # Every expert on every launch-time rank: outputs stay identical while rank 2 is down.
        extra_args=["--ep-num-redundant-experts", "16", "--enable-metrics",
                    "--elastic-ep-stall-timeout", str(STALL_TIMEOUT_S)],
    )
    deployment = f"e2e-{uuid.uuid4().hex[:8]}"
    joiner_logs = tmp_path / "joiners"
    with LocalCluster(spec) as cluster:
        url = cluster.url
        reference = greedy_reference(url)
        # The joiner's command, as an operator would write it: the testbed's joiner arguments
        # with the controller's placeholders. Its HTTP port is --port-base + 2, kept free with
        # the ports SGLang derives from it.
        joiner_port = cluster._take_port(derived_offset=JOINER_PORT_DELTA)
        template = shlex.join([sys.executable, "-m", "sglang.launch_server",
                               *cluster.joiner_args("{join_mode}", "{rank_offset}",
                                                    "{num_ranks}", "{port}")])
        controller = ControllerProcess(
            ["--url", url, "--min-size", "2", "--max-size", "3", "--launch-size", "2",
             # Six clients, back to back: SGLang's gauges (sampled at each prefill) read about
             # 2 requests per rank at 2 ranks and 1 at 3: hot, then inside the band. With
             # fewer clients a rank's gauge reads 0 most of the time under load (the request
             # being prefilled is not counted yet), which is "cold". No load at all is cold
             # for the whole window.
             "--scale-up-load", "0.5", "--scale-down-load", "0.1", "--no-kv",
             "--up-window", "0", "--down-window", "30", "--cooldown", "5",
             "--poll-interval", "1", "--heal-retry", "5", "--max-relaunches", "2",
             "--heal-stall-after", str(HEAL_STALL_AFTER_S),
             "--deployment", deployment, "--launcher", "local", "--command", template,
             "--dist-init-addr", f"127.0.0.1:{cluster.dist_port}",
             "--port-base", str(joiner_port - 2), "--log-dir", str(joiner_logs),
             "--kill-grace", str(KILL_GRACE_S)],
            # The joiners inherit it: the CPU settings, the cluster's store port and tag (its
            # teardown finds them), rank 2's core, and a stall on SIGUSR1 that outlasts the
            # scenario.
            env={**os.environ, **server_env(cluster.env, first_rank=2, ranks=1),
                 ENV_STALL_S: "3600"},
            log_path=tmp_path / "controller.log",
        )
        try:
            load = LoadClient(url, concurrency=LOAD_CLIENTS, max_new_tokens=8).start()
            try:
                # 1. Load: the controller grows 2 -> 3 and launches the joiner itself.
                scale = controller.wait_record(
                    lambda r: r.get("action") == "scale" and r.get("target") == 3,
                    "the controller decides to grow to 3", 120)
                grow_id = scale["operation_id"]
                launched = controller.wait_record(result_for("launched", 2),
                                                  "the controller launches rank 2's joiner", 120)
                grown = wait_rank_state(url, 2, "active", JOINED_S)
                assert grown["effective_ep_size"] == 3, grown
                (scale_log,) = joiner_logs.glob(f"{deployment}-r2-scale-*.log")
                wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={2: scale_log})

                # 2. The joiner's scheduler stops in its pass, its process alive: every rank
                # waits for it. The controller ends it and relaunches it in recover mode.
                stalled_at = time.monotonic()
                (scheduler,) = ServerProcess.scheduler_pids_of(int(launched["handle"])).values()
                psutil.Process(scheduler).send_signal(signal.SIGUSR1)
                relaunched = controller.wait_record(
                    result_for("relaunched", 2), "the controller relaunches rank 2",
                    STALL_ENDED_S + 120, server=lambda: server_now(cluster))
                assert relaunched["handle"] != launched["handle"]
                recovered = wait_rank_state(url, 2, "active", RECOVERED_S)
                assert recovered["effective_ep_size"] == 3, recovered
                # A replacement that fails to start, or dies before it served, is relaunched
                # (up to --max-relaunches): shard 2 serves in one of their logs, and the one
                # that serves is the last relaunched.
                wait_each_shard_serves(load, [0, 1, 2], SERVES_S, logs={
                    2: lambda: joiner_logs.glob(f"{deployment}-r2-recover-*.log")})
                relaunches = [r for r in controller.records() if result_for("relaunched", 2)(r)]
                assert 1 <= len(relaunches) <= 2, relaunches
                relaunched = relaunches[-1]
            finally:
                results = load.stop()

            # 3. Quiet: the controller shrinks back to 2 and the replacement exits 0.
            shrunk = wait_status(
                url, lambda s: s if s["effective_ep_size"] == 2 and s["current_operation"] is None
                else None, SHRUNK_S, "the controller shrinks back to 2")
            assert [r["state"] for r in shrunk["ranks"][:2]] == ["active", "active"], shrunk
            ended = controller.wait_record(
                lambda r: r.get("type") == "result" and r.get("handle") == relaunched["handle"]
                and "exited" in r.get("message", ""), "the replacement exits", 120)
            # Released, it exits 0 by itself, unless the controller read the server's
            # safe_to_terminate first and stopped it (SIGTERM), as it is told it may.
            terminated = [r for r in controller.records() if r.get("type") == "result"
                          and relaunched["handle"] in r.get("handles", [])
                          and r.get("message", "").startswith("terminated")]
            assert ended["exit_code"] == 0 or (terminated and ended["exit_code"] == -15), ended

            lost = [r for r in results if not r.ok]
            for r in lost:  # only what the stall held when rank 2 ended, and said so
                assert r.lost_to_a_fault, r
                assert r.started < stalled_at + STALL_ENDED_S + FAULT_SEEN_S
            assert len(lost) <= most_lost_to_a_kill(LOAD_CLIENTS), \
                f"more requests lost than a kill may cost: {lost}"
            changed = [r for r in results if r.ok and r.output_ids != reference[r.prompt]]
            assert not changed, f"outputs changed: {changed[:3]}"
            with httpx.Client() as client:
                after = {p: generate(client, url, p, 8) for p in DEFAULT_PROMPTS}
            assert {p: r.output_ids for p, r in after.items()} == reference

            # Every operation was the controller's, each with its own id, in order.
            records = controller.records()
            shrink = next(r for r in records if r.get("action") == "scale" and r["target"] == 2)
            ops = operation_events(sse_events(url))
            assert ops[grow_id][0] == "scale_requested" and "scale_committed" in ops[grow_id]
            assert ops[shrink["operation_id"]][0] == "scale_requested", ops
            relaunch = next(r for r in records if r.get("action") == "relaunch")
            assert (relaunch["rank_offset"], relaunch["join_mode"]) == (2, "recover")
            assert "while serving stalled" in relaunch["message"], relaunch
            assert relaunch["stuck"] is True, relaunch  # killed at once, without the grace
            assert [r["purpose"] for r in records if r.get("action") == "scale"] == [
                "grow", "shrink"], records
        finally:
            code = controller.stop()
        assert code == 0, controller.tail()

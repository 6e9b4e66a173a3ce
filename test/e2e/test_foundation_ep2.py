"""A 2-rank EP server on CPU (Mooncake process groups, NIXL EP data plane) serves exactly what a
1-rank server does.

Greedy decoding of a fixed prompt set in float32: an expert computed on no rank or on two ranks
changes the hidden states by a whole expert's output and flips tokens, so exact equality of the
token ids is a real check of routing and placement. The NIXL EP cluster of the last part is
started as a user starts one by hand, with ``sglang-eep testbed up``, and stopped with
``testbed down`` from another process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from sglang_elastic_ep_testbed import cli as testbed_cli
from sglang_elastic_ep_testbed.cli import StateFile
from sglang_elastic_ep_testbed.cluster import ClusterSpec, LocalCluster
from sglang_elastic_ep_testbed.cluster.launcher import ServerProcess
from sglang_elastic_ep_testbed.cluster.load import DEFAULT_PROMPTS, generate
from sglang_elastic_ep_testbed.cluster.procs import kill_tree, off_loopback_sockets
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cluster.zygote import ENV_SERVER_START
from sglang_elastic_ep_testbed.cpu.child_start import CHILD_START_LINE, ENV_CHILD_START

MAX_NEW_TOKENS = 16
CLI = [sys.executable, "-m", "sglang_elastic_ep.cli.main"]
UP_TIMEOUT_S = 600


def greedy_outputs(url: str) -> tuple[dict[str, list[int]], set[int | None]]:
    outputs: dict[str, list[int]] = {}
    shards: set[int | None] = set()
    with httpx.Client() as client:
        for prompt in DEFAULT_PROMPTS:
            result = generate(client, url, prompt, MAX_NEW_TOKENS)
            assert result.ok, f"{prompt!r}: {result.status} {result.error}"
            assert len(result.output_ids) == MAX_NEW_TOKENS
            outputs[prompt] = result.output_ids
            shards.add(result.dp_rank)
    return outputs, shards


def chat(url: str) -> str:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello world question"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["message"]["content"]


def check_contract_rejects_bad_input(url: str, max_size: int) -> None:
    """The orchestrator endpoints are mounted on the real server; bad input changes nothing."""
    before = httpx.get(url + "/elastic_ep/status", timeout=30).json()
    assert before["effective_ep_size"] == 2 and before["max_ep_size"] == max_size
    assert [r["state"] for r in before["ranks"]][:2] == ["active", "active"]
    for method in ("GET", "POST"):
        resp = httpx.request(method, url + "/is_scaling_elastic_ep", timeout=30)
        assert resp.status_code == 200 and resp.json()["is_scaling_elastic_ep"] is False
    bad = [
        ({"new_ep_size": max_size + 1}, 400, "max-ep-size"),
        ({"new_tp_size": 0}, 400, "at least 1"),
        ({"new_ep_size": 2, "new_tp_size": 3}, 400, "new_tp_size"),
        ({"new_ep_size": "2"}, 400, ""),
    ]
    for body, code, words in bad:
        resp = httpx.post(url + "/scale_elastic_ep", json=body, timeout=30)
        assert resp.status_code == code, (body, resp.text)
        assert words in resp.text
        assert resp.json()["instance_id"] == before["instance_id"]
    after = httpx.get(url + "/elastic_ep/status", timeout=30).json()
    assert after["effective_ep_size"] == 2 and after["recent_operations"] == []


@pytest.mark.timeout(1200)
def test_two_rank_ep_server_matches_one_rank(tiny_model: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a GPU: the servers' children spawn, each loading the plugins through their entry
    # points (every other scenario forks them, for a shorter start-up).
    monkeypatch.setenv(ENV_CHILD_START, "spawn")
    # And the servers are exec'd, as users start them (SGLANG_EEP_SERVER_START=fork would
    # fork them from a zygote).
    monkeypatch.setenv(ENV_SERVER_START, "exec")
    with LocalCluster(ClusterSpec(tiny_model, ep_size=1, elastic=False)) as one:
        reference, _ = greedy_outputs(one.url)
        reference_chat = chat(one.url)

    # Two ranks with the NIXL EP data plane on CPU (--moe-a2a-backend nixl): tokens travel to the
    # ranks owning their experts through the CPU buffer (real NIXL transfers) and back. This
    # cluster is the one a user starts by hand: `sglang-eep testbed up`, then `show`
    # and `down` from another process.
    state_dir = tmp_path / "testbed"
    with open(tmp_path / "up.out", "w") as out:
        up = subprocess.Popen(
            [*CLI, "testbed", "up", "--ranks", "2", "--max", "4", "--model", str(tiny_model),
             "--state-dir", str(state_dir)], stdout=out, stderr=subprocess.STDOUT)
    try:
        state = wait_testbed_up(up, state_dir, tmp_path / "up.out")
        info = httpx.get(state.url + "/server_info", timeout=30).json()
        assert info["ep_size"] == 2 and info["tp_size"] == 2
        assert info.get("attn_dp_size", info.get("dp_size")) == 2, "one DP shard per rank"
        assert info["elastic_ep_backend"] == "mooncake"
        assert len(ServerProcess.scheduler_pids_of(state.servers[0].pid)) == 2
        server_log = Path(state.servers[0].log).read_text(errors="replace")
        assert f"{CHILD_START_LINE} spawn" in server_log
        assert all(psutil.Process(s.pid).ppid() == up.pid for s in state.servers), \
            "`testbed up` execs its servers: their parent is `up` itself"
        nixl_outputs, nixl_shards = greedy_outputs(state.url)
        nixl_chat = chat(state.url)
        check_contract_rejects_bad_input(state.url, max_size=4)
        # Mooncake's transfer engine, NIXL (UCX), SGLang's own sockets: all on loopback.
        off = off_loopback_sockets(server.pid for server in state.servers)
        assert not off, f"sockets off loopback: {off[:5]}"
        shown = run_testbed(state_dir, "show")
        assert shown.returncode == 0, shown.stdout
        for server in state.servers:
            assert str(server.pid) in shown.stdout, shown.stdout
        down = run_testbed(state_dir, "down")
        assert down.returncode == 0, down.stdout
        assert up.wait(timeout=60) == 0, (tmp_path / "up.out").read_text()
        assert not StateFile(state_dir).path.exists()
        still = [s.pid for s in state.servers if s.alive()]
        assert not still, f"servers left running after `testbed down`: {still}"
    finally:
        stop_testbed(up, state_dir)
    assert nixl_shards == {0, 1}, f"round-robin should use both DP shards, saw {nixl_shards}"
    mismatched = {p: (reference[p], nixl_outputs[p]) for p in reference
                  if reference[p] != nixl_outputs[p]}
    assert not mismatched, f"2-rank NIXL EP differs from 1 rank: {mismatched}"
    assert nixl_chat == reference_chat


def run_testbed(state_dir: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "testbed", *argv, "--state-dir", str(state_dir)],
                          capture_output=True, text=True, timeout=300)


def wait_testbed_up(
    up: subprocess.Popen[bytes], state_dir: Path, out: Path
) -> testbed_cli.TestbedState:
    store = StateFile(state_dir)

    def written() -> testbed_cli.TestbedState | None:
        assert up.poll() is None, f"`testbed up` exited {up.returncode}: {out.read_text()}"
        return store.read()

    return wait_until(written, UP_TIMEOUT_S, "`sglang-eep testbed up`", poll_s=1.0)


def stop_testbed(up: subprocess.Popen[bytes], state_dir: Path) -> None:
    """Whatever happened, nothing it started stays: `up` stops its servers on SIGTERM; by pid
    with SIGKILL if it does not."""
    if up.poll() is None:
        up.terminate()
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
    state = StateFile(state_dir).read()
    for server in state.servers if state else []:
        if server.alive():
            kill_tree(server.pid, hard=True)
    if psutil.pid_exists(up.pid) and up.poll() is None:
        kill_tree(up.pid, hard=True)
        up.wait(timeout=30)

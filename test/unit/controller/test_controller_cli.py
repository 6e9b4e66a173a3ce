"""``sglang-eep controller``: every flag documented, bad flags exit 2 with a clear message, and
one decision through the real CLI against a fake HTTP server."""

from __future__ import annotations

import argparse
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from controller_fakes import FakeServer, make_plane

from sglang_elastic_ep.cli.main import EXIT_OK, EXIT_USAGE, build_parser, main

REPO = Path(__file__).resolve().parents[3]
BASE = ("controller", "--url", "http://127.0.0.1:9", "--min-size", "2", "--max-size", "4")
LOCAL = (*BASE, "--command", "sleep 60 {rank_offset}")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_EEP_API_KEY", raising=False)
    monkeypatch.delenv("SGLANG_EEP_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "200")


def controller_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["controller"]


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["controller", "--help"]) == EXIT_OK
    out = capsys.readouterr().out
    flags = [s for a in controller_parser()._actions for s in a.option_strings]
    for wanted in ("--url", "--api-key", "--min-size", "--max-size", "--step", "--launch-size",
                   "--scale-up-load", "--scale-down-load", "--target-load", "--kv-scale-up",
                   "--kv-scale-down", "--no-kv", "--up-window", "--down-window", "--cooldown",
                   "--max-step-up", "--no-autoscale", "--max-relaunches", "--recover-timeout",
                   "--heal-retry", "--heal-stall-after", "--no-heal", "--poll-interval",
                   "--read-timeout",
                   "--retries", "--metrics-url", "--deployment", "--op-prefix", "--dry-run",
                   "--once", "--launcher", "--dist-init-addr", "--port-base", "--command",
                   "--log-dir", "--kill-grace", "--pod-template", "--namespace",
                   "--kube-context"):
        assert wanted in flags
    for action in controller_parser()._actions:
        assert action.help and len(action.help) > 10, action.option_strings
        for flag in action.option_strings:
            assert flag in out
    for placeholder in ("{rank_offset}", "{join_mode}", "{dist_init_addr}", "{port}"):
        assert placeholder in out
    assert "controller" in main_help(capsys)


def main_help(capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["--help"]) == EXIT_OK
    return capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (("controller", "--url", "http://x:1", "--max-size", "4"), "--min-size"),
    ((*LOCAL, "--min-size", "0"), "--min-size: must be at least 1, got 0"),
    ((*LOCAL, "--max-size", "two"), "--max-size: expected a whole number, got 'two'"),
    ((*LOCAL, "--kv-scale-up", "1.5"), "--kv-scale-up: must be in [0, 1], got 1.5"),
    ((*LOCAL, "--launcher", "slurm"), "invalid choice: 'slurm'"),
    ((*LOCAL, "--metrics-url", "localhost:30000/metrics"), "expected an http(s):// URL"),
    ((*LOCAL, "--frobnicate"), "unrecognized arguments: --frobnicate"),
    ((*LOCAL, "--min-size", "6"), "need 1 <= --step <= --min-size <= --max-size"),
    ((*LOCAL, "--step", "2", "--min-size", "3"), "--min-size and --max-size must be "
                                                 "multiples of --step"),
    ((*LOCAL, "--scale-up-load", "1", "--scale-down-load", "3"),
     "need 0 <= --scale-down-load < --scale-up-load"),
    ((*LOCAL, "--launch-size", "3", "--step", "2"), "--launch-size must be a multiple"),
    ((*LOCAL, "--op-prefix", "a b"), "--op-prefix must be"),
    ((*LOCAL, "--heal-stall-after", "-5"), "--heal-stall-after: must be at least 0, got -5"),
    (BASE, "--launcher local needs --command"),
    ((*BASE, "--command", "serve {rank}"), "unknown placeholder(s) {rank}"),
    ((*BASE, "--command", "serve {dist_init_addr}"), "--dist-init-addr"),
    ((*BASE, "--launcher", "kubernetes"), "--launcher kubernetes needs --pod-template"),
    ((*BASE, "--launcher", "kubernetes", "--pod-template", "/nonexistent.yaml"),
     "cannot read --pod-template"),
])
def test_bad_flags_exit_2_with_a_clear_message(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(list(argv)) == EXIT_USAGE
    captured = capsys.readouterr()
    assert message in " ".join((captured.err + captured.out).split())


def test_one_dry_run_decision_through_the_cli(capsys: pytest.CaptureFixture[str],
                                              tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    plane = make_plane(initial=2)
    server = FakeServer(plane)
    real_client = httpx.Client

    def client(**kwargs: Any) -> httpx.Client:  # every client the CLI makes talks to the fake
        return real_client(**{**kwargs, "transport": server.transport})

    monkeypatch.setattr(httpx, "Client", client)
    code = main(["controller", "--url", "http://eep.test:30000", "--min-size", "3",
                 "--max-size", "4", "--command", "sleep 60 {rank_offset}", "--log-dir",
                 str(tmp_path), "--deployment", f"cli-test-{uuid.uuid4().hex[:8]}", "--once",
                 "--dry-run", "--json"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert '"would POST new_ep_size=3 (ctl-1-grow-to-3): grow 2 -> 3: size 2 is outside ' \
           '[3, 4]"' in out
    assert server.posts() == [] and plane.status().current_operation is None


BLOCK_KUBERNETES = """
import importlib.abc, sys

class NoKubernetes(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "kubernetes":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoKubernetes())
"""

LOCAL_MODE = """
import io, sys, tempfile, uuid
from rich.console import Console
sys.path.insert(0, {helpers!r})
from controller_fakes import FakeServer, make_plane, metrics_text
from sglang_elastic_ep.cli.main import build_parser, main
from sglang_elastic_ep.cli.controller import build_loop

server = FakeServer(make_plane())
server.metrics = metrics_text(queued=10, running=10)
logs = tempfile.mkdtemp()
args = build_parser().parse_args([
    "controller", "--url", "http://eep.test:30000", "--min-size", "2", "--max-size", "4",
    "--up-window", "0", "--command", "sleep 60 {{rank_offset}}", "--log-dir", logs,
    "--deployment", "no-kube-test-" + uuid.uuid4().hex[:8], "--once"])
out = io.StringIO()
loop = build_loop(args, Console(file=out, width=200), transport=server.transport)
loop.run(once=True)
stopped = loop.launcher.terminate(range(8))  # the joiner it launched, by pid
assert [launch.rank_offset for launch in stopped] == [2], stopped
loop.close()
assert server.posts()[0]["operation_id"] == "ctl-1-grow-to-3", out.getvalue()
assert "kubernetes" not in sys.modules
code = main(["controller", "--url", "http://eep.test:30000", "--min-size", "2", "--max-size",
             "4", "--launcher", "kubernetes", "--pod-template", {template!r}])
assert code == 2, code
print("local mode ok")
"""


def test_local_mode_works_with_kubernetes_absent() -> None:
    script = BLOCK_KUBERNETES + LOCAL_MODE.format(
        helpers=str(Path(__file__).parent),
        template=str(REPO / "docs" / "kubernetes" / "joiner-pod-template.yaml"),
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("local mode ok")
    assert "pip install 'sglang-elastic-ep[kubernetes]'" in " ".join(out.stderr.split())


def test_pyproject_declares_the_controllers_dependencies() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = " ".join(project["dependencies"])
    for name in ("httpx", "rich", "tenacity", "psutil", "prometheus-client"):
        assert name in deps
    assert [d.split(">")[0] for d in project["optional-dependencies"]["kubernetes"]] == [
        "kubernetes"]

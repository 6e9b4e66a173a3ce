"""``sglang-eep testbed``: its state file and every refusal, without starting a cluster."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_elastic_ep.cli.main import main
from sglang_elastic_ep_testbed import cli as testbed_cli
from sglang_elastic_ep_testbed.cli import ServerRecord, StateFile


def _state(tmp_path: Path, servers: list[ServerRecord], up_pid: int | None = None) -> StateFile:
    store = StateFile(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    store.write(testbed_cli.TestbedState(
        up_pid=up_pid or os.getpid(), url="http://127.0.0.1:1", dist_port=2, env={},
        taken_ports=[1, 2], spec={"model_path": "m", "ep_size": 2, "max_ep_size": 4,
                                  "nodes": 1, "moe_a2a_backend": "nixl", "log_dir": "l"},
        servers=servers))
    return store


def _cli(tmp_path: Path, *argv: str) -> int:
    return main(["testbed", *argv, "--state-dir", str(tmp_path)])


DEAD_PID = 2**22 + 12345  # above the default pid_max: never a live process


def test_state_round_trips_and_names_the_owner_of_each_rank(tmp_path: Path) -> None:
    primary = ServerRecord("primary-ep2", os.getpid(), [0, 1], "primary", "p.log", 0)
    joiner = ServerRecord("joiner-scale-r2", DEAD_PID, [2], "joiner", "j.log")
    back = _state(tmp_path, [primary, joiner]).read()
    assert back is not None and back.servers == [primary, joiner]
    assert back.owner_of(1) == primary and back.owner_of(2) == joiner
    assert primary.alive() and not joiner.alive()
    with pytest.raises(testbed_cli.TestbedError, match="testbed join --rank 3"):
        back.owner_of(3)


def test_every_verb_without_a_testbed_says_how_to_start_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for verb in (["join"], ["kill", "1"], ["recover", "1"], ["show"]):
        assert _cli(tmp_path, *verb) == 2
        assert "testbed up --ranks 2 --max 4" in capsys.readouterr().err
    assert _cli(tmp_path, "down") == 0  # nothing to stop is not an error


def test_a_state_left_by_a_dead_up_counts_as_no_testbed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _state(tmp_path, [], up_pid=DEAD_PID)
    assert _cli(tmp_path, "join") == 2
    assert "no testbed is up" in capsys.readouterr().err


def test_join_refuses_a_live_slot_and_slots_beyond_max(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _state(tmp_path, [ServerRecord("primary-ep2", os.getpid(), [0, 1], "primary", "p.log", 0)])
    assert _cli(tmp_path, "join", "--rank", "1") == 2
    assert "join --rank 2" in capsys.readouterr().err
    assert _cli(tmp_path, "join", "--rank", "4") == 2
    assert "beyond --max 4" in capsys.readouterr().err


def test_kill_and_recover_refuse_what_cannot_work_and_name_what_can(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    primary = ServerRecord("primary-ep2", os.getpid(), [0, 1], "primary", "p.log", 0)
    dead_joiner = ServerRecord("joiner-scale-r2", DEAD_PID, [2], "joiner", "j.log")
    _state(tmp_path, [primary, dead_joiner])
    assert _cli(tmp_path, "kill", "2") == 2
    assert "testbed recover 2" in capsys.readouterr().err
    assert _cli(tmp_path, "recover", "1") == 2
    assert "--nodes" in capsys.readouterr().err


def test_up_refuses_bad_sizes_before_starting_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(tmp_path, "up", "--ranks", "3", "--max", "2") == 2
    assert "--max 2 is below --ranks 3" in capsys.readouterr().err
    assert _cli(tmp_path, "up", "--ranks", "3", "--nodes", "2") == 2
    assert "does not split" in capsys.readouterr().err
    assert not (tmp_path / "state.json").exists()

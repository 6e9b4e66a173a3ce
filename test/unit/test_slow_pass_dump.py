"""A forward pass past its limit prints every thread's stack; a quick one prints nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sglang_elastic_ep_testbed.cpu.slow_pass import (
    ENV_SLOW_PASS_DUMP_S,
    dump_stacks_of_a_slow_pass,
    slow_pass_dump_s,
)
from sglang_elastic_ep_testbed.hooks import HOOKS


@pytest.fixture(autouse=True)
def limit_read_anew() -> Iterator[None]:
    slow_pass_dump_s.cache_clear()  # read once per process; each test sets its own
    yield
    slow_pass_dump_s.cache_clear()


def a_pass_blocked_in_its_forward(scheduler: object, seconds: float) -> str:
    time.sleep(seconds)
    return "batch result"


def test_a_slow_pass_prints_the_stack_it_is_blocked_in(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(ENV_SLOW_PASS_DUMP_S, "0.2")
    result = dump_stacks_of_a_slow_pass(a_pass_blocked_in_its_forward, object(), 0.6)
    assert result == "batch result"
    err = capfd.readouterr().err
    assert "Timeout (0:00:00" in err, err
    assert "a_pass_blocked_in_its_forward" in err, err


def test_a_quick_pass_prints_nothing_and_disarms_the_watchdog(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(ENV_SLOW_PASS_DUMP_S, "0.3")
    assert dump_stacks_of_a_slow_pass(a_pass_blocked_in_its_forward, object(), 0.0) == \
        "batch result"
    time.sleep(0.5)  # past the limit, outside any pass
    assert "Timeout" not in capfd.readouterr().err


def test_turned_off_it_arms_nothing(monkeypatch: pytest.MonkeyPatch,
                                    capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV_SLOW_PASS_DUMP_S, "0")
    assert dump_stacks_of_a_slow_pass(a_pass_blocked_in_its_forward, object(), 0.1) == \
        "batch result"
    assert "Timeout" not in capfd.readouterr().err


@pytest.mark.parametrize("raw", ["-1", "soon"])
def test_a_bad_limit_is_refused(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SLOW_PASS_DUMP_S, raw)
    with pytest.raises(ValueError):
        slow_pass_dump_s()


def test_the_hook_wraps_each_forward_pass() -> None:
    (hook,) = [h for h in HOOKS if h.impl == "cpu.slow_pass:dump_stacks_of_a_slow_pass"]
    assert hook.target.endswith("model_executor.model_runner.ModelRunner.forward")
    assert hook.kind == "AROUND"

"""Our Mooncake timeout flags reach Mooncake in every scheduler process, on any device."""

from __future__ import annotations

import pytest

from sglang_elastic_ep.sglang import mooncake_timeouts
from sglang_elastic_ep.sglang.args import ENV_COLLECTIVE_TIMEOUT, ENV_FAULT_WINDOW


class RecordingPg:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def set_collective_timeout_us(self, us: int) -> None:
        self.calls.append(("collective_timeout_us", us))

    def set_fault_reconciliation_window_us(self, us: int) -> None:
        self.calls.append(("fault_window_us", us))


def test_the_flags_in_the_environment_become_mooncake_microseconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_COLLECTIVE_TIMEOUT, "2.0")
    monkeypatch.setenv(ENV_FAULT_WINDOW, "35.5")
    pg = RecordingPg()
    mooncake_timeouts.apply_timeouts(pg)
    assert pg.calls == [("collective_timeout_us", 2_000_000), ("fault_window_us", 35_500_000)]


def test_an_unset_flag_leaves_mooncakes_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_COLLECTIVE_TIMEOUT, raising=False)
    monkeypatch.setenv(ENV_FAULT_WINDOW, "12")
    pg = RecordingPg()
    mooncake_timeouts.apply_timeouts(pg)
    assert pg.calls == [("fault_window_us", 12_000_000)]
    monkeypatch.delenv(ENV_FAULT_WINDOW)
    mooncake_timeouts.apply_timeouts()  # nothing given: returns before importing mooncake.pg

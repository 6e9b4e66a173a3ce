"""Our server flags are checked at startup: a bad value is a clear error before anything runs."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from sglang_elastic_ep.sglang import args as eep_args


def parsed(**overrides: object) -> argparse.Namespace:
    values = {dest: default for dest, default, _typ, _help in eep_args.EXTRA_FLAGS.values()}
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("drain", [600.0, 900.0])
def test_a_drain_timeout_not_below_the_scale_timeout_is_refused(drain: float) -> None:
    server_args = SimpleNamespace(elastic_ep_scale_timeout=600.0, ep_size=2)
    with pytest.raises(ValueError, match="must be below --elastic-ep-scale-timeout"):
        eep_args.from_cli_args(server_args, None, parsed(elastic_ep_drain_timeout=drain))


def test_a_negative_drain_timeout_is_refused() -> None:
    server_args = SimpleNamespace(elastic_ep_scale_timeout=600.0, ep_size=2)
    with pytest.raises(ValueError, match="drain-timeout must be >= 0"):
        eep_args.from_cli_args(server_args, None, parsed(elastic_ep_drain_timeout=-1.0))


@pytest.mark.parametrize(("timeout", "window", "short"), [
    (2.0, 3.0, True), (2.0, 4.0, False), (2.0, 6.0, False), (None, 1.0, False), (2.0, None, False),
])
def test_a_fault_window_below_twice_the_collective_timeout_is_named(
        timeout: float | None, window: float | None, short: bool) -> None:
    why = eep_args.fault_window_too_short(timeout, window)
    assert (why is not None) is short
    if short:
        assert "--elastic-ep-fault-window 4 or more" in why and f"{window:g}" in why


@pytest.mark.parametrize(("window", "largest", "within"), [
    (10.0, 3, True), (30.0, 4, True), (35.0, 4, False), (10.0, 2, False), (None, 4, False),
])
def test_a_fault_window_within_mooncakes_heartbeat_timeout_is_named_from_three_ranks(
        window: float | None, largest: int, within: bool) -> None:
    why = eep_args.fault_window_within_heartbeat(window, largest)
    assert (why is not None) is within
    if within:
        assert "--elastic-ep-fault-window 35" in why and f"can have {largest} ranks" in why

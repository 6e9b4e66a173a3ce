"""A CPU server's children fork unless spawn is asked for; a bad setting is refused."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from sglang_elastic_ep_testbed.cpu.child_start import (
    ENV_CHILD_START,
    child_start_method,
    fork_children,
)


@pytest.fixture
def start_method_restored() -> Iterator[None]:
    before = multiprocessing.get_start_method()
    yield
    multiprocessing.set_start_method(before, force=True)


def test_children_fork_after_upstream_set_spawn(
    start_method_restored: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_CHILD_START, raising=False)
    multiprocessing.set_start_method("spawn", force=True)  # what upstream has just done
    assert fork_children(None, object()) is None
    assert multiprocessing.get_start_method() == "fork"


def test_spawn_asked_for_keeps_upstreams_spawn(
    start_method_restored: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_CHILD_START, "spawn")
    multiprocessing.set_start_method("spawn", force=True)
    fork_children(None, object())
    assert multiprocessing.get_start_method() == "spawn"


def test_an_unknown_method_is_refused_with_the_choices(
    start_method_restored: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_CHILD_START, "forkserver")
    multiprocessing.set_start_method("spawn", force=True)
    with pytest.raises(ValueError, match="fork, spawn"):
        child_start_method()
    with pytest.raises(ValueError):
        fork_children(None, object())
    assert multiprocessing.get_start_method() == "spawn"  # nothing changed

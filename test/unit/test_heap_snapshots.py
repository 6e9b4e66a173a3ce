"""SIGUSR2 heap snapshots of a scheduler (testbed cpu/heap_snapshots.py), for the soak."""

from __future__ import annotations

import os
import signal
import tracemalloc
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cpu import heap_snapshots


@pytest.fixture
def restore_sigusr2():  # type: ignore[no-untyped-def]
    before = signal.getsignal(signal.SIGUSR2)
    yield
    signal.signal(signal.SIGUSR2, before)
    tracemalloc.stop()


def test_without_the_directory_no_handler_is_installed(
        monkeypatch: pytest.MonkeyPatch, restore_sigusr2: None) -> None:
    monkeypatch.delenv(heap_snapshots.ENV_SNAPSHOT_DIR, raising=False)
    before = signal.getsignal(signal.SIGUSR2)
    heap_snapshots.install_heap_snapshot_on_signal(None, object())
    assert signal.getsignal(signal.SIGUSR2) is before


def test_the_first_signal_starts_tracing_and_later_ones_see_what_was_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_sigusr2: None) -> None:
    monkeypatch.setenv(heap_snapshots.ENV_SNAPSHOT_DIR, str(tmp_path))
    assert not tracemalloc.is_tracing()
    heap_snapshots.install_heap_snapshot_on_signal(None, object())
    os.kill(os.getpid(), signal.SIGUSR2)
    assert tracemalloc.is_tracing()
    kept = [bytearray(4096) for _ in range(256)]  # 1 MiB held between the two snapshots
    os.kill(os.getpid(), signal.SIGUSR2)
    first = heap_snapshots.snapshot_path(tmp_path, os.getpid(), 0)
    second = heap_snapshots.snapshot_path(tmp_path, os.getpid(), 1)
    assert first.exists() and second.exists()
    growth = tracemalloc.Snapshot.load(str(second)).compare_to(
        tracemalloc.Snapshot.load(str(first)), "lineno")
    top = growth[0]
    assert top.traceback[0].filename == __file__ and top.size_diff >= 1 << 20, top
    assert len(kept) == 256

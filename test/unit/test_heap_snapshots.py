"""SIGUSR2 heap figures of a scheduler (testbed cpu/heap_snapshots.py), for the soak."""

from __future__ import annotations

import ctypes
import json
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
    monkeypatch.setenv(heap_snapshots.ENV_TRACE_PYTHON, "1")
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


@pytest.fixture
def libc() -> ctypes.CDLL:
    """The C library, typed for the calls these tests make to put blocks on the C heap."""
    lib = ctypes.CDLL(None)
    lib.malloc.restype = ctypes.c_void_p
    lib.malloc.argtypes = [ctypes.c_size_t]
    lib.free.argtypes = [ctypes.c_void_p]
    lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib


def read_malloc(directory: Path, index: int) -> dict[str, dict[str, float]]:
    return json.loads(heap_snapshots.malloc_path(directory, os.getpid(), index).read_text())


def test_each_signal_writes_the_c_heap_figures_and_python_stays_untraced_by_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_sigusr2: None,
        libc: ctypes.CDLL) -> None:
    monkeypatch.setenv(heap_snapshots.ENV_SNAPSHOT_DIR, str(tmp_path))
    monkeypatch.delenv(heap_snapshots.ENV_TRACE_PYTHON, raising=False)
    heap_snapshots.install_heap_snapshot_on_signal(None, object())
    os.kill(os.getpid(), signal.SIGUSR2)
    blocks = [libc.malloc(1 << 10) for _ in range(4096)]  # 4 MiB of small blocks, held
    os.kill(os.getpid(), signal.SIGUSR2)
    for block in blocks:
        libc.free(block)
    assert not tracemalloc.is_tracing()
    assert not heap_snapshots.snapshot_path(tmp_path, os.getpid(), 0).exists()
    before, held = read_malloc(tmp_path, 0), read_malloc(tmp_path, 1)
    assert set(before) == {"before_trim"}
    grown = held["before_trim"]["in_use_kib"] - before["before_trim"]["in_use_kib"]
    assert grown >= 4096, (before, held)
    assert held["before_trim"]["held_kib"] >= held["before_trim"]["in_use_kib"]


def test_a_trim_request_gives_the_free_heap_back_and_records_both_sides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_sigusr2: None,
        libc: ctypes.CDLL) -> None:
    monkeypatch.setenv(heap_snapshots.ENV_SNAPSHOT_DIR, str(tmp_path))
    heap_snapshots.install_heap_snapshot_on_signal(None, object())
    blocks = [libc.malloc(1 << 10) for _ in range(16384)]  # 16 MiB, touched, then freed
    fence = libc.malloc(1 << 10)  # above them: free() alone cannot shrink the heap's top
    for block in blocks:
        libc.memset(block, 1, 1 << 10)
    for block in blocks:
        libc.free(block)
    heap_snapshots.trim_request_path(tmp_path, os.getpid()).touch()
    os.kill(os.getpid(), signal.SIGUSR2)
    figures = read_malloc(tmp_path, 0)
    before, after = figures["before_trim"], figures["after_trim"]
    assert after["held_kib"] <= before["held_kib"]
    libc.free(fence)
    assert after["rss_kib"] < before["rss_kib"], figures

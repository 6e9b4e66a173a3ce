"""The idle parker on a real native thread: found by its CPU time, parked to ~0 CPU, released."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cpu.idle import (
    ThreadParker,
    find_spinning_native_threads,
    thread_cpu_ns,
    thread_park_library_path,
)

SPINNER_C = r"""
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
static volatile int stop = 0;
static volatile int spinner_tid = 0;
static void *spin(void *arg) {
    (void)arg;
    spinner_tid = (int)syscall(SYS_gettid);
    while (!stop) { __asm__ volatile("pause"); }
    return 0;
}
static pthread_t thread;
int spinner_start(void) {
    if (pthread_create(&thread, 0, spin, 0) != 0) return -1;
    while (!spinner_tid) usleep(100);
    return spinner_tid;
}
void spinner_stop(void) { stop = 1; pthread_join(thread, 0); }
"""


@pytest.fixture()
def spinner(tmp_path: Path):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found: cannot build the native spinner")
    source = tmp_path / "spinner.c"
    source.write_text(SPINNER_C)
    lib_path = tmp_path / "libspinner.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib_path),
                    str(source)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    tid = lib.spinner_start()
    assert tid > 0
    yield tid
    lib.spinner_stop()


def cpu_ms_over(tid: int, seconds: float) -> float:
    start = thread_cpu_ns(tid)
    time.sleep(seconds)
    end = thread_cpu_ns(tid)
    assert start is not None and end is not None
    return (end - start) / 1e6


def wait_spinning(tid: int) -> None:
    """Until ``tid`` has burnt another 30 ms of CPU. No window: on a busy machine a spinning
    thread only takes longer to get there; a parked one never does."""
    start = thread_cpu_ns(tid)
    assert start is not None
    wait_until(lambda: (thread_cpu_ns(tid) or start) - start >= 30_000_000, 60,
               f"thread {tid} spinning", poll_s=0.01)


def wait_found_spinning(tid: int) -> None:
    """Until a search finds ``tid`` (a search can miss it while other processes have the
    cores: it needs a share of one over its window)."""
    wait_until(lambda: tid in find_spinning_native_threads(window_s=0.1, min_share=0.05), 60,
               f"thread {tid} found spinning", poll_s=0.01)


def test_parker_stops_and_releases_a_spinning_native_thread(spinner: int) -> None:
    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    wait_found_spinning(spinner)
    # A bound far beyond the checks below: the park must not end by itself during them.
    parker = ThreadParker(library, max_park_ms=600_000)
    parker.tids = [spinner]
    parker.park()
    try:
        wait_until(lambda: parker.parked_count() == 1, 60, "the spinner parked", poll_s=0.01)
        # A parked thread burns nothing, however long the sleep really lasts.
        assert cpu_ms_over(spinner, 0.2) < 5.0
    finally:
        parker.unpark()
    wait_spinning(spinner)  # spinning again
    assert parker.parked_count() == 0


def test_a_park_ends_by_itself_after_the_bound(spinner: int) -> None:
    """A collective started while parked must be delayed, never hung."""
    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    parker = ThreadParker(library, max_park_ms=20)
    parker.tids = [spinner]
    parker.park()  # and never unparked
    try:
        wait_until(lambda: parker.parked_count() == 0, 60, "the park ended", poll_s=0.01)
        wait_spinning(spinner)
    finally:
        parker.unpark()


def test_keep_parked_parks_again_once_a_park_ended_by_itself(spinner: int) -> None:
    """A long wait (a connect handshake) calls ``keep_parked`` each round: a park that ran
    out is renewed, one that holds is left alone, and ``unpark`` releases it."""
    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    parker = ThreadParker(library, max_park_ms=20)
    parker.tids = [spinner]
    try:
        parker.keep_parked()
        wait_until(lambda: parker.parked_count() == 1, 60, "the spinner parked", poll_s=0.001)
        wait_until(lambda: parker.parked_count() == 0, 60, "the park ended", poll_s=0.001)
        parker.keep_parked()
        wait_until(lambda: parker.parked_count() == 1, 60, "parked again", poll_s=0.001)
    finally:
        parker.unpark()
    wait_spinning(spinner)
    assert parker.parked_count() == 0


def test_a_gone_thread_is_dropped_from_the_park_list() -> None:
    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    parker = ThreadParker(library)
    parker.tids = [2**22 + 12345]  # above pid_max's default: no such thread
    parker.park()
    parker.unpark()
    assert parker.tids == []


def test_idle_settings_reject_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep_testbed.cpu import idle

    monkeypatch.setenv(idle.ENV_IDLE_POLL_MS, "-1")
    with pytest.raises(ValueError, match="SGLANG_EEP_IDLE_POLL_MS"):
        idle.idle_poll_ms()
    monkeypatch.setenv(idle.ENV_PARK_SPINNERS, "maybe")
    with pytest.raises(ValueError, match="SGLANG_EEP_IDLE_PARK_SPINNERS"):
        idle.park_spinners_enabled()
    monkeypatch.setenv(idle.ENV_PARK_SPINNERS, "0")
    assert idle.make_thread_parker() is None


def test_a_search_cut_short_by_a_request_finds_nothing(spinner: int) -> None:
    """The search waits on the request sockets; a request that ends it early wins."""
    assert find_spinning_native_threads(window_s=0.1, wait=lambda s: None) == []
    wait_found_spinning(spinner)


def test_a_found_spinner_is_put_in_the_idle_class_and_a_gone_one_skipped(spinner: int) -> None:
    from sglang_elastic_ep_testbed.cpu import idle

    assert os.sched_getscheduler(spinner) == os.SCHED_OTHER
    gone = 2**22 + 12345  # above pid_max's default: no such thread
    assert idle.lower_to_idle_class([gone, spinner]) == [spinner]
    assert os.sched_getscheduler(spinner) == os.SCHED_IDLE


def test_the_idle_class_setting_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep_testbed.cpu import idle

    monkeypatch.delenv(idle.ENV_SPINNERS_IDLE_CLASS, raising=False)
    assert not idle.spinners_idle_class_enabled()  # opt-in
    monkeypatch.setenv(idle.ENV_SPINNERS_IDLE_CLASS, "1")
    assert idle.spinners_idle_class_enabled()
    monkeypatch.setenv(idle.ENV_SPINNERS_IDLE_CLASS, "sometimes")
    with pytest.raises(ValueError, match="SGLANG_EEP_SPINNERS_IDLE_CLASS"):
        idle.spinners_idle_class_enabled()


@pytest.mark.parametrize("park_in_forward", [True, False])
def test_the_forward_pass_runs_with_the_spinner_parked_unless_turned_off(
        spinner: int, park_in_forward: bool) -> None:
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cpu import idle

    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    parker = ThreadParker(library, max_park_ms=600_000)
    parker.tids = [spinner]
    sleeper = idle.ShortPollIdleSleeper([], 50, parker, park_in_forward=park_in_forward)
    scheduler = SimpleNamespace(idle_sleeper=sleeper)
    seen: dict[str, int] = {}

    def run_batch(sched: object, batch: str) -> str:
        if park_in_forward:
            wait_until(lambda: parker.parked_count() == 1, 60, "the spinner parked",
                       poll_s=0.01)
        else:
            wait_spinning(spinner)
        seen["parked"] = parker.parked_count()
        return f"ran {batch}"

    try:
        assert idle.forward_pass(run_batch, scheduler, "batch 1") == "ran batch 1"
    finally:
        parker.unpark()
    assert seen["parked"] == int(park_in_forward)
    wait_until(lambda: parker.parked_count() == 0, 60, "the spinner released", poll_s=0.01)
    wait_spinning(spinner)


def test_a_search_adds_only_new_spinners_to_the_parker(spinner: int) -> None:
    from sglang_elastic_ep_testbed.cpu import idle

    library = thread_park_library_path()
    if not library.exists():
        pytest.skip(f"{library} not built (scripts/setup.sh builds it)")
    parker = ThreadParker(library)
    sleeper = idle.ShortPollIdleSleeper([], 50, parker)
    # A search can miss the spinner while other processes have the cores: search until found.
    wait_until(lambda: spinner in sleeper.find_spinners(), 60, "the spinner found",
               poll_s=0.01)
    assert parker.tids == [spinner]
    assert spinner not in sleeper.find_spinners()  # known already
    assert parker.tids == [spinner]
    assert idle.ShortPollIdleSleeper([], 50, None).find_spinners() == []


def test_a_new_scheduler_searches_for_spinners_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scale joiner under load may never idle: its worker must be known from the start."""
    from types import SimpleNamespace

    from sglang_elastic_ep_testbed.cpu import idle

    class ListParker:
        def __init__(self) -> None:
            self.tids: list[int] = []

    searched: list[float] = []

    def search(wait: object, **_: object) -> list[int]:
        searched.append(time.monotonic())
        return [4242]

    monkeypatch.setattr(idle, "process_thread_parker", ListParker)
    monkeypatch.setattr(idle, "find_spinning_native_threads", search)
    scheduler = SimpleNamespace(
        idle_sleeper=None, ipc_channels=SimpleNamespace(recv_from_tokenizer=None,
                                                        recv_from_rpc=None))
    idle.install_idle_sleeper(None, scheduler)
    assert len(searched) == 1
    assert scheduler.idle_sleeper.parker.tids == [4242]
    assert scheduler.idle_sleeper.next_search > searched[0]  # the next one in 30 s


def test_the_forward_pass_setting_rejects_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_elastic_ep_testbed.cpu import idle

    monkeypatch.delenv(idle.ENV_PARK_SPINNERS_IN_FORWARD, raising=False)
    assert idle.park_spinners_in_forward_enabled()  # on by default
    monkeypatch.setenv(idle.ENV_PARK_SPINNERS_IN_FORWARD, "0")
    assert not idle.park_spinners_in_forward_enabled()
    monkeypatch.setenv(idle.ENV_PARK_SPINNERS_IN_FORWARD, "often")
    with pytest.raises(ValueError, match="SGLANG_EEP_PARK_SPINNERS_IN_FORWARD"):
        idle.park_spinners_in_forward_enabled()

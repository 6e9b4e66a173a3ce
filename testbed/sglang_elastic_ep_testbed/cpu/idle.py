"""Cheap idle ranks, and a busy rank that keeps its cores, on the CPU engine.

Two things spin an idle CPU rank. (1) With DP attention every idle scheduler still runs its
loop, and each pass all-gathers token counts with the other ranks. (2) Mooncake PG's worker
thread polls its task table in an endless native loop (``mooncake_worker_thread.cpp``:
``while (running_) { PAUSE(); ... }``), one core per process whether or not a collective is in
flight; on 2 cores a 2-rank cluster therefore sat at 2 cores doing nothing.

The idle sleeper here handles both (``SGLANG_EEP_IDLE_PARK_SPINNERS=0`` turns the second off;
see ``park_spinners_enabled``). An idle rank polls its
request sockets with a short timeout (``SGLANG_EEP_IDLE_POLL_MS``, default 50 ms) instead of
upstream's 1 s (``--sleep-on-idle``): the receiving rank wakes at once and every other rank
within one timeout, so the first request waits at most that long. With parking on, the
process's busy-spinning native threads (found by their CPU time when the scheduler starts,
and again every 30 s at idle as they start late, see ``find_spinning_native_threads``) are
parked with
``scripts/native/thread_park.c``: a real-time signal whose handler sleeps on a futex until
released. They stay parked for the whole of ``Scheduler.on_idle`` (housekeeping, then the
poll), which runs no Mooncake collective. A park also ends by itself after ``MAX_PARK_MS``.

A busy rank parks them too, through each forward pass (``Scheduler.run_batch``,
``SGLANG_EEP_PARK_SPINNERS_IN_FORWARD=0`` turns it off): the pass moves its MoE tokens over
NIXL and runs no Mooncake collective, and a spinning worker beside it took about half a core
from the schedulers on a 2-core machine (docs/benchmarks.md, "The cost of elastic mode"). The
worker runs again for the DP gather between passes, which does need it. The CPU EP buffer parks
them while its connect handshake waits for a joiner (``cpu/scheduler_buffer.py``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sglang_elastic_ep_testbed.cpu.settings import env_number

logger = logging.getLogger(__name__)

ENV_IDLE_POLL_MS = "SGLANG_EEP_IDLE_POLL_MS"
ENV_PARK_SPINNERS = "SGLANG_EEP_IDLE_PARK_SPINNERS"
ENV_PARK_SPINNERS_IN_FORWARD = "SGLANG_EEP_PARK_SPINNERS_IN_FORWARD"
ENV_PARK_SPINNERS_IN_CONNECT = "SGLANG_EEP_PARK_SPINNERS_IN_CONNECT"
ENV_THREAD_PARK_LIB = "SGLANG_EEP_THREAD_PARK_LIB"
ENV_SPINNERS_IDLE_CLASS = "SGLANG_EEP_SPINNERS_IDLE_CLASS"
# Every idle pass still runs the DP token-count all-gather (and the membership agreement) over
# Mooncake, whose waiters spin: an idle 2-rank elastic cluster burns 1.4 of the 2 cores at 5 ms,
# 0.5 at 50 ms, and a joiner starting beside it gets the rest. The first request of an idle
# cluster waits at most one poll on the ranks it did not arrive at.
DEFAULT_IDLE_POLL_MS = 50.0
PARK_SIGNAL = signal.SIGRTMIN + 6  # glibc keeps the first two real-time signals for itself
MAX_PARK_MS = 50
SPIN_WINDOW_S = 0.02
SPIN_SEARCH_INTERVAL_S = 30.0  # NIXL starts its progress thread with the first dispatch
SPIN_MIN_SHARE = 0.1  # of one core over the window; an idle thread is at ~0


def idle_poll_ms() -> float:
    return env_number(ENV_IDLE_POLL_MS, DEFAULT_IDLE_POLL_MS, low=0, unit=" ms")


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "1" if default else "0").strip().lower()
    if raw not in {"0", "1", "false", "true", "no", "yes"}:
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw in {"1", "true", "yes"}


def park_spinners_enabled() -> bool:
    """On by default. It was off for a while because joins went wrong with it on (2 of 4
    stall-hunt runs); the cause turned out to be elsewhere (an idle membership step that ran on
    the joiner but not the others, sglang/scale_progress.py) and with that fixed, parking on
    gave 4 of 4 clean joins (benchmark/hunt_join_stalls.py)."""
    return env_flag(ENV_PARK_SPINNERS, default=True)


def park_spinners_in_forward_enabled() -> bool:
    """On by default; needs parking at idle on too (that is where the spinners are found)."""
    return env_flag(ENV_PARK_SPINNERS_IN_FORWARD, default=True)


def park_spinners_in_connect_enabled() -> bool:
    """On by default; needs parking on (``park_spinners_enabled``: its parker finds them)."""
    return env_flag(ENV_PARK_SPINNERS_IN_CONNECT, default=True)


def spinners_idle_class_enabled() -> bool:
    """Off by default (``SGLANG_EEP_SPINNERS_IDLE_CLASS=1`` turns it on): the spinning native
    threads found (Mooncake's worker) then run in Linux's ``SCHED_IDLE`` class, so under load
    they take only CPU no normal thread wants instead of half a core from the schedulers
    (docs/benchmarks.md, "The cost of elastic mode"). Not the default: in the one CI run with
    it on, three ranks on two cores stalled in the CPU data plane for 30 s right after a
    replacement joined (docs/cpu-testbed.md); a starved worker is the suspect."""
    return env_flag(ENV_SPINNERS_IDLE_CLASS, default=False)


def lower_to_idle_class(tids: list[int]) -> list[int]:
    """Put threads ``tids`` of this process in ``SCHED_IDLE``; the ones it was done for."""
    lowered = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # the thread exited
            continue
        lowered.append(tid)
    return lowered


def thread_park_library_path() -> Path:
    """Built by scripts/setup.sh next to the venv's other native helpers."""
    override = os.environ.get(ENV_THREAD_PARK_LIB)
    return Path(override) if override else Path(sys.prefix) / "eep-native" / "libeep_thread_park.so"


def thread_cpu_ns(tid: int) -> int | None:
    """CPU time of one thread of this process in ns (``schedstat``: ns resolution, unlike
    ``stat``'s 10 ms ticks), or None when the thread is gone."""
    try:
        return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def in_user_space(tid: int) -> bool:
    """Whether thread ``tid`` of this process is outside any system call right now."""
    try:
        return Path(f"/proc/self/task/{tid}/syscall").read_text().startswith("running")
    except OSError:
        return False


def find_spinning_native_threads(
    window_s: float = SPIN_WINDOW_S,
    min_share: float = SPIN_MIN_SHARE,
    wait: Callable[[float], None] = time.sleep,
    samples: int = 4,
) -> list[int]:
    """Threads of this process, not created by Python, that spin while this thread waits:
    outside any system call at every sample, and burning CPU.

    A thread that is merely busy for a moment (a transport thread receiving a peer's writes)
    sits in ``epoll_wait``/``recv`` at some sample and is never chosen: parking it would stall
    the peers. Called only from the idle sleeper, so nothing of ours is in flight; Python
    threads are never candidates. ``wait`` may return early (a request arrived): then the
    search finds nothing.
    """
    python_tids = {t.native_id for t in threading.enumerate()}
    candidates = [
        int(entry) for entry in os.listdir("/proc/self/task")
        if int(entry) not in python_tids
    ]
    before = {tid: thread_cpu_ns(tid) for tid in candidates}
    spinning_samples = dict.fromkeys(candidates, 0)
    started = time.monotonic()
    step = window_s / samples
    for _ in range(samples):
        t = time.monotonic()
        wait(step)
        if time.monotonic() - t < step / 2:
            return []  # cut short: a request is waiting
        for tid in candidates:
            spinning_samples[tid] += in_user_space(tid)
    waited = time.monotonic() - started
    spinning = []
    for tid, start in before.items():
        end = thread_cpu_ns(tid)
        if (
            spinning_samples[tid] == samples
            and start is not None
            and end is not None
            and end - start >= min_share * waited * 1e9
        ):
            spinning.append(tid)
    return spinning


class ThreadParker:
    """Parks chosen threads of this process until ``unpark``; see scripts/native/thread_park.c."""

    def __init__(self, library: Path, max_park_ms: float = MAX_PARK_MS) -> None:
        self.lib = ctypes.CDLL(str(library), use_errno=True)
        self.lib.eep_park_install.argtypes = [ctypes.c_int, ctypes.c_long]
        self.lib.eep_park.argtypes = [ctypes.c_int]
        if self.lib.eep_park_install(int(PARK_SIGNAL), int(max_park_ms * 1000)) != 0:
            raise OSError(ctypes.get_errno(), f"sigaction({int(PARK_SIGNAL)}) failed")
        self.tids: list[int] = []

    def park(self) -> None:
        for tid in list(self.tids):
            if self.lib.eep_park(tid) != 0:  # the thread has exited
                self.tids.remove(tid)

    def keep_parked(self) -> None:
        """Park the threads again unless every one is parked: a park ends by itself after
        ``max_park_ms``, so a long wait calls this on each of its rounds."""
        if self.tids and self.parked_count() < len(self.tids):
            self.park()

    def unpark(self) -> None:
        self.lib.eep_unpark()

    def parked_count(self) -> int:
        return int(self.lib.eep_parked_count())


class ShortPollIdleSleeper:
    """Parks an idle scheduler on its request sockets for at most ``timeout_ms``; finds the
    process's spinning native threads for ``spinners_parked``."""

    def __init__(self, sockets: list[Any], timeout_ms: float, parker: ThreadParker | None,
                 park_in_forward: bool = False) -> None:
        import zmq

        self.poller = zmq.Poller()
        for sock in sockets:
            if isinstance(sock, zmq.Socket):
                self.poller.register(sock, zmq.POLLIN)
        self.timeout_ms = timeout_ms
        self.parker = parker
        self.park_in_forward = park_in_forward
        self.next_search = 0.0

    def wait_on_sockets(self, seconds: float) -> None:
        if self.poller.sockets:
            self.poller.poll(seconds * 1000)
        else:
            time.sleep(seconds)

    def find_spinners(self) -> list[int]:
        """Search for spinning native threads now (waiting on the request sockets, so a request
        cuts it short) and add the new ones to the parker's; those new ones."""
        parker = self.parker
        if parker is None:
            return []
        self.next_search = time.monotonic() + SPIN_SEARCH_INTERVAL_S
        found = [t for t in find_spinning_native_threads(wait=self.wait_on_sockets)
                 if t not in parker.tids]
        if found:
            parker.tids.extend(found)
            if spinners_idle_class_enabled():
                logger.info("idle: native spinning threads %s run in SCHED_IDLE",
                            lower_to_idle_class(found))
        return found

    def maybe_sleep(self) -> None:
        # Spinners appear over time (Mooncake's worker with the first collective, NIXL's
        # progress thread with the first dispatch): look again now and then. Known ones are
        # parked during the search, so only new ones show up.
        if self.parker is not None and time.monotonic() >= self.next_search:
            if self.find_spinners():
                self.parker.park()
                logger.info("idle: parking native spinning threads %s while idle",
                            self.parker.tids)
            return
        self.wait_on_sockets(self.timeout_ms / 1000)


@contextmanager
def spinners_parked(parker: ThreadParker | None) -> Iterator[None]:
    """Keeps the spinning native threads parked while the body runs (it must run no Mooncake
    collective); a no-op without a parker."""
    if parker is None:
        yield
        return
    parker.park()  # the idle sleeper may add threads and park them too
    try:
        yield
    finally:
        parker.unpark()


def _parker(scheduler: Any, in_forward: bool) -> ThreadParker | None:
    """The parker of ``scheduler``'s idle sleeper, if it parks there (idle, or the forward
    pass)."""
    sleeper = getattr(scheduler, "idle_sleeper", None)
    if not isinstance(sleeper, ShortPollIdleSleeper) or (in_forward
                                                         and not sleeper.park_in_forward):
        return None
    return sleeper.parker


def idle_pass(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.on_idle``: Mooncake's spinning worker stays parked through the idle
    housekeeping and sleep. No collective runs here."""
    with spinners_parked(_parker(scheduler, in_forward=False)):
        return original(scheduler, *args, **kwargs)


def forward_pass(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``Scheduler.run_batch``: Mooncake's spinning worker stays parked through the
    forward pass, whose MoE tokens go over NIXL. Were a Mooncake collective ever to run in it,
    it would wait at most ``MAX_PARK_MS`` for the worker."""
    with spinners_parked(_parker(scheduler, in_forward=True)):
        return original(scheduler, *args, **kwargs)


@functools.cache
def process_thread_parker() -> ThreadParker | None:
    """This process's parker, or None when parking is off or its library is missing. One per
    process, shared by the idle sleeper and the CPU EP buffer: the native handler and its park
    flag are process-wide, and the spinners the sleeper finds are the ones the buffer parks."""
    return make_thread_parker()


def make_thread_parker() -> ThreadParker | None:
    if not park_spinners_enabled():
        return None
    library = thread_park_library_path()
    if not library.exists():
        logger.warning("idle: %s missing (run scripts/setup.sh); spinning threads not parked",
                       library)
        return None
    return ThreadParker(library)


def install_idle_sleeper(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``Scheduler.init_idle_sleeper``: a short-poll sleeper for every CPU rank, unless
    the user asked for upstream's own (``--sleep-on-idle``) or disabled ours (0 ms)."""
    if getattr(scheduler, "idle_sleeper", None) is not None:
        return
    timeout = idle_poll_ms()
    if timeout == 0:
        return
    channels = scheduler.ipc_channels
    sockets = [s for s in (channels.recv_from_tokenizer, channels.recv_from_rpc) if s is not None]
    sleeper = ShortPollIdleSleeper(sockets, timeout, process_thread_parker(),
                                   park_spinners_in_forward_enabled())
    scheduler.idle_sleeper = sleeper
    # Mooncake's worker already spins here (it starts with the process groups, before a
    # joiner's admission), and under load a joiner's scheduler may not go idle for a long
    # time: search once now, so its connect wait and forward passes park the worker.
    found = sleeper.find_spinners()
    if found:
        logger.info("idle: found native spinning threads %s at start-up (parked from now on "
                    "wherever parking applies)", found)


def dp_controller_event_loop(controller: Any) -> None:
    """REPLACE ``DataParallelController.event_loop``: upstream drains its socket with NOBLOCK
    reads in an endless loop (a quarter of a core at idle); here it blocks in ``poll`` until a
    request arrives (at most 50 ms, so the soft watchdog is still fed), then drains the same way."""
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    poller = zmq.Poller()
    poller.register(controller.recv_from_tokenizer, zmq.POLLIN)
    while True:
        poller.poll(50)
        while True:
            controller.soft_watchdog.feed()
            try:
                recv_req = dpc.sock_recv(controller.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(recv_req)

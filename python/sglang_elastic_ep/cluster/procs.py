"""Process helpers: free ports, and killing by pid with a hard-kill fallback (never by name)."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """Distinct free ports, held open together so the kernel cannot hand one out twice."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def process_tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(pid: int, grace_s: float = 10.0, hard: bool = False) -> None:
    """SIGTERM ``pid``, its session and its descendants; SIGKILL whatever is left after grace.
    ``hard``: SIGKILL at once (a machine dying).

    A crashed SGLang scheduler can leave the server ignoring SIGTERM, hence the fallback.
    """
    procs = process_tree(pid)
    for sig in (signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(pid, sig)  # the server was started in its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 5.0)
        procs = [p for p in alive if not _is_zombie(p)]  # a zombie waits for its parent only
        if not procs:
            return
    if procs:
        raise RuntimeError(f"processes survived SIGKILL: {[p.pid for p in procs]}")


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid):
            return True
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False

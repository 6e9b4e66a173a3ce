"""Process helpers: free ports, and killing by pid with a hard-kill fallback (never by name)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

# The cluster's ports come from the controller's picker (below the ephemeral range).
from sglang_elastic_ep.controller.launchers.ports import bind_free, listen_ports
from sglang_elastic_ep.controller.launchers.ports import free_port as free_port
from sglang_elastic_ep.controller.launchers.ports import free_port_run as free_port_run
from sglang_elastic_ep.controller.launchers.ports import port_is_free as port_is_free
from sglang_elastic_ep_testbed.cluster.waits import wait_until


def free_ports(count: int) -> list[int]:
    """Distinct free ports, held open together so the kernel cannot hand one out twice."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            bind_free(sock, listen_ports())
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


def off_loopback_sockets(root_pids: Iterable[int]) -> list[str]:
    """Every IP socket of these process trees bound or connected to an address other than
    loopback, as ``pid name laddr -> raddr``: the CPU cluster must have none. A listener on
    the wildcard address (torch's TCPStore, for one) is not counted: it is a connection to
    loopback that the cluster makes, which this checks."""
    def off_loopback(addr: Any) -> bool:
        if not addr or addr.ip in ("0.0.0.0", "::"):
            return False
        ip = ipaddress.ip_address(addr.ip.split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return not (mapped or ip).is_loopback

    found = []
    for root in root_pids:
        for proc in process_tree(root):
            try:
                sockets = proc.net_connections(kind="inet")
                name = proc.name()
            except psutil.Error:
                continue
            found += [f"{proc.pid} {name} {sock.laddr} -> {sock.raddr or '-'}"
                      for sock in sockets if off_loopback(sock.laddr) or off_loopback(sock.raddr)]
    return found


def kill_tree(pid: int, grace_s: float = 10.0, hard: bool = False) -> None:
    """SIGTERM ``pid``, its process group and its descendants; SIGKILL whatever is left after grace.
    ``hard``: SIGKILL at once (a machine dying).

    A crashed SGLang scheduler can leave the server ignoring SIGTERM, hence the fallback.
    """
    procs = process_tree(pid)
    for sig in (signal.SIGKILL,) if hard else (signal.SIGTERM, signal.SIGKILL):
        _signal_tree(pid, procs, sig)
        # A SIGKILLed scheduler can take seconds to exit on two busy cores (its address space
        # is torn down, gigabytes of it): seen over 5 s.
        _, alive = psutil.wait_procs(procs, timeout=grace_s if sig == signal.SIGTERM else 30.0)
        procs = [p for p in alive if not _is_zombie(p)]  # a zombie waits for its parent only
        if not procs:
            return
    if procs:
        raise RuntimeError(f"processes survived SIGKILL: {[p.pid for p in procs]}")


def stop_tree(pid: int) -> None:
    """SIGSTOP ``pid``, its process group and its descendants (``kill_tree`` still ends
    them)."""
    _signal_tree(pid, process_tree(pid), signal.SIGSTOP)


def resume_tree(pid: int) -> None:
    """SIGCONT what ``stop_tree`` stopped."""
    _signal_tree(pid, process_tree(pid), signal.SIGCONT)


def _signal_tree(pid: int, procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to ``procs`` (``pid``'s tree) and to ``pid``'s process group."""
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(pid, sig)  # the server was started in its own process group: pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


def processes_tagged(name: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment holds ``name=value``: a cluster's processes carry its
    own tag, so one that escaped its server's tree (reparented to init) is still found by what
    we gave it, never by a process name."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(name) == value and not _is_zombie(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def processes_in_sessions(sessions: set[int]) -> list[psutil.Process]:
    """Live processes in one of ``sessions`` (session ids: the pids of the servers that lead
    them), wherever they were reparented to."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) in sessions and not _is_zombie(proc):
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``timeout_s``."""
    def gone() -> bool:
        if not psutil.pid_exists(pid):
            return True
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    try:
        return wait_until(gone, timeout_s, f"pid {pid} gone", poll_s=0.1)
    except TimeoutError:
        return False


# The processes of a server worth a stack dump: schedulers, the DP controller, and the server's
# main process (tokenizer + HTTP). Detokenizers and compile workers only add noise.
_DUMPED_TITLES = ("sglang::scheduler", "sglang::data_parallel")


def py_spy() -> str | None:
    """The py-spy next to this interpreter (the project venv installs it), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_stacks(root_pids: Iterable[int], out: Path, tag: str, limit: int = 3000) -> str:
    """py-spy every interesting process under ``root_pids`` into ``out`` (appended) and return
    the text: where a hung cluster is stuck is what a failed e2e most needs to show, and the
    processes are gone once the test tears the cluster down."""
    spy = py_spy()
    if spy is None:
        return "(no stack dump: py-spy is not installed)"
    parts = [f"===== {tag} {time.ctime()}"]
    for root in root_pids:
        for proc in process_tree(root):
            try:
                title = " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if proc.pid != root and not title.startswith(_DUMPED_TITLES):
                continue
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True,
                                      text=True, timeout=60)
                text = dump.stdout or dump.stderr
            except subprocess.TimeoutExpired:
                text = "(py-spy timed out)"
            parts.append(f"--- pid {proc.pid}: {title[:120]}\n{text[:limit]}")
    report = "\n".join(parts) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(report)
    return report

"""A process that has imported SGLang once and forks CPU servers from there.

``python -m sglang.launch_server`` spends most of a CPU server's start importing torch,
transformers and SGLang (about 14 of the 23 s a 2-rank server took to be ready beside a busy
cluster on two cores, docs/cpu-testbed.md, "Servers forked from a pre-imported process").
The e2e suite starts dozens of servers, most of them joiners and replacements whose start is
what a step waits for. The zygote imports what ``sglang.launch_server`` imports, once; each
server is then a fork of it that runs ``sglang.launch_server`` as ``__main__`` with its own
arguments, environment, session and log, exactly as an exec'd one does from there on (the
plugins load in it through their entry points, as upstream's ``__main__`` does).

What differs from an exec'd server, and how the testbed makes up for it:

- its parent is the zygote, not the test: :class:`ForkedServer` stands in for ``Popen``
  (``pid``, ``poll``, ``wait``, ``returncode``); the zygote reaps each server and writes its
  exit status (``Popen``'s convention: ``-N`` for a signal) to a file;
- ``/proc/PID/environ`` shows the zygote's environment, not the server's: stragglers are also
  found by session (each server leads its own);
- whatever a module reads from the environment at import time is the zygote's: the zygote
  starts with the testbed's CPU settings, and the settings that differ per server are read
  when the server runs;
- the plugins load after these imports, not before them: SGLang's hook registry also patches
  the copies other modules imported of a hooked name (it walks ``sys.modules``), so the hooks
  apply alike;
- ``setproctitle`` finds the memory it writes the title to through the environment on its
  first call: the zygote makes that call, before a server replaces its environment.

``SGLANG_EEP_SERVER_START=fork`` starts a testbed server this way; ``exec`` (the default)
runs ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import psutil

from sglang_elastic_ep_testbed.cpu.settings import env_choice

ENV_SERVER_START = "SGLANG_EEP_SERVER_START"
SERVER_START_METHODS = ("exec", "fork")
DEFAULT_SERVER_START = "exec"
SERVER_MODULE = "sglang.launch_server"
# What ``sglang.launch_server`` imports when it runs: the HTTP server pulls in the engine,
# the scheduler and the model modules it names.
SERVER_IMPORTS = ("sglang.launch_server", "sglang.srt.entrypoints.http_server")
# The exit status of a server whose zygote died before it could report one.
LOST_EXIT_STATUS = -255
_REAP_EVERY_S = 0.1


def server_start_method() -> str:
    return env_choice(ENV_SERVER_START, SERVER_START_METHODS, DEFAULT_SERVER_START)


class ZygoteError(RuntimeError):
    """The zygote could not start, or could not fork a server."""


class ForkedServer:
    """What ``subprocess.Popen`` is to an exec'd server, for one the zygote forked."""

    def __init__(self, pid: int, exit_path: Path, zygote: Zygote) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exit_path = exit_path
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._exit_path.read_text())
            except (FileNotFoundError, ValueError):
                if not self._zygote.alive() and not _exists(self.pid):
                    self.returncode = LOST_EXIT_STATUS
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked server pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Zygote:
    """The test's side of one zygote process: starts it, asks it for servers, ends it.

    ``imports``: the modules it imports before forking anything; ``module``: what each server
    runs as ``__main__``. ``env``: the zygote's own environment (what modules read when they
    are imported)."""

    def __init__(self, env: Mapping[str, str], log_path: Path,
                 imports: Sequence[str] = SERVER_IMPORTS, module: str = SERVER_MODULE) -> None:
        self.module = module
        self._exit_dir = Path(tempfile.mkdtemp(prefix="sglang-eep-zygote-"))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self._lock = threading.Lock()
        self._started = 0
        self.popen = subprocess.Popen(
            # Not ``-m`` this module: the package imports it first, and runpy warns of that.
            [sys.executable, "-c", f"import sys; from {__name__} import serve_forks; "
             "serve_forks(sys.argv[1], sys.argv[2:])", module, *imports],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=dict(env), start_new_session=True,
        )
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self._requests: IO[bytes] = self.popen.stdin
        self._replies: IO[bytes] = self.popen.stdout
        reply = self._reply()
        if reply.get("ready") is not True:
            raise ZygoteError(f"the zygote did not start: {reply}")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def fork(self, args: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedServer:
        """A server running ``module`` with ``args`` and exactly ``env``, its output (both
        streams) in ``log_path``, in a session of its own (begun before this returns)."""
        with self._lock:
            self._started += 1
            exit_path = self._exit_dir / f"{self._started}.exit"
            request = {"args": list(args), "env": dict(env), "log": str(log_path),
                       "exit": str(exit_path)}
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
            except OSError as exc:
                raise ZygoteError(f"the zygote is gone ({exc}); its log: {self.log_path}") \
                    from exc
            reply = self._reply()
        if "pid" not in reply:
            raise ZygoteError(f"the zygote could not fork a server: {reply}")
        return ForkedServer(int(reply["pid"]), exit_path, self)

    def _reply(self) -> dict:
        line = self._replies.readline()
        if not line:
            code = self.popen.wait(timeout=30)
            raise ZygoteError(f"the zygote exited with {code}; its log: {self.log_path}")
        return json.loads(line)

    def close(self) -> None:
        """End the zygote. Servers it forked keep running (each in its own session); their
        exit status is read only while it runs (after it, ``LOST_EXIT_STATUS``): their owners
        stop them first."""
        if self.alive():
            self._requests.close()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()


class ZygoteHolder:
    """One zygote per test process, started when the first forked server needs it."""

    def __init__(self) -> None:
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()

    def get(self, env: Mapping[str, str], log_path: Path) -> Zygote:
        with self._lock:
            if self._zygote is None or not self._zygote.alive():
                self._zygote = Zygote(env, log_path)
            return self._zygote

    def close(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None


# --- the zygote process -------------------------------------------------------------------

def serve_forks(module: str, imports: Sequence[str]) -> None:
    """Import ``imports``, then fork a server running ``module`` for each request line on
    stdin until it closes; reap them and write each exit status where its request said."""
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what imports print goes to the zygote's log, not into the replies
    for name in imports:
        __import__(name)
    _set_title(f"sglang-eep zygote for {module}")
    # What each server runs as __main__ runs from its source, as ``python -m`` runs it, not
    # found already imported (its imports stay imported).
    sys.modules.pop(module, None)
    replies.write(json.dumps({"ready": True}).encode() + b"\n")
    exits: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], _REAP_EVERY_S)
        _reap(exits)
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                request = json.loads(line)
                pid = _fork_server(module, request, replies.fileno())
                exits[pid] = request["exit"]
                replies.write(json.dumps({"pid": pid}).encode() + b"\n")
            except Exception as exc:  # the test reads why; the zygote goes on
                replies.write(json.dumps({"error": repr(exc)}).encode() + b"\n")
    _reap(exits)  # the test stops its servers before it closes the zygote


def _reap(exits: dict[int, str]) -> None:
    while exits:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, path)


def _fork_server(module: str, request: dict, replies_fd: int) -> int:
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()  # nothing the zygote buffered ends up in the server's log
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the server
        code = 1
        try:
            os.close(ready_r)
            os.close(replies_fd)
            os.setsid()
            _write_output_to(request["log"])
            os.write(ready_w, b"1")
            os.close(ready_w)
            code = _run_server(module, request)
        finally:
            os._exit(code)
    os.close(ready_w)
    # Its session and its log exist before the test sees its pid, as with Popen, which opens
    # the log in the parent: a test may read the log at once.
    os.read(ready_r, 1)
    os.close(ready_r)
    return pid


def _write_output_to(log_path: str) -> None:
    """Both output streams to ``log_path`` (created or truncated), nothing on stdin."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def _run_server(module: str, request: dict) -> int:
    """Become the server ``request`` describes, running ``module``; its exit status."""
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [module, *request["args"]]
    _set_title(" ".join(["python", "-m", *sys.argv]))
    import runpy

    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, run atexit hooks.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _set_title(title: str) -> None:
    """The process title ``ps`` and ``/proc/PID/cmdline`` show (the testbed finds schedulers by
    theirs). ``setproctitle`` finds the memory it writes to through the environment on its
    first call: the zygote makes that call before a server replaces its environment, and the
    servers and their children inherit what it found."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def _exit_status(code: object) -> int:
    """``sys.exit``'s argument as the process's exit status, as the interpreter maps it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


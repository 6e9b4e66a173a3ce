"""Joiners as server processes on this machine, from a command template.

Each joiner is started in its own session with tags in its environment (deployment, launch
id, ranks, join mode, operation id) and tracked by pid (with its start time, so a reused pid
is never mistaken for it). Stopping one sends SIGTERM to it and its descendants by pid and
SIGKILL to whatever is left after the grace period; nothing is ever found or killed by name.
A restarted controller adopts the joiners of its deployment still running, by their tags.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_fixed

from sglang_elastic_ep.controller.launchers.base import LauncherError, within
from sglang_elastic_ep.controller.launchers.ports import free_joiner_port
from sglang_elastic_ep.controller.launchers.template import Template, TemplateError
from sglang_elastic_ep.core.controller import JoinerSpec, JoinMode, Launch

ENV_DEPLOYMENT = "SGLANG_EEP_DEPLOYMENT"
ENV_LAUNCH_ID = "SGLANG_EEP_LAUNCH_ID"
ENV_RANK_OFFSET = "SGLANG_EEP_RANK_OFFSET"
ENV_NUM_RANKS = "SGLANG_EEP_NUM_RANKS"
ENV_JOIN_MODE = "SGLANG_EEP_JOIN_MODE"
ENV_OPERATION_ID = "SGLANG_EEP_OPERATION_ID"
KEEP_EXITED = 64  # exited joiners remembered (the controller counts failed relaunches)


@dataclass
class _Joiner:
    launch: Launch
    pid: int
    create_time: float
    popen: subprocess.Popen[bytes] | None  # None when adopted from an earlier controller


class LocalLauncher:
    name = "local"

    def __init__(
        self,
        template: Template,
        *,
        deployment: str,
        log_dir: Path,
        dist_init_addr: str | None = None,
        port_base: int | None = None,
        kill_grace_s: float = 30.0,
        env: Mapping[str, str] | None = None,
        adopt: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.template = template
        self.deployment = deployment
        self.log_dir = Path(log_dir)
        self.dist_init_addr = dist_init_addr
        self.port_base = port_base
        self.kill_grace_s = kill_grace_s
        self.env = dict(env or {})
        self._clock = clock
        self._joiners: dict[str, _Joiner] = {}  # by launch id
        # Fail at start-up, not at the first scale-up, on a template that cannot be filled.
        self._argv(JoinerSpec(0, 1, JoinMode.SCALE, "check", 1), port=1)
        if adopt:
            self._adopt()

    # --- Launcher -------------------------------------------------------------------

    def launch_joiner(self, spec: JoinerSpec) -> Launch:
        if self.port_base is not None:
            port = self.port_base + spec.rank_offset
        else:
            port = free_joiner_port()
        argv = self._argv(spec, port)
        launch_id = uuid.uuid4().hex
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / (
            f"{self.deployment}-r{spec.rank_offset}-{spec.mode.value}-{launch_id[:8]}.log"
        )
        env = {
            **os.environ,
            **self.env,
            ENV_DEPLOYMENT: self.deployment,
            ENV_LAUNCH_ID: launch_id,
            ENV_RANK_OFFSET: str(spec.rank_offset),
            ENV_NUM_RANKS: str(spec.num_ranks),
            ENV_JOIN_MODE: spec.mode.value,
            ENV_OPERATION_ID: spec.operation_id,
        }
        with open(log_path, "ab") as log:
            try:
                popen = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )
            except OSError as exc:
                raise LauncherError(f"cannot start {argv[0]!r}: {exc}") from exc
        try:
            create_time = psutil.Process(popen.pid).create_time()
        except psutil.NoSuchProcess:
            create_time = 0.0  # exited at once; popen still knows it
        launch = Launch(
            handle=str(popen.pid), rank_offset=spec.rank_offset, num_ranks=spec.num_ranks,
            mode=spec.mode, operation_id=spec.operation_id, alive=True,
            started_at=self._clock(),
        )
        self._joiners[launch_id] = _Joiner(launch, popen.pid, create_time, popen)
        self._prune()
        return launch

    def launch_replacement(self, spec: JoinerSpec, *, stuck: bool = False) -> Launch:
        for joiner in self._live():
            if within(joiner.launch, spec.ranks):
                self._stop(joiner, hard=stuck)
        return self.launch_joiner(spec)

    def terminate(self, ranks: Collection[int]) -> list[Launch]:
        stopped = []
        for joiner in self._live():
            if within(joiner.launch, ranks):
                self._stop(joiner)
                stopped.append(joiner.launch)
        return stopped

    def list(self) -> list[Launch]:
        for joiner in self._joiners.values():
            if joiner.launch.alive and not self._running(joiner):
                code = joiner.popen.returncode if joiner.popen is not None else None
                joiner.launch = replace(joiner.launch, alive=False, exit_code=code)
        return [j.launch for j in self._joiners.values()]

    # --- internals ------------------------------------------------------------------

    def _argv(self, spec: JoinerSpec, port: int) -> list[str]:
        text = self.template.render_joiner(spec, port=port, dist_init_addr=self.dist_init_addr,
                                          deployment=self.deployment)
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            raise TemplateError(f"{self.template.source} is not a valid command: {exc}") from exc
        if not argv:
            raise TemplateError(f"{self.template.source} renders to an empty command")
        return argv

    def _live(self) -> list[_Joiner]:
        return [j for j in self._joiners.values() if j.launch.alive and self._running(j)]

    def _process(self, joiner: _Joiner) -> psutil.Process | None:
        """The joiner's process, if its pid still names it (same start time), else None."""
        try:
            proc = psutil.Process(joiner.pid)
            if joiner.create_time and abs(proc.create_time() - joiner.create_time) > 0.01:
                return None
            return proc
        except psutil.NoSuchProcess:
            return None

    def _running(self, joiner: _Joiner) -> bool:
        if joiner.popen is not None:
            return joiner.popen.poll() is None  # also reaps it once it exited
        proc = self._process(joiner)
        try:
            return proc is not None and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _stop(self, joiner: _Joiner, hard: bool = False) -> None:
        """SIGTERM the joiner (a server stops its own children and exits 0, as when it
        leaves by itself), then SIGKILL by pid what is left of its tree after the grace;
        ``hard``: SIGKILL at once (a stuck server never finishes a graceful stop)."""
        root = self._process(joiner)
        if root is not None:
            try:
                tree = [root, *root.children(recursive=True)]  # before the parent goes
                if not hard:
                    root.terminate()
            except psutil.NoSuchProcess:
                tree = []
            grace = 0.0 if hard else self.kill_grace_s
            if joiner.popen is not None:  # its own child: popen reaps it and keeps the code
                try:
                    joiner.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            else:
                psutil.wait_procs([root], timeout=grace)
            alive = [proc for proc in tree if _running(proc)]
            for proc in alive:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            # Not the root when it is our child: popen must reap it, or its exit code is lost.
            owned = joiner.popen.pid if joiner.popen is not None else None
            _wait_ended([p for p in alive if p.pid != owned], timeout_s=10)
        if joiner.popen is not None:
            try:
                joiner.popen.wait(timeout=10)
            except subprocess.TimeoutExpired as exc:
                raise LauncherError(f"pid {joiner.pid} survived SIGKILL") from exc
        code = joiner.popen.returncode if joiner.popen is not None else None
        joiner.launch = replace(joiner.launch, alive=False, exit_code=code)

    def _prune(self) -> None:
        exited = [key for key, j in self._joiners.items() if not j.launch.alive]
        for key in exited[: max(0, len(exited) - KEEP_EXITED)]:
            del self._joiners[key]

    def _adopt(self) -> None:
        """Joiners an earlier controller of this deployment started, found by their tags.

        Their descendants (SGLang's scheduler processes) inherit the tags; the joiner is the
        one process of a launch id whose parent does not carry it.
        """
        by_launch: dict[str, list[tuple[psutil.Process, dict[str, str]]]] = {}
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess, OSError):
                continue
            if env.get(ENV_DEPLOYMENT) == self.deployment and ENV_LAUNCH_ID in env:
                by_launch.setdefault(env[ENV_LAUNCH_ID], []).append((proc, env))
        for launch_id, members in by_launch.items():
            pids = {proc.pid for proc, _ in members}
            for proc, env in members:
                try:
                    if proc.ppid() in pids:
                        continue
                    offset = int(env[ENV_RANK_OFFSET])
                    size = int(env[ENV_NUM_RANKS])
                    mode = JoinMode(env[ENV_JOIN_MODE])
                    created = proc.create_time()
                except (KeyError, ValueError, psutil.Error):
                    continue
                launch = Launch(
                    handle=str(proc.pid), rank_offset=offset, num_ranks=size, mode=mode,
                    operation_id=env.get(ENV_OPERATION_ID, ""), alive=True, started_at=created,
                )
                self._joiners[launch_id] = _Joiner(launch, proc.pid, created, None)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_ended(procs: list[psutil.Process], timeout_s: float) -> None:
    """Until each of ``procs`` (not our children) is gone or a zombie: its killed parent's
    orphans wait for an init that may never reap them (a container's PID 1), which
    ``psutil.wait_procs`` would wait out whole."""
    Retrying(stop=stop_after_delay(timeout_s), wait=wait_fixed(0.05),
             retry=retry_if_result(bool), retry_error_callback=lambda _: None)(
        lambda: [proc for proc in procs if _running(proc)])

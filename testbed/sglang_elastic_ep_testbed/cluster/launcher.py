"""Start, stop and kill real SGLang server processes on CPU (one log file per process).

A primary server runs N EP ranks (DP attention, one DP shard per rank). Joiners are separate
server processes started with ``--ep-join-mode scale|recover`` that attach to the primary's
``--dist-init-addr``. Everything started here is tracked by pid and torn down on exit.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psutil

from sglang_elastic_ep.controller.launchers.ports import DERIVED_PORTS, JOINER_PORT_DELTA
from sglang_elastic_ep_testbed.cluster.procs import (
    dump_stacks,
    free_port_run,
    kill_tree,
    process_tree,
    processes_in_sessions,
    processes_tagged,
    resume_tree,
    stop_tree,
)
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.cluster.zygote import ForkedServer, ZygoteHolder, server_start_method
from sglang_elastic_ep_testbed.cpu.shared_host import ENV_SHARED_HOST_NODE
from sglang_elastic_ep_testbed.cpu.start_up_share import favour_start_up

# Environment variable holding a cluster's own tag (see LocalCluster._kill_stragglers).
CLUSTER_TAG_ENV = "SGLANG_EEP_CLUSTER_TAG"

REPO_ROOT = Path(__file__).resolve().parents[3]

# Log lines every busy server writes many times a second, and the C++ frames torch prints
# under each failed TCPStore connect; left out of failure reports.
ROUTINE_LOG_LINE = re.compile(
    r'"(POST /generate|GET /elastic_ep/status|GET /metrics|GET /health)|Prefill batch|'
    r"Decode batch|Ignore import error|is ignored: it is neither|^frame #\d+: |"
    r"^Exception raised from ")
DEFAULT_LOG_DIR = REPO_ROOT / ".cluster" / "logs"
# A few lines per server of each failed scenario, which scripts/test.sh prints last: CI keeps
# only the head and the tail of the suite's output, and the full report sits in its middle.
FAILURE_DIGEST = REPO_ROOT / ".cluster" / "failure-digest.txt"
# Replacements that crashed before they served and were relaunched (a recover step of a plan
# does what an orchestrator restarting failed servers does); scripts/test.sh prints it last
# too, so that a passing suite still shows each such crash.
RELAUNCHED_AFTER_A_CRASH = REPO_ROOT / ".cluster" / "relaunched-after-a-crash.txt"
# What a digest keeps of a server's log: this plugin's lines (its NIXL connects left out),
# Mooncake's evictions, errors.
DIGEST_LOG_LINE = re.compile(r"\[elastic-ep\]|auto_deactivate group|Error|error:|Traceback")
# The line that ends a Python traceback: an exception's name and message. A process that died
# of one logs its own first, then those of the processes above it that it took along: the
# first one is the cause.
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Gone|Exit)(: |$)")
# Shortened in a digest: SGLang's date and parallel ranks before a line (time and DP rank
# kept), glog's prefix (time kept), and the group of a Mooncake eviction (it evicts a rank
# from each group in turn: one line is kept).
DIGEST_SHORTEN = (
    (re.compile(r"^\[\d{4}-\d\d-\d\d (\d\d:\d\d:\d\d)( DP\d+)[^\]]*\] "), r"\1\2 "),
    (re.compile(r"^[IWEF]\d{4} (\d\d:\d\d:\d\d)\.\d+ +\d+ \S+\] "), r"\1 "),
    (re.compile(r"auto_deactivate group=\S+ "), "auto_deactivate "),
)

# Settings every CPU server gets: the CPU engine, UCX on loopback for NIXL, unbuffered logs.
CPU_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "UCX_MODULES": "^ib",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "tcp",
    "PYTHONUNBUFFERED": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    # Several ranks share 2 cores: OpenMP's spinning worker threads in every process would
    # fight each other (a tiny matmul then takes milliseconds). One thread per rank.
    "OMP_NUM_THREADS": "1",
    # NIXL EP dispatches fp8 unless told otherwise; the CPU buffer moves the model's dtype.
    "SGLANG_NIXL_EP_BF16_DISPATCH": "1",
    # SGLang's shared Mooncake transfer engine (which it hands to Mooncake's process groups)
    # listens on this address instead of the machine's first LAN address: every connection
    # of the CPU cluster stays on loopback.
    "SGLANG_HOST_IP": "127.0.0.1",
}


@dataclass
class ClusterSpec:
    """What to launch. ``ep_size`` ranks, each its own DP-attention shard."""

    model_path: Path
    ep_size: int = 2
    max_ep_size: int | None = None
    # Server processes the launch-time ranks are split over (SGLang's --nnodes): with 2, rank
    # ep_size/2.. lives in its own process tree, like a second machine, and can be killed and
    # relaunched in recover mode without taking the primary down.
    nodes: int = 1
    elastic: bool = True  # --elastic-ep-backend mooncake
    moe_a2a_backend: str = "none"
    max_total_tokens: int = 4096
    collective_timeout_s: float = 2.0
    # Well above twice the collective timeout: every survivor must report a death within the
    # window, and one that notices only through Mooncake's link health check (an idle rank) is
    # seconds late (docs/operations.md, "Before launch").
    fault_window_s: float = 10.0
    extra_args: list[str] = field(default_factory=list)
    # Added to every server's environment (a fault to inject, e.g. cpu.fault_injection's).
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = DEFAULT_LOG_DIR
    ready_timeout_s: float = 300.0


def base_server_args(spec: ClusterSpec, port: int) -> list[str]:
    args = [
        "--model-path", str(spec.model_path),
        "--device", "cpu",
        "--dtype", "float32",
        "--attention-backend", "torch_native",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-total-tokens", str(spec.max_total_tokens),
        "--cuda-graph-backend-decode", "disabled",
        "--cuda-graph-backend-prefill", "disabled",
        "--skip-server-warmup",
        # A stuck scheduler stays alive until the scenario's own wait gives up, so the failure
        # report shows its stack (SGLang's 300 s watchdog would kill the server first).
        "--watchdog-timeout", "1800",
    ]
    if spec.ep_size > 1 or spec.max_ep_size:
        args += [
            "--tp", str(spec.ep_size),
            "--ep", str(spec.ep_size),
            "--dp", str(spec.ep_size),
            "--enable-dp-attention",
            "--load-balance-method", "round_robin",
            # Control messages go to every DP leader instead of riding a broadcast over all
            # ranks on every scheduler pass (idle CPU; joiners already work this way).
            "--enable-dp-attention-local-control-broadcast",
        ]
    if spec.elastic:
        args += [
            "--elastic-ep-backend", "mooncake",
            "--elastic-ep-collective-timeout", str(spec.collective_timeout_s),
            "--elastic-ep-fault-window", str(spec.fault_window_s),
        ]
    if spec.max_ep_size:
        # Runtime scale-up needs a DP-local LM head (the launch-time TP group must not span ranks).
        args += ["--max-ep-size", str(spec.max_ep_size), "--enable-dp-lm-head"]
    if spec.moe_a2a_backend != "none":
        args += ["--moe-a2a-backend", spec.moe_a2a_backend]
    if spec.moe_a2a_backend == "nixl":
        args += ["--deepep-mode", "low_latency"]
    return args + list(spec.extra_args)


def server_env(extra_env: dict[str, str], first_rank: int, ranks: int) -> dict[str, str]:
    """What a CPU server of ``ranks`` EP ranks from ``first_rank`` on gets on top of the
    caller's environment: the CPU settings, ``extra_env``, and its cores."""
    env = {**CPU_ENV, **extra_env}
    # One OMP thread set per rank; EP rank r runs on core r mod cores, whichever server
    # holds it, so joiners do not all pile onto core 0.
    ncores = max(1, os.cpu_count() or 1)
    env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
        str((first_rank + i) % ncores) for i in range(ranks)
    )
    return env


class ServerProcess:
    """One ``sglang.launch_server`` process (and its children), started in its own session.

    Its own session gives it its own CPU share under Linux's scheduler autogroups, which slows
    a grown cluster on two cores; one session for all servers is not used: a soak run with it
    had a rank stall 30 s in a pass, cause unknown (docs/cpu-testbed.md, "One session for every
    server of a cluster"). While it starts, its session weighs more
    (``cpu/start_up_share.py``)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        port: int,
        log_dir: Path,
        cpus: int,
        extra_env: dict[str, str] | None = None,
        first_rank: int = 0,
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{name}-{port}.log"
        env = {**os.environ, **server_env(extra_env or {}, first_rank, cpus)}
        # What it was started with (its processes' own /proc environ is overwritten by the
        # titles SGLang sets).
        self.env = env
        # Both start the server in a session of its own: pgid == pid, the cluster signals the
        # group by the pid. A forked server opens its log itself.
        self._log: IO[bytes] | None = None
        self.popen: subprocess.Popen | ForkedServer
        if server_start_method() == "fork":
            zygote = _ZYGOTE.get({**os.environ, **CPU_ENV}, log_dir / f"zygote-{os.getpid()}.log")
            self.popen = zygote.fork(args, env, self.log_path)
        else:
            self._log = open(self.log_path, "wb")
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "sglang.launch_server", *args],
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.pid = self.popen.pid
        favour_start_up(self.pid)
        self.killed = False  # SIGKILLed by the scenario (LocalCluster.kill_server)
        _LIVE.add(self)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def state(self) -> str:
        """"alive", "killed by the scenario", or the code it exited with. A killed server's
        code is not its own: ``kill_tree`` reaps it, and ``Popen`` then reads 0."""
        code = self.popen.poll()
        if code is None:
            return "alive"
        return "killed by the scenario" if self.killed else f"exited with {code}"

    def crashed(self) -> bool:
        """It exited non-zero by itself (not killed by the scenario)."""
        return self.popen.poll() not in (None, 0) and not self.killed

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code once the server exits by itself (a released rank); None on timeout."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_lines(self) -> list[str]:
        """The server's log so far, one string per line ([] before it exists)."""
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_lines()
        # pip's noise about local index paths is not what a failing start needs to show
        text = [line for line in text if "is ignored: it is neither" not in line]
        return "\n".join(text[-lines:])

    def log_events(self, lines: int = 60) -> str:
        """The last ``lines`` log lines that are not routine serving (request, batch and poll
        lines, import noise): what a failed scenario's report shows of each server."""
        kept = [line[:400] for line in self.log_lines() if not ROUTINE_LOG_LINE.search(line)]
        return "\n".join(kept[-lines:])

    def digest(self, lines: int = 4) -> str:
        """One line on the process (``state``) and its last ``lines`` plugin, eviction and
        error lines, each cut short: what the failure digest shows of it."""
        kept: list[str] = []
        for line in self.log_lines():
            if (not DIGEST_LOG_LINE.search(line) or ROUTINE_LOG_LINE.search(line)
                    or "[elastic-ep][nixl]" in line):
                continue
            for pattern, replacement in DIGEST_SHORTEN:
                line = pattern.sub(replacement, line)
            if not kept or kept[-1] != line[:180]:
                kept.append(line[:180])
        # Only an ended server's: a live one's log has the harmless ones of its start-up.
        first = None if self.alive() else self.first_exception()
        cause = [f"  first exception: {first[:180]}"] if first and first[:180] not in \
            kept[-lines:] else []
        return "\n".join([f"{self.name} (pid {self.pid}): {self.state()}", *cause,
                          *(f"  {line}" for line in kept[-lines:])])

    def first_exception(self) -> str | None:
        """The first exception line of the log (``EXCEPTION_LINE``): why a process that died of
        a Python exception died. None when there is none."""
        return next((line for line in self.log_lines() if EXCEPTION_LINE.match(line)), None)

    def wait_ready(self, timeout_s: float, path: str = "/health_generate") -> None:
        """Return once ``path`` answers 200. Raises RuntimeError as soon as the process exits
        (a failed start: not retried) and TimeoutError when it is still not ready after
        ``timeout_s`` (a hung start: LocalCluster retries it once)."""
        with httpx.Client(timeout=5.0) as client:
            def ready() -> bool:
                if not self.alive():
                    raise RuntimeError(
                        f"{self.name} exited with {self.popen.returncode} before ready; log "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    return client.get(self.url + path).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(ready, timeout_s, f"{self.name} ready", poll_s=1.0,
                       describe=lambda: f"log {self.log_path}:\n{self.log_tail()}")

    def scheduler_pids(self) -> dict[int, int]:
        """EP rank -> pid of its scheduler process (read from the process titles SGLang sets)."""
        return self.scheduler_pids_of(self.pid)

    def detach(self) -> None:
        """Let the server outlive this Python process (the hand-driven testbed's ``join``:
        the long-running ``up`` or ``down`` kills it by pid later)."""
        _LIVE.discard(self)

    @staticmethod
    def scheduler_pids_of(pid: int) -> dict[int, int]:
        """EP rank -> scheduler pid among the processes of the server whose leader is ``pid``."""
        ranks: dict[int, int] = {}
        for proc in process_tree(pid):
            try:
                title = " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if not title.startswith("sglang::scheduler"):
                continue
            match = re.search(r"_EP(\d+)", title) or re.search(r"_DP(\d+)", title)
            ranks[int(match.group(1)) if match else 0] = proc.pid
        return ranks

    def stop(self, grace_s: float = 10.0) -> None:
        kill_tree(self.pid, grace_s=grace_s)
        self.popen.wait(timeout=10)
        if self._log is not None:
            self._log.close()
        _LIVE.discard(self)


_LIVE: set[ServerProcess] = set()
# The process forked servers come from (SGLANG_EEP_SERVER_START=fork), one per test process.
_ZYGOTE = ZygoteHolder()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_LIVE):
        try:
            server.stop(grace_s=3.0)
        except Exception:  # best effort at interpreter exit
            pass
    _ZYGOTE.close()  # after the servers: it reports their exits


class LocalCluster:
    """A primary server plus joiners; a context manager that tears everything down."""

    def __init__(self, spec: ClusterSpec) -> None:
        if spec.nodes < 1 or spec.ep_size % spec.nodes:
            raise ValueError(f"{spec.ep_size} ranks do not split over {spec.nodes} nodes")
        self.spec = spec
        self.primary: ServerProcess | None = None
        self.followers: dict[int, ServerProcess] = {}  # node rank -> server (nodes > 1)
        self.joiners: list[ServerProcess] = []
        self._sessions: set[int] = set()  # of every server started: see _kill_stragglers
        self._new_identity()

    @classmethod
    def attach(cls, spec: ClusterSpec, dist_port: int, env: dict[str, str],
               taken_ports: set[int]) -> LocalCluster:
        """A launcher for a cluster another process started (same ports and tag), to add
        joiners and replacement nodes to it."""
        cluster = cls.__new__(cls)
        cluster.spec = spec
        cluster.primary = None
        cluster.followers = {}
        cluster.joiners = []
        cluster._sessions = set()
        cluster.dist_port = dist_port
        cluster.env = dict(env)
        cluster._taken = set(taken_ports)
        return cluster

    def servers(self) -> list[ServerProcess]:
        """The primary, the follower nodes and the joiners started so far."""
        return [s for s in (self.primary, *self.followers.values(), *self.joiners)
                if s is not None]

    def server_pids(self) -> set[int]:
        """Leader pids of the servers this launcher started (it stops them itself)."""
        return {s.pid for s in self.servers()}

    @property
    def taken_ports(self) -> frozenset[int]:
        """Every port this cluster uses or has set aside."""
        return frozenset(self._taken)

    def _new_identity(self) -> None:
        """Ports and tag for a (re)start."""
        # --dist-init-addr's port and the ports SGLang derives from it (+1..+6), kept apart from
        # every other port this cluster picks.
        self.dist_port = free_port_run(DERIVED_PORTS + 1)
        self._taken: set[int] = set(range(self.dist_port, self.dist_port + DERIVED_PORTS + 1))
        # SGLang's global TCPStore (NIXL metadata, scale cohorts) listens on a fixed default
        # port; each cluster gets a free one, shared by its primary and joiners.
        self.env = {**self.spec.extra_env, "SGLANG_TCP_STORE_PORT": str(self._take_port())}
        # Every process of this cluster inherits the tag: stop() finds stragglers by it.
        self.env[CLUSTER_TAG_ENV] = uuid.uuid4().hex

    def _take_port(self, derived_offset: int = 0) -> int:
        """A free port outside this cluster's other ports; with ``derived_offset`` (a
        joiner's HTTP port) the ports SGLang derives at that offset are free and kept too."""
        length = DERIVED_PORTS if derived_offset else 1
        port = free_port_run(length, offset=derived_offset, avoid=self._taken)
        self._taken.add(port)
        if derived_offset:
            self._taken.update(range(port + derived_offset, port + derived_offset + length))
        return port

    def _nccl_port_args(self) -> list[str]:
        """SGLang otherwise picks a random free port for NCCL/Gloo, which can be the
        dist-init port + 1 that the same server binds next ("port_base ... is used by a
        process already": its own). Seen once in a hunt run."""
        return ["--nccl-port", str(self._take_port())]

    @property
    def url(self) -> str:
        assert self.primary is not None, "cluster not started"
        return self.primary.url

    def start(self, wait: bool = True) -> LocalCluster:
        port = self._take_port()
        args = base_server_args(self.spec, port) + self._nccl_port_args()
        if self.spec.elastic or self.spec.nodes > 1:
            args += ["--dist-init-addr", f"127.0.0.1:{self.dist_port}"]
        if self.spec.nodes > 1:
            args += ["--nnodes", str(self.spec.nodes), "--node-rank", "0"]
        ranks_per_node = self.spec.ep_size // self.spec.nodes
        self.primary = self._track(ServerProcess(
            f"primary-ep{self.spec.ep_size}", args, port, self.spec.log_dir, ranks_per_node,
            self.env,
        ))
        for node in range(1, self.spec.nodes):
            self.start_node(node)
        if wait:
            self.primary.wait_ready(self.spec.ready_timeout_s)
        return self

    def start_node(self, node: int, recover: bool = False) -> ServerProcess:
        """Launch node ``node`` of a multi-node primary (no HTTP server of its own); with
        ``recover`` it replaces a dead one (``--ep-join-mode recover``)."""
        if not 1 <= node < self.spec.nodes:
            raise ValueError(f"node must be in [1, {self.spec.nodes}), got {node}")
        old = self.followers.get(node)
        if old is not None and old.alive():
            raise RuntimeError(f"node {node} is still running (pid {old.pid})")
        port = self._take_port()
        args = base_server_args(self.spec, port) + self._nccl_port_args() + [
            "--dist-init-addr", f"127.0.0.1:{self.dist_port}",
            "--nnodes", str(self.spec.nodes), "--node-rank", str(node),
        ]
        if recover:
            args += ["--ep-join-mode", "recover"]
        name = f"node{node}-{'recover' if recover else 'launch'}"
        per_node = self.spec.ep_size // self.spec.nodes
        server = self._track(ServerProcess(
            name, args, port, self.spec.log_dir, per_node,
            {**self.env, ENV_SHARED_HOST_NODE: "1"}, first_rank=node * per_node,
        ))
        self.followers[node] = server
        return server

    def _track(self, server: ServerProcess) -> ServerProcess:
        self._sessions.add(server.pid)
        return server

    def kill_node(self, node: int) -> int:
        """SIGKILL every process of node ``node`` (a machine dying); returns the leader pid."""
        return self.kill_server(self.followers[node])

    @staticmethod
    def kill_server(server: ServerProcess) -> int:
        """SIGKILL every process of one server (a follower node or a joiner); its pid."""
        server.killed = True
        kill_tree(server.pid, hard=True)
        server.popen.wait(timeout=10)
        return server.pid

    @staticmethod
    def stop_server(server: ServerProcess) -> int:
        """SIGSTOP every process of one server: a hung process, alive to the kernel and to its
        open connections but answering nothing; its pid. ``kill_server`` ends it later."""
        stop_tree(server.pid)
        return server.pid

    @staticmethod
    def resume_server(server: ServerProcess) -> None:
        """SIGCONT every process of a server ``stop_server`` stopped: the hang ends."""
        resume_tree(server.pid)

    @staticmethod
    def crash_schedulers(server: ServerProcess, timeout_s: float) -> int | None:
        """SIGKILL only the scheduler processes of one server (a follower node or a joiner), as
        the OOM killer would, and wait for the server to end by itself: its exit code, None if it
        still ran after ``timeout_s``."""
        pids = server.scheduler_pids()
        if not pids:
            raise RuntimeError(f"{server.name} (pid {server.pid}) has no scheduler process")
        server.killed = True
        for pid in pids.values():
            psutil.Process(pid).kill()
        return server.wait_exit(timeout_s)

    def start_joiner(self, mode: str, rank_offset: int, size: int = 1,
                     env: Mapping[str, str] | None = None) -> ServerProcess:
        """Launch a joiner (``--ep-join-mode scale|recover``) for ranks [offset, offset+size),
        with ``env`` added to its environment.

        Joiners for consecutive slots must reach Mooncake in slot order (docs/operations.md).

        ``recover`` replaces a failed joiner: the same command as the original with the other
        mode (the primary's own nodes come back through :meth:`start_node`)."""
        if mode not in ("scale", "recover"):
            raise ValueError(f"join mode must be 'scale' or 'recover', got {mode!r}")
        port = self._take_port(derived_offset=JOINER_PORT_DELTA)
        args = self.joiner_args(mode, str(rank_offset), str(size), str(port))
        joiner = self._track(ServerProcess(
            f"joiner-{mode}-r{rank_offset}", args, port, self.spec.log_dir, size,
            {**self.env, **(env or {})}, first_rank=rank_offset,
        ))
        self.joiners.append(joiner)
        return joiner

    def joiner_args(self, mode: str, rank_offset: str, size: str, port: str) -> list[str]:
        """A joiner's ``sglang.launch_server`` arguments; the values may be a command
        template's placeholders (``{rank_offset}``) for a controller to fill in."""
        args = base_server_args(self.spec, 0) + self._nccl_port_args()
        args[args.index("--port") + 1] = port
        args[args.index("--tp") + 1] = size
        args[args.index("--ep") + 1] = size
        args[args.index("--dp") + 1] = size
        return args + [
            "--dist-init-addr", f"127.0.0.1:{self.dist_port}",
            "--ep-join-mode", mode,
            "--nnodes", "2", "--node-rank", "1",
            "--moe-dense-tp-size", "1",
            "--elastic-ep-join-rank-offset", rank_offset,
            "--elastic-ep-initial-size", str(self.spec.ep_size),
        ]

    def kill_rank(self, ep_rank: int) -> int:
        """SIGKILL the scheduler process of one EP rank of the primary; returns its pid."""
        assert self.primary is not None
        pids = self.primary.scheduler_pids()
        if ep_rank not in pids:
            raise KeyError(f"no scheduler for EP rank {ep_rank}; have {sorted(pids)}")
        psutil.Process(pids[ep_rank]).kill()
        return pids[ep_rank]

    def stop(self) -> None:
        errors = []
        for server in [*self.joiners, *self.followers.values(), self.primary]:
            if server is None:
                continue
            try:
                server.stop()
            except Exception as exc:  # keep tearing down the others
                errors.append(exc)
        self.joiners.clear()
        self.followers.clear()
        self._kill_stragglers()
        if errors:
            raise errors[0]

    def _kill_stragglers(self) -> None:
        """Kill (by pid) any process of this cluster that outlived its server's tree, so the
        next cluster never starts beside a leftover eating the two cores; said loudly, since
        it is a teardown bug worth fixing.

        Found by the tag in their environment, and by session (each server leads one): a
        forked server's environment in /proc is its zygote's."""
        tagged = processes_tagged(CLUSTER_TAG_ENV, self.env[CLUSTER_TAG_ENV])
        found = {p.pid: p for p in [*tagged, *processes_in_sessions(self._sessions)]}
        for proc in found.values():
            try:
                title = " ".join(proc.cmdline())[:120]
            except psutil.Error:
                title = "?"
            print(f"[cluster] straggler pid {proc.pid} ({title}) outlived teardown; killing it")
            kill_tree(proc.pid, hard=True)

    def __enter__(self) -> LocalCluster:
        """Start, or raise after tearing down (``__exit__`` does not run when this raises).

        A launch that hangs (not ready in ``ready_timeout_s``, no process exited) is retried
        once on fresh ports, loudly: the stacks and log tail of the hung one are printed. The
        launch is not what an elastic scenario tests, and CI once saw a launch of the 4-rank
        chain hang (cause unknown: no stacks were taken then); a launch that fails outright is
        not retried."""
        for attempt in (1, 2):
            try:
                return self.start()
            except TimeoutError as exc:
                print(self.dump_stacks(f"cluster start {attempt} hung: {exc}"))
                self.stop()
                if attempt == 2:
                    raise
                print(f"[cluster] start {attempt} hung (stacks above); retrying on fresh ports")
                self._new_identity()
            except BaseException as exc:
                if not isinstance(exc, KeyboardInterrupt):
                    print(self.dump_stacks(f"cluster start failed: {type(exc).__name__}"))
                self.stop()
                raise
        raise AssertionError("unreachable")

    def dump_stacks(self, tag: str, out: Path | None = None) -> str:
        """Stacks of every live server's schedulers, DP controller and main process, appended
        to ``out`` (default ``stacks.txt`` in the log directory; see
        :func:`procs.dump_stacks`)."""
        servers = [s for s in self.servers() if s.alive()]
        return dump_stacks([s.pid for s in servers], out or self.spec.log_dir / "stacks.txt", tag)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 *_: object) -> None:
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            # Printed, so pytest shows it with the failure (CI keeps no log directory).
            for server in self.servers():
                print(f"===== {server.log_path.name} (pid {server.pid}, {server.state()}), "
                      f"less routine lines:\n{server.log_events()}")
            print(self.dump_stacks(f"cluster torn down after {exc_type.__name__}"))
            self.write_failure_digest(exc)
        self.stop()

    def write_failure_digest(self, exc: BaseException | None) -> None:
        """Append this cluster's digest to ``FAILURE_DIGEST`` (see there), headed by the
        failure: its type and the start of its message (a scenario rerun after it keeps no
        other trace of it)."""
        what = "failure" if exc is None else type(exc).__name__ + (
            f": {str(exc)[:300]}" if str(exc) else "")
        _append_for_this_test(FAILURE_DIGEST, what,
                              "\n".join(server.digest() for server in self.servers()))


def note_crash_relaunch(what: str, digest: str) -> None:
    """Append one relaunch after a crash, with the crashed server's digest, to
    ``RELAUNCHED_AFTER_A_CRASH``."""
    _append_for_this_test(RELAUNCHED_AFTER_A_CRASH, what, digest)


def _append_for_this_test(path: Path, what: str, body: str) -> None:
    """Append ``== <the running test>: <what>`` and ``body`` to the report at ``path``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(f"== {test}: {what}\n{body}\n")

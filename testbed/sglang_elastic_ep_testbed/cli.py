"""``sglang-eep testbed``: a CPU cluster to drive by hand (curl, the CLI).

``up`` starts the cluster and stays in the foreground, printing its URL, pids and log paths;
``join``, ``kill``, ``recover`` and ``down`` act on it from another terminal. They share one
state file (``<state-dir>/state.json``, under a lock): which server process holds which EP
ranks, and the cluster's ports. Every process is tracked by pid and killed by pid.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from sglang_elastic_ep_testbed.cluster.launcher import ClusterSpec, LocalCluster, ServerProcess
from sglang_elastic_ep_testbed.cluster.procs import kill_tree
from sglang_elastic_ep_testbed.cluster.waits import wait_until
from sglang_elastic_ep_testbed.tiny_model import DEFAULT_DIR, write_tiny_model

DEFAULT_STATE_DIR = Path(".cluster") / "testbed"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class TestbedError(Exception):
    """A refusal with the action that works from this state."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class ServerRecord:
    """One server process of the testbed and the EP ranks it holds."""

    name: str
    pid: int
    ranks: list[int]
    role: str  # "primary" | "node" | "joiner"
    log: str
    node: int | None = None

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


@dataclass
class TestbedState:
    up_pid: int
    url: str
    dist_port: int
    env: dict[str, str]
    taken_ports: list[int]
    spec: dict[str, Any]
    servers: list[ServerRecord] = field(default_factory=list)

    def owner_of(self, rank: int) -> ServerRecord:
        for server in reversed(self.servers):  # the newest record for a slot wins
            if rank in server.ranks:
                return server
        known = sorted({r for s in self.servers for r in s.ranks})
        raise TestbedError(f"no server holds EP rank {rank} (known ranks {known}); "
                           f"`sglang-eep testbed join --rank {rank}` starts one")


class StateFile:
    """The state shared by ``up`` and the other subcommands, read and written under a lock."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / "state.json"
        self._lock_path = directory / "state.lock"

    @contextmanager
    def locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def read(self) -> TestbedState | None:
        if not self.path.exists():
            return None
        raw = json.loads(self.path.read_text())
        raw["servers"] = [ServerRecord(**s) for s in raw["servers"]]
        return TestbedState(**raw)

    def write(self, state: TestbedState) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=1))
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def require(self) -> TestbedState:
        state = self.read()
        if state is None or not psutil.pid_exists(state.up_pid):
            raise TestbedError(f"no testbed is up (state {self.path}); start one with "
                               "`sglang-eep testbed up --ranks 2 --max 4`")
        return state


def _spec_from(state: TestbedState) -> ClusterSpec:
    fields = dict(state.spec)
    fields["model_path"] = Path(fields["model_path"])
    fields["log_dir"] = Path(fields["log_dir"])
    return ClusterSpec(**fields)


def _cluster_from(state: TestbedState) -> LocalCluster:
    """A launcher bound to the running cluster's ports and tag (to start joiners and nodes)."""
    return LocalCluster.attach(_spec_from(state), state.dist_port, state.env,
                               set(state.taken_ports))


def _record(server: ServerProcess, ranks: list[int], role: str,
            node: int | None = None) -> ServerRecord:
    return ServerRecord(server.name, server.pid, ranks, role, str(server.log_path), node)


def _servers_table(state: TestbedState) -> Table:
    table = Table(title=f"testbed at {state.url}")
    for column in ("server", "pid", "EP ranks", "alive", "log"):
        table.add_column(column)
    for server in state.servers:
        table.add_row(server.name, str(server.pid), ",".join(map(str, server.ranks)),
                      "yes" if server.alive() else "no", server.log)
    return table


# ------------------------------------------------------------------------------ subcommands


def cmd_up(args: argparse.Namespace, console: Console) -> int:
    store = StateFile(args.state_dir)
    with store.locked():
        old = store.read()
        if old is not None and psutil.pid_exists(old.up_pid):
            raise TestbedError(f"a testbed is already up (pid {old.up_pid}, {old.url}); "
                               "`sglang-eep testbed down` stops it")
        store.remove()
    if args.ranks < 2:
        raise TestbedError("--ranks must be at least 2 (DP attention needs two ranks)")
    if args.max is not None and args.max < args.ranks:
        raise TestbedError(f"--max {args.max} is below --ranks {args.ranks}")
    if args.ranks % args.nodes:
        raise TestbedError(f"--ranks {args.ranks} does not split over --nodes {args.nodes}")
    model = Path(args.model) if args.model else DEFAULT_DIR
    if not (model / "config.json").exists():
        console.print(f"writing the tiny model to {model}")
        write_tiny_model(model)
    spec = ClusterSpec(model_path=model, ep_size=args.ranks, max_ep_size=args.max,
                       nodes=args.nodes, moe_a2a_backend=args.a2a,
                       log_dir=args.state_dir.resolve() / "logs")
    console.print(f"starting {args.ranks} ranks (max {args.max}); about a minute on 2 cores")
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with LocalCluster(spec) as cluster:
        assert cluster.primary is not None
        per_node = args.ranks // args.nodes
        servers = [_record(cluster.primary, list(range(per_node)), "primary", 0)]
        servers += [_record(s, list(range(n * per_node, (n + 1) * per_node)), "node", n)
                    for n, s in cluster.followers.items()]
        state = TestbedState(
            up_pid=os.getpid(), url=cluster.url, dist_port=cluster.dist_port,
            env=dict(cluster.env), taken_ports=sorted(cluster.taken_ports), spec={
                "model_path": str(model), "ep_size": args.ranks, "max_ep_size": args.max,
                "nodes": args.nodes, "moe_a2a_backend": args.a2a,
                "log_dir": str(spec.log_dir),
            }, servers=servers)
        with store.locked():
            store.write(state)
        console.print(_servers_table(state))
        console.print(f"[bold green]up[/]: {cluster.url}   (Ctrl-C or `sglang-eep testbed down`"
                      f" stops it; state {store.path})")
        console.print(f"  curl {cluster.url}/elastic_ep/status\n"
                      f"  sglang-eep status --url {cluster.url}")
        try:
            stop.wait()
        finally:
            console.print("stopping the testbed")
            with store.locked():
                final = store.read() or state
                # servers started by `join`/`recover` belong to other (finished) CLI processes
                for server in final.servers:
                    if server.alive() and server.pid not in cluster.server_pids():
                        kill_tree(server.pid, hard=True)
    # removed last: `down` waits for this file to go, so it returns once everything is stopped
    with store.locked():
        store.remove()
    console.print("down")
    return EXIT_OK


def cmd_join(args: argparse.Namespace, console: Console) -> int:
    store = StateFile(args.state_dir)
    with store.locked():
        state = store.require()
        taken = {r for s in state.servers if s.alive() for r in s.ranks}
        rank = args.rank if args.rank is not None else max(taken) + 1
        ranks = list(range(rank, rank + args.size))
        clash = sorted(taken & set(ranks))
        if clash:
            raise TestbedError(f"EP ranks {clash} are held by live servers; join into free "
                               f"slots, e.g. `sglang-eep testbed join --rank {max(taken) + 1}`")
        limit = state.spec.get("max_ep_size")
        if limit is not None and ranks[-1] >= limit:
            raise TestbedError(f"slot {ranks[-1]} is beyond --max {limit}; join below it")
        record = _start(state, "scale", ranks)
        store.write(state)
    console.print(f"joiner for EP ranks {ranks}: pid {record.pid}, log {record.log}")
    console.print(f"when it has registered, grow: curl -X POST {state.url}/scale_elastic_ep "
                  f"-d '{{\"new_ep_size\": {ranks[-1] + 1}}}'")
    return EXIT_OK


def _start(state: TestbedState, mode: str, ranks: list[int]) -> ServerRecord:
    """Start a joiner (``scale``/``recover``) for ``ranks`` and record it in ``state``."""
    cluster = _cluster_from(state)
    server = cluster.start_joiner(mode, ranks[0], len(ranks))
    server.detach()  # it outlives this CLI process; `up` and `down` kill it by pid
    record = _record(server, ranks, "joiner")
    state.servers.append(record)
    state.taken_ports = sorted(cluster.taken_ports)
    return record


def cmd_kill(args: argparse.Namespace, console: Console) -> int:
    store = StateFile(args.state_dir)
    with store.locked():
        state = store.require()
        server = state.owner_of(args.rank)
        if not server.alive():
            raise TestbedError(f"EP rank {args.rank} ({server.name}, pid {server.pid}) is not "
                               f"running; `sglang-eep testbed recover {args.rank}` relaunches it")
        if len(server.ranks) > 1:
            pid = _scheduler_pid(server, args.rank)
            psutil.Process(pid).kill()
            what = f"scheduler of EP rank {args.rank} (pid {pid}) inside {server.name}"
        else:
            kill_tree(server.pid, hard=True)
            what = f"{server.name} (pid {server.pid}, EP rank {args.rank})"
    console.print(f"SIGKILL sent to the {what}")
    return EXIT_OK


def _scheduler_pid(server: ServerRecord, rank: int) -> int:
    found = ServerProcess.scheduler_pids_of(server.pid)
    if rank not in found:
        raise TestbedError(f"no scheduler process for EP rank {rank} under pid {server.pid} "
                           f"(found ranks {sorted(found)})", EXIT_FAILED)
    return found[rank]


def cmd_recover(args: argparse.Namespace, console: Console) -> int:
    store = StateFile(args.state_dir)
    with store.locked():
        state = store.require()
        server = state.owner_of(args.rank)
        if server.role == "primary":
            raise TestbedError(
                f"EP rank {args.rank} runs inside the primary server, which cannot relaunch one "
                "of its ranks; start the testbed with `--nodes N` to give each node its own "
                "process, or remove the rank: POST /scale_elastic_ep with a smaller size")
        if server.alive():
            raise TestbedError(f"EP rank {args.rank} is running ({server.name}, pid "
                               f"{server.pid}); `sglang-eep testbed kill {args.rank}` first")
        if server.role == "node":
            assert server.node is not None
            cluster = _cluster_from(state)
            started = cluster.start_node(server.node, recover=True)
            started.detach()
            record = _record(started, server.ranks, "node", server.node)
            state.servers.append(record)
            state.taken_ports = sorted(cluster.taken_ports)
        else:
            record = _start(state, "recover", server.ranks)
        store.write(state)
    console.print(f"replacement for EP ranks {record.ranks}: pid {record.pid}, log {record.log}"
                  f"; watch `curl {state.url}/elastic_ep/status`")
    return EXIT_OK


def cmd_down(args: argparse.Namespace, console: Console) -> int:
    store = StateFile(args.state_dir)
    state = store.read()
    if state is None:
        console.print("no testbed is up")
        return EXIT_OK
    if psutil.pid_exists(state.up_pid):
        os.kill(state.up_pid, signal.SIGTERM)
        try:
            wait_until(lambda: not store.path.exists(), 120, "the testbed to stop", poll_s=0.5)
            console.print("down")
            return EXIT_OK
        except TimeoutError:
            console.print(f"`up` (pid {state.up_pid}) did not stop in 120 s; killing by pid")
    for server in state.servers:
        if server.alive():
            kill_tree(server.pid, hard=True)
    if psutil.pid_exists(state.up_pid):
        kill_tree(state.up_pid, hard=True)
    store.remove()
    console.print("down (killed)")
    return EXIT_OK


def cmd_show(args: argparse.Namespace, console: Console) -> int:
    console.print(_servers_table(StateFile(args.state_dir).require()))
    return EXIT_OK


# ---------------------------------------------------------------------------------- parser


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def add_parser(sub: Any) -> None:
    """Entry point (group ``sglang_elastic_ep.cli``): adds ``sglang-eep testbed``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                        help=f"where the testbed keeps its state and logs (default "
                             f"{DEFAULT_STATE_DIR})")
    testbed = sub.add_parser("testbed", help="a CPU cluster to drive by hand (CPU testbed)")
    verbs = testbed.add_subparsers(dest="testbed_command", required=True)
    up = verbs.add_parser("up", parents=[common], help="start a CPU cluster; stays in the "
                          "foreground (Ctrl-C stops it)")
    up.add_argument("--ranks", type=_at_least(2), default=2, help="EP ranks at launch")
    up.add_argument("--max", type=_at_least(2), default=None, help="--max-ep-size")
    up.add_argument("--nodes", type=_at_least(1), default=1,
                    help="server processes the launch ranks are split over (a node's ranks "
                         "can then be killed and recovered)")
    up.add_argument("--a2a", choices=("none", "nixl"), default="nixl",
                    help="--moe-a2a-backend (scale-up needs nixl)")
    up.add_argument("--model", help="model directory (default: the tiny model, written if "
                    "missing)")
    join = verbs.add_parser("join", parents=[common], help="start a scale joiner")
    join.add_argument("--rank", type=_at_least(1), default=None,
                      help="first EP slot (default: the next one after every live rank)")
    join.add_argument("--size", type=_at_least(1), default=1, help="EP ranks it holds")
    kill = verbs.add_parser("kill", parents=[common], help="SIGKILL one EP rank")
    kill.add_argument("rank", type=_at_least(0))
    recover = verbs.add_parser("recover", parents=[common],
                               help="relaunch a killed rank with --ep-join-mode recover")
    recover.add_argument("rank", type=_at_least(0))
    verbs.add_parser("down", parents=[common], help="stop the testbed")
    verbs.add_parser("show", parents=[common], help="list its servers")
    testbed.set_defaults(handler=_run)


def _run(args: argparse.Namespace, console: Console) -> int:
    """Runs the chosen verb, turning refusals into their message and exit code."""
    handler = {
        "up": cmd_up, "join": cmd_join, "kill": cmd_kill, "recover": cmd_recover,
        "down": cmd_down, "show": cmd_show,
    }[args.testbed_command]
    try:
        return handler(args, console)
    except TestbedError as exc:
        Console(stderr=True).print(f"[bold red]error[/]: {exc}", highlight=False)
        return exc.code


def wait_for_state(state_dir: Path, timeout_s: float) -> TestbedState:
    """The state once ``up`` has written it (for scripts and tests driving the testbed)."""
    store = StateFile(state_dir)
    return wait_until(store.read, timeout_s, f"testbed state in {store.path}", poll_s=1.0)


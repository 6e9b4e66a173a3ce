"""The controller's I/O: follow the server, feed ``ElasticController``, carry out its actions.

One thread follows ``GET /elastic_ep/events`` (SSE; it reconnects with ``Last-Event-ID`` and
replays a new server instance's buffer from the start) and wakes the main loop; the main
loop, on every event and at least every ``poll_interval_s``, reads the status, the health and
the load (``/metrics``), asks the launcher what it runs, decides and acts. At start the event
buffer is read once (``follow=false``) so that failure counts survive a controller restart.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential,
)

from sglang_elastic_ep.controller.launchers.base import Launcher, LauncherError
from sglang_elastic_ep.controller.launchers.template import TemplateError
from sglang_elastic_ep.controller.load import parse_load
from sglang_elastic_ep.core.api_models import (
    EVENT_ADAPTER,
    HealthResponse,
    StatusResponse,
)
from sglang_elastic_ep.core.controller import (
    Action,
    CancelScale,
    Decision,
    ElasticController,
    Hold,
    Launch,
    LaunchJoiner,
    LoadReading,
    Relaunch,
    ScaleTo,
    Terminate,
)

SCALE_PATH = "/scale_elastic_ep"
STATUS_PATH = "/elastic_ep/status"
EVENTS_PATH = "/elastic_ep/events"
HEALTH_PATH = "/elastic_ep/health"
METRICS_PATH = "/metrics"
ONCE_PASSES = 4  # --once: POST, launch the joiners, and a pass that finds nothing left
MAX_PASSES_AT_ONCE = 4  # passes without waiting after actions that went through


@dataclass(frozen=True)
class LoopSettings:
    url: str
    api_key: str | None = None
    metrics_urls: tuple[str, ...] = ()  # default: the server's own /metrics
    poll_interval_s: float = 5.0
    http_timeout_s: float = 10.0
    read_timeout_s: float = 60.0  # an event stream silent this long is reopened
    retries: int = 3  # per request, on network errors
    dry_run: bool = False
    json_log: bool = False


class ServerUnavailable(Exception):
    pass


class StreamRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)
    return str(body)


def _instance_of(message: ServerSentEvent) -> str | None:
    try:
        data = json.loads(message.data)
    except ValueError:
        return None
    value = data.get("instance_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


class EventFollower:
    """Follows the event stream and hands every message to ``deliver``, in order.

    It resumes after the last event id it delivered. When a message comes from another
    server instance than the previous ones (the server restarted), it reconnects from id 0,
    so the new instance's whole buffer is delivered from its start.
    """

    def __init__(
        self,
        client: httpx.Client,
        deliver: Callable[[ServerSentEvent], None],
        *,
        stop: threading.Event,
        on_problem: Callable[[str], None] = lambda _: None,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.client = client
        self.deliver = deliver
        self.stop = stop
        self.on_problem = on_problem
        self._sleep = sleep or stop.wait
        self.last_event_id = "0"
        self.instance_id: str | None = None
        self.retry_s = 2.0
        self.connections = 0

    def read_backlog(self) -> int:
        """Deliver what the server buffers after ``last_event_id`` now, and return (no follow)."""
        return self._connect(follow=False)

    def connect_once(self) -> int:
        """One followed connection, until the server or the network ends it."""
        return self._connect(follow=True)

    def _connect(self, *, follow: bool) -> int:
        self.connections += 1
        headers = {"Accept": "text/event-stream", "Last-Event-ID": self.last_event_id}
        params = {"follow": "true" if follow else "false"}
        delivered = 0
        with self.client.stream("GET", EVENTS_PATH, headers=headers, params=params) as response:
            if response.status_code != 200:
                response.read()
                raise StreamRefused(response.status_code, _message(response))
            for message in EventSource(response).iter_sse():
                if message.retry is not None:
                    self.retry_s = message.retry / 1000
                if not message.data:  # the opening block: retry and a comment
                    continue
                instance = _instance_of(message)
                if instance is not None and instance != self.instance_id:
                    if self.instance_id is not None and self.last_event_id != "0":
                        # Ids restart with every instance: replay this one from its start.
                        self.instance_id = instance
                        self.last_event_id = "0"
                        return delivered
                    self.instance_id = instance
                self.deliver(message)
                delivered += 1
                if message.id:
                    self.last_event_id = message.id
                if self.stop.is_set():
                    break
        return delivered

    def run(self) -> None:
        """Follow until ``stop`` is set: reconnect after the server's retry delay, and back
        off exponentially (up to 30 s) while connections fail."""

        def problem(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self.on_problem(f"event stream: {exc}; reconnecting after event {self.last_event_id}")

        while not self.stop.is_set():
            retrying = Retrying(
                retry=retry_if_exception_type((httpx.HTTPError, StreamRefused)),
                wait=wait_exponential(multiplier=self.retry_s, min=self.retry_s, max=30.0),
                stop=stop_when_event_set(self.stop),
                sleep=self._sleep,
                before_sleep=problem,
                reraise=True,
            )
            try:
                retrying(self.connect_once)
            except Exception as exc:  # noqa: BLE001 - the follower must outlive any one error
                if self.stop.is_set():
                    return  # stopping: the client was closed under the read
                self.on_problem(f"event stream: {type(exc).__name__}: {exc}")
            if not self.stop.is_set():
                self._sleep(self.retry_s)  # the server closed a followed stream


class DecisionLog:
    """Prints decisions with their inputs (holds only when they change) and outcomes."""

    def __init__(self, console: Console, *, json_log: bool, dry_run: bool,
                 clock: Callable[[], float] = time.time) -> None:
        self.console = console
        self.json_log = json_log
        self.dry_run = dry_run
        self._clock = clock
        self._last_holds: tuple[str, ...] = ()
        self._last_dry: tuple[str, ...] = ()  # a dry run repeats its actions: print changes
        self._last_problems: set[str] = set()

    def decision(self, decision: Decision) -> None:
        holds = tuple(_shape(h.reason) for h in decision.holds)
        if holds != self._last_holds:
            for hold in decision.holds:
                self._emit("hold", hold.reason, hold.inputs, style="dim")
            self._last_holds = holds
        actions = decision.actions
        if self.dry_run:
            shown = tuple(_shape(describe(a)[1]) for a in actions)
            if shown == self._last_dry:
                actions = ()
            self._last_dry = shown
        for action in actions:
            kind, summary = describe(action)
            prefix = "would " if self.dry_run else ""
            self._emit(kind, f"{prefix}{summary}: {action.reason}", action.inputs,
                       style="bold yellow" if self.dry_run else "bold cyan",
                       extra={"dry_run": self.dry_run, **_action_fields(action)})

    def outcome(self, what: str, ok: bool, **fields: Any) -> None:
        self._emit("result", what, {}, style="green" if ok else "bold red",
                   extra={"ok": ok, **fields})

    def problem(self, key: str, message: str) -> None:
        """A failing read, said once until it changes."""
        shaped = f"{key}:{_shape(message)}"
        if shaped in self._last_problems:
            return
        self._last_problems = {p for p in self._last_problems if not p.startswith(f"{key}:")}
        self._last_problems.add(shaped)
        self._emit("problem", message, {}, style="yellow")

    def resolved(self, key: str) -> None:
        self._last_problems = {p for p in self._last_problems if not p.startswith(f"{key}:")}

    def info(self, message: str) -> None:
        self._emit("info", message, {}, style="")

    def _emit(self, kind: str, message: str, inputs: Mapping[str, Any], *, style: str,
              extra: Mapping[str, Any] | None = None) -> None:
        now = self._clock()
        if self.json_log:
            record = {"time": round(now, 3), "type": kind, "message": message, **(extra or {})}
            if inputs:
                record["inputs"] = dict(inputs)
            self.console.print(json.dumps(record, default=str), markup=False, highlight=False,
                               soft_wrap=True)
            return
        line = Text(time.strftime("%H:%M:%S ", time.localtime(now)))
        line.append(f"{kind:<9}", style=style or None)
        line.append(message)
        if inputs:
            line.append("  " + " ".join(f"{k}={v}" for k, v in inputs.items()), style="dim")
        self.console.print(line, soft_wrap=True)


def describe(action: Action) -> tuple[str, str]:
    if isinstance(action, ScaleTo):
        return "scale", f"POST new_ep_size={action.target} ({action.operation_id})"
    if isinstance(action, LaunchJoiner):
        s = action.spec
        return "launch", f"launch joiner for rank(s) {_span(s.ranks)} ({s.operation_id})"
    if isinstance(action, Relaunch):
        s = action.spec
        return "relaunch", (f"relaunch rank(s) {_span(s.ranks)} in recover mode "
                            f"({s.operation_id})")
    if isinstance(action, CancelScale):
        return "cancel", f"DELETE {SCALE_PATH}/{action.operation_id}"
    return "terminate", f"terminate rank(s) {_span(action.ranks)}"


def _action_fields(action: Action) -> dict[str, Any]:
    if isinstance(action, ScaleTo):
        return {"action": "scale", "target": action.target, "operation_id": action.operation_id,
                "purpose": action.purpose.value}
    if isinstance(action, LaunchJoiner):
        s = action.spec
        return {"action": "launch", "rank_offset": s.rank_offset, "num_ranks": s.num_ranks,
                "join_mode": s.mode.value, "operation_id": s.operation_id}
    if isinstance(action, Relaunch):
        s = action.spec
        return {"action": "relaunch", "rank_offset": s.rank_offset, "num_ranks": s.num_ranks,
                "join_mode": s.mode.value, "operation_id": s.operation_id,
                "stuck": action.stuck}
    if isinstance(action, CancelScale):
        return {"action": "cancel", "operation_id": action.operation_id}
    return {"action": "terminate", "ranks": list(action.ranks)}


def _span(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _shape(text: str) -> str:
    """A message with its numbers masked: holds that only count down print once."""
    return re.sub(r"\d+(\.\d+)?", "#", text)


class ControllerLoop:
    def __init__(
        self,
        controller: ElasticController,
        launcher: Launcher,
        settings: LoopSettings,
        *,
        console: Console | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], object] | None = None,
    ) -> None:
        self.controller = controller
        self.launcher = launcher
        self.settings = settings
        self.stop = threading.Event()
        self._clock = clock
        self._sleep = sleep or self.stop.wait
        self.log = DecisionLog(console or Console(), json_log=settings.json_log,
                               dry_run=settings.dry_run, clock=clock)
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.client = httpx.Client(
            base_url=settings.url, headers=headers, timeout=settings.http_timeout_s,
            transport=transport, trust_env=False,
        )
        # Other servers' /metrics (joiners) get no API key: SGLang serves /metrics without one.
        self.metrics_client = httpx.Client(
            timeout=settings.http_timeout_s, transport=transport, trust_env=False,
        )
        self.events_client = httpx.Client(
            base_url=settings.url, headers=headers, transport=transport, trust_env=False,
            timeout=httpx.Timeout(settings.http_timeout_s, read=settings.read_timeout_s),
        )
        self._inbox: queue.SimpleQueue[ServerSentEvent] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.follower = EventFollower(
            self.events_client, self._deliver, stop=self.stop,
            on_problem=lambda m: self.log.problem("events", m), sleep=self._sleep,
        )
        self._thread: threading.Thread | None = None
        # The last pass acted and every action went through (else wait: no tight retry loop).
        self._acted_ok = False
        self._running_handles: set[str] = set()  # joiners seen running at the last pass

    # --- running --------------------------------------------------------------------

    def prime(self) -> None:
        """Read the server's event buffer once, so failure counts resume where they were."""
        try:
            self.follower.read_backlog()
        except (httpx.HTTPError, StreamRefused) as exc:
            self.log.problem("events", f"cannot read the event buffer: {exc}")

    def run(self, *, once: bool = False) -> None:
        """Decide and act until ``stop`` is set; ``once``: until nothing more is to be done
        right now (a scale-up's POST, then its joiners), at most a few passes."""
        self.prime()
        if once:
            for _ in range(ONCE_PASSES):
                decision = self.tick()
                if not decision.actions or self.settings.dry_run:
                    return
            return
        self._thread = threading.Thread(target=self.follower.run, name="eep-events",
                                        daemon=True)
        self._thread.start()
        try:
            at_once = 0
            while not self.stop.is_set():
                self.tick()
                if self._acted_ok and at_once < MAX_PASSES_AT_ONCE:
                    at_once += 1
                    continue  # look again at once: the server's answer moves things on
                at_once = 0
                self._wake.wait(self.settings.poll_interval_s)
                self._wake.clear()
        finally:
            self.close()

    def request_stop(self) -> None:
        """Stop after the current step (safe from a signal handler)."""
        self.stop.set()
        self._wake.set()

    def close(self) -> None:
        self.stop.set()
        self._wake.set()
        # Closing the stream's client ends a read that would otherwise wait for the next event.
        self.events_client.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.client.close()
        self.metrics_client.close()

    def _deliver(self, message: ServerSentEvent) -> None:
        self._inbox.put(message)
        self._wake.set()

    # --- one step -------------------------------------------------------------------

    def tick(self) -> Decision:
        self._acted_ok = False
        self._drain_events()
        try:
            status = self._status()
        except ServerUnavailable as exc:
            self.log.problem("status", f"cannot read the status: {exc}")
            return Decision(holds=(Hold(f"cannot read the status: {exc}"),))
        self.log.resolved("status")
        self.controller.observe_status(status)
        self.controller.observe_health(self._health())
        self.controller.observe_load(self._load())
        try:
            launches = self.launcher.list()
        except LauncherError as exc:
            # Deciding without knowing what runs could start a second joiner for a slot.
            self.log.problem("launcher", f"cannot list what the launcher runs: {exc}")
            return Decision(holds=(Hold(f"cannot list the launcher's joiners: {exc}"),))
        self.log.resolved("launcher")
        self._report_ended(launches)
        self.controller.observe_launches(launches)
        decision = self.controller.decide(self._clock())
        self.log.decision(decision)
        results = []
        for action in decision.actions:
            if self.settings.dry_run:
                if isinstance(action, ScaleTo):
                    self.controller.observe_scale_answer(action.operation_id, accepted=False)
                continue
            results.append(self._execute(action, status))
        self._acted_ok = bool(results) and all(results)
        return decision

    def _report_ended(self, launches: list[Launch]) -> None:
        """Say once when a joiner this controller saw running has ended, with its exit code."""
        running = {launch.handle for launch in launches if launch.alive}
        for launch in launches:
            if not launch.alive and launch.handle in self._running_handles:
                code = "unknown" if launch.exit_code is None else str(launch.exit_code)
                self.log.outcome(
                    f"joiner {launch.handle} for rank(s) {_span(launch.ranks)} exited with "
                    f"code {code}", launch.exit_code in (0, None),
                    handle=launch.handle, exit_code=launch.exit_code,
                )
        self._running_handles = running

    def _drain_events(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._observe(message)

    def _observe(self, message: ServerSentEvent) -> None:
        try:
            data = json.loads(message.data)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        if message.event == "missed" or data.get("type") == "missed":
            instance = data.get("instance_id")
            if isinstance(instance, str):
                self.controller.observe_missed(instance)
            self.log.info("events were missed (server restart or buffer overrun); "
                          "re-reading the server's state")
            return
        try:
            event = EVENT_ADAPTER.validate_python(data)
        except ValidationError:
            return  # a type this version does not know: the status still tells the state
        self.controller.observe_event(event)

    def _execute(self, action: Action, status: StatusResponse) -> bool:
        """Carry out one action; False when it failed or was refused."""
        try:
            if isinstance(action, ScaleTo):
                return self._post_scale(action, status)
            if isinstance(action, CancelScale):
                return self._cancel_scale(action)
            if isinstance(action, LaunchJoiner):
                launch = self.launcher.launch_joiner(action.spec)
                self.log.outcome(f"launched {launch.handle} for rank(s) "
                                 f"{_span(launch.ranks)}", True, handle=launch.handle)
            elif isinstance(action, Relaunch):
                launch = self.launcher.launch_replacement(action.spec, stuck=action.stuck)
                self.log.outcome(f"relaunched rank(s) {_span(launch.ranks)} as {launch.handle}",
                                 True, handle=launch.handle)
            elif isinstance(action, Terminate):
                stopped = self.launcher.terminate(action.ranks)
                handles = [launch.handle for launch in stopped]
                self.log.outcome(f"terminated {', '.join(handles) or 'nothing'} for rank(s) "
                                 f"{_span(action.ranks)}", True, handles=handles)
        except (LauncherError, TemplateError) as exc:
            _, summary = describe(action)
            self.log.outcome(f"{summary} failed: {exc}", False)
            return False
        return True

    # --- HTTP -----------------------------------------------------------------------

    def _retrying(self) -> Retrying:
        return Retrying(
            stop=stop_after_attempt(self.settings.retries + 1),
            wait=wait_exponential(multiplier=0.5, max=4.0),
            retry=retry_if_exception_type(httpx.TransportError),
            sleep=self._sleep,
            reraise=True,
        )

    def _get(self, url: str) -> httpx.Response:
        own = not url.startswith(("http://", "https://")) or httpx.URL(url).netloc == \
            httpx.URL(self.settings.url).netloc
        client = self.client if own else self.metrics_client
        return self._retrying()(client.get, url)

    def _status(self) -> StatusResponse:
        try:
            response = self._get(STATUS_PATH)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"{self.settings.url}: {exc}") from exc
        if response.status_code != 200:
            hint = " (pass --api-key or set SGLANG_EEP_API_KEY)" if response.status_code == 401 \
                else ""
            raise ServerUnavailable(f"HTTP {response.status_code}: {_message(response)}{hint}")
        try:
            return StatusResponse.model_validate(response.json())
        except (ValueError, ValidationError) as exc:
            raise ServerUnavailable(f"unexpected status body: {exc}") from exc

    def _health(self) -> HealthResponse | None:
        try:
            response = self._get(HEALTH_PATH)
            if response.status_code != 200:
                raise ServerUnavailable(f"HTTP {response.status_code}: {_message(response)}")
            health = HealthResponse.model_validate(response.json())
        except (httpx.HTTPError, ServerUnavailable, ValueError, ValidationError) as exc:
            self.log.problem("health", f"no health report ({exc}); slow ranks go unseen")
            return None
        self.log.resolved("health")
        return health

    def _load(self) -> LoadReading | None:
        texts = []
        problems = []
        for url in self.settings.metrics_urls or (METRICS_PATH,):
            try:
                response = self._get(url)
            except httpx.HTTPError as exc:
                problems.append(f"{url}: {exc}")
                continue
            if response.status_code == 200:
                texts.append(response.text)
            else:
                problems.append(f"{url}: HTTP {response.status_code}")
        reading = parse_load(texts)
        if reading is None:
            why = "; ".join(problems) or "no sglang:num_queue_reqs / num_running_reqs"
            self.log.problem("metrics", f"no load from /metrics ({why}); autoscaling waits "
                             "(run the server with --enable-metrics)")
        else:
            self.log.resolved("metrics")
        return reading

    def _cancel_scale(self, action: CancelScale) -> bool:
        """True once the server answers that the operation is cancelled (repeats are safe: a
        DELETE of a cancelled operation answers the same)."""
        path = f"{SCALE_PATH}/{action.operation_id}"
        try:
            response = self._retrying()(self.client.delete, path)
        except httpx.HTTPError as exc:
            self.log.outcome(f"DELETE {path} got no answer: {exc}", False,
                             operation_id=action.operation_id)
            return False
        cancelled = response.status_code == 200
        self.log.outcome(f"{action.operation_id}: HTTP {response.status_code} "
                         f"{_message(response)}", cancelled,
                         operation_id=action.operation_id, http_status=response.status_code)
        return cancelled

    def _post_scale(self, action: ScaleTo, status: StatusResponse) -> bool:
        payload = {
            "new_ep_size": action.target,
            "operation_id": action.operation_id,
            # Never act on a server that restarted since we read its status.
            "expected_instance_id": status.instance_id,
        }
        try:
            # The operation id makes retries safe: the server answers a repeat as before.
            response = self._retrying()(self.client.post, SCALE_PATH, json=payload)
        except httpx.HTTPError as exc:
            self.controller.observe_scale_answer(action.operation_id, accepted=False)
            self.log.outcome(f"POST {SCALE_PATH} ({action.operation_id}) got no answer: {exc}",
                             False, operation_id=action.operation_id)
            return False
        try:
            body = response.json()
        except ValueError:
            body = {}
        accepted = response.status_code == 200 and bool(body.get("accepted"))
        self.controller.observe_scale_answer(action.operation_id, accepted=accepted)
        reason = body.get("reason") if isinstance(body, dict) else None
        self.log.outcome(
            f"{action.operation_id}: HTTP {response.status_code} {_message(response)}"
            + (f" [{reason}]" if reason else ""),
            accepted, operation_id=action.operation_id, http_status=response.status_code,
        )
        return accepted

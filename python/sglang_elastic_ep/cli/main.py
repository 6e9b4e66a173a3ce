"""``sglang-eep``: scale, inspect and watch an elastic EP SGLang server, or run its controller.

Exit codes: 0 done, 1 failed (operation failed, server unreachable, timeout), 2 bad usage
(bad arguments, request refused as invalid: 400/413/422, or 401/403), 3 conflict (409/412).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

import httpx
from httpx_sse import EventSource
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from sglang_elastic_ep.cli.common import (
    API_KEY_ENV,
    EXIT_CONFLICT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    URL_ENV,
    CliError,
)
from sglang_elastic_ep.cli.controller import add_controller_parser, cmd_controller

CLI_PLUGIN_GROUP = "sglang_elastic_ep.cli"
_STATE_STYLE = {
    "active": "green",
    "pending": "cyan",
    "failed": "bold red",
    "leaving": "yellow",
    "safe_to_terminate": "magenta",
    "inactive": "dim",
}
_RESULT_STYLE = {"succeeded": "green", "failed": "bold red", "running": "cyan",
                 "cancelled": "yellow"}


def _exit_code_for(status: int) -> int:
    if status in (409, 412):
        return EXIT_CONFLICT
    if status in (400, 401, 403, 404, 405, 413, 422):
        return EXIT_USAGE
    return EXIT_FAILED


def _headers(args: argparse.Namespace) -> dict[str, str]:
    key = args.api_key or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or f"HTTP {response.status_code}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)
    return str(body)


def _hint(status: int) -> str:
    if status == 401:
        return f" (pass --api-key or set {API_KEY_ENV})"
    if status == 404:
        return " (is this an SGLang server with the elastic EP plugin?)"
    return ""


def _get_json(client: httpx.Client, path: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        response = client.get(path, headers=_headers(args))
    except httpx.HTTPError as exc:
        raise CliError(EXIT_FAILED, f"cannot reach {args.url}: {exc}") from exc
    if response.status_code != 200:
        raise CliError(
            _exit_code_for(response.status_code),
            f"GET {path}: HTTP {response.status_code}: {_message(response)}"
            + _hint(response.status_code),
        )
    body = response.json()
    assert isinstance(body, dict)
    return body


# --- scale ----------------------------------------------------------------------------------


def _post_scale(
    client: httpx.Client, args: argparse.Namespace, payload: dict[str, Any], console: Console
) -> httpx.Response:
    # Safe to retry: the operation_id makes the request idempotent.
    def say_retrying(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        console.print(f"[yellow]POST failed ({exc}); retrying with the same id[/]")

    retrying = Retrying(retry=retry_if_exception_type(httpx.TransportError),
                        stop=stop_after_attempt(args.retries + 1),
                        wait=wait_exponential(multiplier=0.5, max=4.0),
                        before_sleep=say_retrying, reraise=True)
    try:
        return retrying(client.post, "/scale_elastic_ep", json=payload, headers=_headers(args))
    except httpx.TransportError as exc:
        raise CliError(EXIT_FAILED, f"cannot reach {args.url}: {exc}") from exc


def _phase_view(op: dict[str, Any] | None, header: str, started: float) -> Group:
    line = Text(header)
    if op is None:
        return Group(Spinner("dots", text=line))
    phase = op["phase"]
    entered = op["phase_timestamps"][-1]["at"] if op["phase_timestamps"] else op["started_at"]
    line.append(f"  phase {phase}", style="bold cyan")
    line.append(f"  ({max(0.0, time.time() - entered):.1f}s in phase, ")
    line.append(f"{time.monotonic() - started:.1f}s total)")
    return Group(Spinner("dots", text=line))


def _find_operation(status: dict[str, Any], operation_id: str) -> dict[str, Any] | None:
    current = status.get("current_operation")
    if current and current["operation_id"] == operation_id:
        return current
    for op in status.get("recent_operations", []):
        if op["operation_id"] == operation_id:
            return op
    return None


def _wait(
    client: httpx.Client,
    args: argparse.Namespace,
    operation_id: str,
    instance_id: str,
    console: Console,
) -> int:
    started = time.monotonic()
    header = f"operation {operation_id}:"
    seen_phases: list[str] = []
    with Live(_phase_view(None, header, started), console=console, transient=True) as live:
        while True:
            try:
                status = _get_json(client, "/elastic_ep/status", args)
            except CliError as exc:
                if exc.code != EXIT_FAILED:
                    raise
                live.console.print(f"[yellow]{exc}; still waiting[/]")
                status = None
            if status is not None:
                if status["instance_id"] != instance_id:
                    raise CliError(
                        EXIT_FAILED,
                        f"the server restarted (instance {instance_id} -> "
                        f"{status['instance_id']}); operation {operation_id} is lost: "
                        "check GET /elastic_ep/status and scale again",
                    )
                op = _find_operation(status, operation_id)
                if op is None:
                    raise CliError(
                        EXIT_FAILED, f"operation {operation_id} is unknown to the server"
                    )
                for stamp in op["phase_timestamps"][len(seen_phases):]:
                    seen_phases.append(stamp["phase"])
                    offset = stamp["at"] - op["started_at"]
                    live.console.print(f"  {offset:+7.1f}s  -> {stamp['phase']}")
                header = (
                    f"operation {operation_id}: {op['old_ep_size']} -> {op['new_ep_size']} "
                    f"({op['kind']})"
                )
                live.update(_phase_view(op, header, started))
                if op["result"] == "succeeded":
                    duration = op.get("duration_s") or 0.0
                    live.console.print(
                        f"[green]done[/]: {op['old_ep_size']} -> {op['new_ep_size']} "
                        f"in {duration:.1f}s"
                    )
                    _print_safe_to_terminate(status, console)
                    return EXIT_OK
                if op["result"] == "failed":
                    live.console.print(
                        f"[bold red]failed[/] in phase {_failed_in(op)}: {op.get('error')}"
                    )
                    return EXIT_FAILED
            if time.monotonic() - started > args.timeout:
                raise CliError(
                    EXIT_FAILED,
                    f"gave up waiting after {args.timeout:g}s; operation {operation_id} may "
                    "still be running (sglang-eep status)",
                )
            time.sleep(args.poll_interval)


def _failed_in(op: dict[str, Any]) -> str:
    stamps = [s["phase"] for s in op["phase_timestamps"] if s["phase"] != "failed"]
    return stamps[-1] if stamps else "?"


def _print_safe_to_terminate(status: dict[str, Any], console: Console) -> None:
    ranks = status.get("safe_to_terminate_ranks") or []
    if ranks:
        console.print(f"ranks safe to terminate: {ranks}")


def cmd_scale(args: argparse.Namespace, console: Console) -> int:
    operation_id = args.operation_id or uuid.uuid4().hex
    payload: dict[str, Any] = {"operation_id": operation_id}
    if args.remove is not None:
        payload["remove_ranks"] = args.remove
    else:
        payload["new_ep_size"] = args.to
    if args.expected_instance_id:
        payload["expected_instance_id"] = args.expected_instance_id
    with httpx.Client(base_url=args.url, timeout=args.http_timeout, trust_env=False) as client:
        response = _post_scale(client, args, payload, console)
        message = _message(response)
        if response.status_code != 200:
            code = _exit_code_for(response.status_code)
            label = {EXIT_CONFLICT: "conflict", EXIT_USAGE: "refused"}.get(code, "error")
            console.print(
                f"[bold red]{label}[/] (HTTP {response.status_code}): {message}"
                + _hint(response.status_code)
            )
            return code
        body = response.json()
        if args.json and not args.wait:
            console.print_json(data=body)
        else:
            console.print(f"{message} [dim](operation {body.get('operation_id')})[/]")
        if body.get("phase") == "failed":
            return EXIT_FAILED
        if not args.wait or body.get("operation_id") is None:
            return EXIT_OK
        return _wait(client, args, body["operation_id"], body["instance_id"], console)


# --- cancel ---------------------------------------------------------------------------------


def cmd_cancel(args: argparse.Namespace, console: Console) -> int:
    """``DELETE /scale_elastic_ep/{id}``: 0 cancelled, 3 refused (committed, not a scale-up),
    2 unknown id, 1 not cancelled yet (202) or no answer."""
    path = f"/scale_elastic_ep/{args.operation_id}"
    with httpx.Client(base_url=args.url, timeout=args.http_timeout, trust_env=False) as client:
        try:
            response = client.delete(path, headers=_headers(args))
        except httpx.HTTPError as exc:
            raise CliError(EXIT_FAILED, f"cannot reach {args.url}: {exc}") from exc
    message = _message(response)
    if args.json:
        console.print_json(data=response.json())
    if response.status_code == 200:
        if not args.json:
            console.print(f"[green]cancelled[/]: {message}")
        return EXIT_OK
    if response.status_code == 202:
        if not args.json:
            console.print(f"[yellow]cancelling[/]: {message}")
        return EXIT_FAILED
    code = _exit_code_for(response.status_code)
    if not args.json:
        label = {EXIT_CONFLICT: "refused", EXIT_USAGE: "refused"}.get(code, "error")
        console.print(f"[bold red]{label}[/] (HTTP {response.status_code}): {message}"
                      + (_hint(401) if response.status_code == 401 else ""))
    return code


# --- status ---------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    with httpx.Client(base_url=args.url, timeout=args.http_timeout, trust_env=False) as client:
        status = _get_json(client, "/elastic_ep/status", args)
    if args.json:
        console.print_json(data=status)
        return EXIT_OK
    summary = Table(show_header=False, box=None)
    summary.add_row("instance", status["instance_id"])
    summary.add_row("phase", f"[bold]{status['phase']}[/]")
    size = f"{status['effective_ep_size']} (max {status['max_ep_size']})"
    if status.get("pending_ep_size") is not None:
        size += f", scaling to {status['pending_ep_size']}"
    summary.add_row("EP size", size)
    current = status.get("current_operation")
    if current:
        summary.add_row(
            "running",
            f"{current['operation_id']} {current['kind']} {current['old_ep_size']} -> "
            f"{current['new_ep_size']} in {current['phase']}",
        )
    if status.get("safe_to_terminate_ranks"):
        summary.add_row("safe to terminate", str(status["safe_to_terminate_ranks"]))
    if status.get("last_error"):
        summary.add_row("last error", f"[red]{status['last_error']}[/]")
    stalled = status.get("stalled")
    if stalled:
        summary.add_row("stalled", f"[bold red]{stalled['stalled_s']:.0f} s[/]: "
                                   f"{escape(stalled['message'])}")
        if stalled.get("ranks_to_relaunch"):
            summary.add_row("to relaunch", f"{stalled['ranks_to_relaunch']} "
                                           "(end each, relaunch with --ep-join-mode recover)")
    console.print(summary)

    # While stalled, where each scheduler is: the rank in another step or a pass behind, or
    # one whose report is old, is the one the others wait for.
    positions = {p["rank"]: p for p in stalled["ranks"]} if stalled else {}
    ranks = Table(title="ranks")
    ranks.add_column("rank", justify="right")
    ranks.add_column("state")
    if positions:
        for column in ("step", "in step", "passes", "report age"):
            ranks.add_column(column, justify="left" if column == "step" else "right")
    for rank in status["ranks"]:
        style = _STATE_STYLE.get(rank["state"], "")
        row = [str(rank["rank"]), f"[{style}]{rank['state']}[/]" if style else rank["state"]]
        if positions:
            at = positions.get(rank["rank"])
            row += ([escape(at["step"]), f"{at['in_step_s']:.0f} s", str(at["passes"]),
                     f"{at['report_age_s']:.0f} s"] if at else ["", "", "", ""])
        ranks.add_row(*row)
    console.print(ranks)

    if status.get("recent_operations"):
        ops = Table(title="recent operations (newest first)")
        for column in ("operation", "kind", "size", "result", "duration", "error"):
            ops.add_column(column)
        for op in status["recent_operations"]:
            result = op["result"]
            duration = op.get("duration_s")
            ops.add_row(
                op["operation_id"],
                op["kind"],
                f"{op['old_ep_size']} -> {op['new_ep_size']}",
                f"[{_RESULT_STYLE.get(result, '')}]{result}[/]",
                f"{duration:.1f}s" if duration is not None else "",
                op.get("error") or "",
            )
        console.print(ops)
    return EXIT_OK


# --- events ---------------------------------------------------------------------------------


def _event_line(event_type: str, data: dict[str, Any]) -> Text:
    stamp = time.strftime("%H:%M:%S", time.localtime(data.get("time", time.time())))
    skip = {"type", "event_id", "time", "instance_id"}
    fields = " ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in data.items()
        if k not in skip and v is not None
    )
    style = {
        "rank_failed": "bold red",
        "scale_failed": "bold red",
        "scale_cancelled": "yellow",
        "recovery_required": "yellow",
        "missed": "yellow",
        "scale_committed": "green",
        "safe_to_terminate": "magenta",
    }.get(event_type, "cyan")
    line = Text(f"#{data.get('event_id', '-')} {stamp} ")
    line.append(event_type, style=style)
    line.append(f" {fields}")
    return line


def cmd_events(args: argparse.Namespace, console: Console) -> int:
    last_id: str | None = None if args.last_event_id is None else str(args.last_event_id)
    printed = 0
    retry_s = 2.0
    timeout = httpx.Timeout(args.http_timeout, read=args.read_timeout)
    with httpx.Client(base_url=args.url, timeout=timeout, trust_env=False) as client:
        while True:
            headers = {**_headers(args), "Accept": "text/event-stream"}
            if last_id is not None:
                headers["Last-Event-ID"] = last_id
            params = {"follow": "true" if args.follow else "false"}
            try:
                with client.stream("GET", "/elastic_ep/events", headers=headers,
                                   params=params) as response:
                    if response.status_code != 200:
                        response.read()
                        console.print(
                            f"[bold red]HTTP {response.status_code}[/]: {_message(response)}"
                            + _hint(response.status_code)
                        )
                        return _exit_code_for(response.status_code)
                    for message in EventSource(response).iter_sse():
                        if message.retry is not None:
                            retry_s = message.retry / 1000
                        if not message.data:  # the opening block: retry and a comment
                            continue
                        if message.id:
                            last_id = message.id
                        try:
                            data = json.loads(message.data)
                        except ValueError:
                            data = {"raw": message.data}
                        if args.json:
                            console.print(json.dumps(data), markup=False, highlight=False,
                                          soft_wrap=True)
                        else:
                            console.print(_event_line(message.event, data), soft_wrap=True)
                        if message.event != "missed":
                            printed += 1
                        if args.max_events is not None and printed >= args.max_events:
                            return EXIT_OK
            except httpx.HTTPError as exc:
                if not args.follow:
                    console.print(f"[bold red]cannot read events from {args.url}[/]: {exc}")
                    return EXIT_FAILED
                console.print(f"[yellow]stream interrupted ({exc}); resuming after "
                              f"event {last_id or 'none'} in {retry_s:g}s[/]")
                time.sleep(retry_s)
                continue
            if not args.follow:
                return EXIT_OK
            time.sleep(retry_s)  # the server closed a followed stream: reconnect


# --- main -----------------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` for whole numbers >= ``minimum`` with a message saying what to give."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return convert


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get(URL_ENV),
        required=URL_ENV not in os.environ,
        help=f"server base URL, e.g. http://127.0.0.1:30000 (env {URL_ENV})",
    )
    common.add_argument(
        "--api-key",
        default=None,
        help=f"admin API key (--admin-api-key of the server, else --api-key); env {API_KEY_ENV}",
    )
    common.add_argument("--http-timeout", type=float, default=10.0, help="seconds per request")
    common.add_argument("--json", action="store_true", help="print raw JSON")

    parser = argparse.ArgumentParser(
        prog="sglang-eep",
        description="Scale, inspect and watch an elastic EP SGLang server, or run its "
        "controller (autoscaling and self-healing).",
        epilog="exit codes: 0 done, 1 failed, 2 bad usage, 3 conflict (409/412)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    scale = sub.add_parser("scale", parents=[common],
                           help="scale to an absolute EP size, or remove named ranks")
    target = scale.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", type=_positive_int, help="target EP ranks")
    target.add_argument("--remove", type=int, nargs="+", metavar="RANK",
                        help="remove these ranks: the tail of the current size, or ranks "
                             "where they are (launch-time ones, scale-joined ones below a live "
                             "rank; their relaunch refills them)")
    scale.add_argument("--wait", action="store_true", help="follow phases until done")
    scale.add_argument("--operation-id", help="idempotency key (default: a new UUID)")
    scale.add_argument("--expected-instance-id", help="refuse (412) if the server restarted")
    scale.add_argument("--timeout", type=float, default=1800.0, help="--wait limit, seconds")
    scale.add_argument("--poll-interval", type=float, default=0.5, help="--wait poll, seconds")
    scale.add_argument("--retries", type=int, default=3, help="POST retries on network errors")

    cancel = sub.add_parser("cancel", parents=[common],
                            help="call off a scale-up that has not committed")
    cancel.add_argument("operation_id", help="the operation to cancel (its id from `scale`)")

    sub.add_parser("status", parents=[common], help="show sizes, ranks and operations")

    events = sub.add_parser("events", parents=[common], help="print events (SSE)")
    events.add_argument("--follow", "-f", action="store_true", help="keep streaming")
    events.add_argument(
        "--last-event-id",
        type=_non_negative_int,
        default=None,
        help="resume after this event id (0: whole buffer; default: backlog, or only new "
        "events with --follow)",
    )
    events.add_argument("--max-events", type=_positive_int, help="stop after this many events")
    events.add_argument(
        "--read-timeout", type=float, default=60.0, help="reconnect after this long silent"
    )
    add_controller_parser(sub, common)
    # Other installed distributions (the CPU testbed) add subcommands without this package
    # importing them: each entry point adds its parser and sets ``handler`` on it.
    for entry in entry_points(group=CLI_PLUGIN_GROUP):
        try:
            add_subcommand = entry.load()
        except ImportError as exc:  # a half-removed plugin must not take the CLI down
            print(f"sglang-eep: subcommand {entry.name!r} unavailable: {exc}", file=sys.stderr)
            continue
        add_subcommand(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        return int(exc.code or 0)
    console = Console(soft_wrap=False)
    commands = {"scale": cmd_scale, "cancel": cmd_cancel, "status": cmd_status,
                "events": cmd_events, "controller": cmd_controller}
    handler = getattr(args, "handler", None) or commands[args.command]
    try:
        return handler(args, console)
    except CliError as exc:
        # escape: messages name flags and extras such as [kubernetes], not markup
        Console(stderr=True).print(f"[bold red]error[/]: {escape(str(exc))}", highlight=False)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

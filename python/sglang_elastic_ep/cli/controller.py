"""``sglang-eep controller``: autoscale and self-heal one elastic EP deployment.

The parser is built with nothing but argparse; the controller's modules are imported when the
subcommand runs (``prometheus_client`` must not be imported before SGLang sets up its
multiprocess metrics in a process that also imports this CLI).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from rich.console import Console

from sglang_elastic_ep.cli.common import API_KEY_ENV, EXIT_OK, EXIT_USAGE, CliError

if TYPE_CHECKING:
    import httpx

    from sglang_elastic_ep.controller.launchers.base import Launcher
    from sglang_elastic_ep.controller.loop import ControllerLoop
    from sglang_elastic_ep.core.controller import ControllerConfig

# Placeholders of --command and --pod-template (kept here so --help needs no import).
PLACEHOLDER_HELP = (
    "{rank_offset} first EP rank of the joiner; {num_ranks} its ranks; {join_mode} scale or "
    "recover; {dist_init_addr} --dist-init-addr; {port} an HTTP port (--port-base + "
    "rank_offset, else a free port locally and 30000 on Kubernetes); {operation_id} the "
    "operation it joins; {ep_size} the size it joins into; {deployment} --deployment"
)
# Config field names in error messages -> the flags that set them.
_FLAG_OF: Mapping[str, str] = MappingProxyType({
    "min_size": "--min-size", "max_size": "--max-size", "step": "--step",
    "scale_up_load": "--scale-up-load", "scale_down_load": "--scale-down-load",
    "target_load": "--target-load", "kv_scale_up": "--kv-scale-up",
    "kv_scale_down": "--kv-scale-down", "max_step_up": "--max-step-up",
    "launch_size": "--launch-size", "max_relaunches": "--max-relaunches",
    "op_prefix": "--op-prefix",
})


def _number(kind: Callable[[str], float], minimum: float | None = None,
            maximum: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` that names the allowed range when the value is out of it."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError as exc:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from exc
        if value != value or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum
        ):
            bounds = f"in [{minimum:g}, {maximum:g}]" if maximum is not None \
                else f"at least {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value

    return convert


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already says it, or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def _url(text: str) -> str:
    if not re.match(r"https?://", text):
        raise argparse.ArgumentTypeError(f"expected an http(s):// URL, got {text!r}")
    return text


def add_controller_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "controller",
        parents=[common],
        help="run the controller: autoscale and self-heal one deployment",
        description=(
            "A long-running controller for one elastic EP deployment. It follows the server's "
            "events and polls its status, health and /metrics; scales up and down within "
            "--min-size/--max-size from the load; relaunches failed ranks in recover mode and "
            "removes them (then regrows) after --max-relaunches; launches the joiners of every "
            "scale-up; terminates only ranks the server lists safe_to_terminate. It keeps no "
            "state of its own: a restarted controller resumes from the server's. "
            "Stop it with SIGINT or SIGTERM (its joiners keep running)."
        ),
        epilog=f"template placeholders: {PLACEHOLDER_HELP}. Exit codes: 0 stopped, 2 bad flags.",
        formatter_class=_HelpFormatter,
    )
    sizes = p.add_argument_group("sizes")
    sizes.add_argument("--min-size", type=_number(int, 1), required=True,
                       help="never scale below this many EP ranks")
    sizes.add_argument("--max-size", type=_number(int, 1), required=True,
                       help="never scale above this many EP ranks (at most the server's "
                       "--max-ep-size)")
    sizes.add_argument("--step", type=_number(int, 1), default=1,
                       help="EP ranks per joiner and per size step (the attention replica size, "
                       "attn_tp * attn_cp)")
    sizes.add_argument("--launch-size", type=_number(int, 1), default=None,
                       help="ranks [0, N) are launched by `sglang serve`, not by the controller "
                       "(default: --min-size); failed ones are reported, not relaunched")

    policy = p.add_argument_group("autoscaling policy (load = queued + running requests per "
                                  "active rank, from /metrics)")
    policy.add_argument("--scale-up-load", type=_number(float, 0), default=8.0,
                        help="scale up when the load stays above this for --up-window")
    policy.add_argument("--scale-down-load", type=_number(float, 0), default=2.0,
                        help="scale down when the load stays below this for --down-window")
    policy.add_argument("--target-load", type=_number(float, 0), default=None,
                        help="load per rank a resize aims for (default: midway between the "
                        "thresholds); a scale-down never lands above it")
    policy.add_argument("--kv-scale-up", type=_number(float, 0, 1), default=0.9,
                        help="also scale up when the KV-cache usage (sglang:token_usage, 0-1) "
                        "stays above this")
    policy.add_argument("--kv-scale-down", type=_number(float, 0, 1), default=0.5,
                        help="a scale-down also needs the KV-cache usage below this, where "
                        "reported")
    policy.add_argument("--no-kv", action="store_true",
                        help="ignore the KV-cache usage")
    policy.add_argument("--up-window", type=_number(float, 0), default=60.0,
                        help="seconds the load must stay high before a scale-up")
    policy.add_argument("--down-window", type=_number(float, 0), default=300.0,
                        help="seconds the load must stay low before a scale-down")
    policy.add_argument("--cooldown", type=_number(float, 0), default=300.0,
                        help="seconds after any operation finished before the next resize")
    policy.add_argument("--max-step-up", type=_number(int, 1), default=None,
                        help="most ranks one scale-up adds (default: --step, one joiner at a "
                        "time, which keeps joiners in slot order)")
    policy.add_argument("--no-autoscale", action="store_true",
                        help="only heal and launch joiners; never resize for load")

    heal = p.add_argument_group("self-healing")
    heal.add_argument("--max-relaunches", type=_number(int, 0), default=2,
                      help="relaunch a failed or slow rank in recover mode up to N times; "
                      "after that remove it (scale-down of the failed tail) and regrow")
    heal.add_argument("--recover-timeout", type=_number(float, 0), default=900.0,
                      help="a replacement not rejoined after this many seconds counts as failed")
    heal.add_argument("--heal-retry", type=_number(float, 0), default=15.0,
                      help="seconds to wait before retrying a removal the server refused")
    heal.add_argument("--heal-stall-after", type=_number(float, 0), default=120.0,
                      help="when serving has stalled this many seconds (the status's "
                      "stalled_s), end the stuck ranks and relaunch them in recover mode; "
                      "0: only report the stall")
    heal.add_argument("--no-heal", action="store_true",
                      help="report failed ranks but do not relaunch or remove them")

    loop = p.add_argument_group("loop")
    loop.add_argument("--poll-interval", type=_number(float, 0.05), default=5.0,
                      help="seconds between status/health/metrics reads (events wake it sooner)")
    loop.add_argument("--read-timeout", type=_number(float, 1), default=60.0,
                      help="reopen the event stream after this many silent seconds")
    loop.add_argument("--retries", type=_number(int, 0), default=3,
                      help="retries of a request on network errors (the POST keeps its "
                      "operation id, so a retry is safe)")
    loop.add_argument("--metrics-url", type=_url, action="append", default=None,
                      help="a /metrics URL to read the load from; repeat for joiners that are "
                      "servers of their own (default: --url's /metrics)")
    loop.add_argument("--deployment", default="sglang-eep",
                      help="name of this deployment: tags (local) or labels (Kubernetes) of its "
                      "joiners; one controller per name")
    loop.add_argument("--op-prefix", default="ctl",
                      help="operation ids are <prefix>-<n>-<grow|shrink|remove|regrow>-to-<size>")
    loop.add_argument("--dry-run", action="store_true",
                      help="decide and log, but never POST, launch or terminate")
    loop.add_argument("--once", action="store_true",
                      help="read the server's state, decide and act (a scale-up's POST and "
                      "its joiners) until nothing more is due now, then exit; with --dry-run "
                      "print one decision")

    launch = p.add_argument_group("launcher")
    launch.add_argument("--launcher", choices=("local", "kubernetes"), default="local",
                        help="where joiners run: processes on this machine, or Kubernetes Pods")
    launch.add_argument("--dist-init-addr", default=None,
                        help="the deployment's --dist-init-addr (host:port), for "
                        "{dist_init_addr}")
    launch.add_argument("--port-base", type=_number(int, 1, 65535), default=None,
                        help="{port} is this + the joiner's rank offset")
    local = p.add_argument_group("local launcher")
    # dest: "command" is the subcommand's name in the top-level namespace.
    local.add_argument("--command", dest="joiner_command", default=None,
                       help="joiner command template (required with --launcher local), e.g. "
                       "'python -m sglang.launch_server ... --ep-join-mode {join_mode} "
                       "--elastic-ep-join-rank-offset {rank_offset} --dist-init-addr "
                       "{dist_init_addr} --port {port}'")
    local.add_argument("--log-dir", type=Path, default=Path("sglang-eep-joiner-logs"),
                       help="where each joiner's output goes")
    local.add_argument("--kill-grace", type=_number(float, 0), default=30.0,
                       help="seconds between SIGTERM and SIGKILL when stopping a joiner")
    kube = p.add_argument_group("kubernetes launcher (pip install 'sglang-elastic-ep[kubernetes]')")
    kube.add_argument("--pod-template", type=Path, default=None,
                      help="joiner Pod manifest template (YAML; required with --launcher "
                      "kubernetes); see docs/kubernetes/")
    kube.add_argument("--namespace", default=None,
                      help="namespace of the joiner Pods (default: the template's, else the "
                      "controller's own, else 'default')")
    kube.add_argument("--kube-context", default=None,
                      help="kubeconfig context (default: in-cluster credentials, else the "
                      "current context)")


def _usage(message: str) -> CliError:
    for field, flag in _FLAG_OF.items():
        message = re.sub(rf"\b{field}\b", flag, message)
    return CliError(EXIT_USAGE, message)


def build_controller_config(args: argparse.Namespace) -> ControllerConfig:
    from sglang_elastic_ep.core.autoscaler import AutoscalerConfig
    from sglang_elastic_ep.core.controller import ControllerConfig

    try:
        policy = AutoscalerConfig(
            min_size=args.min_size,
            max_size=args.max_size,
            step=args.step,
            scale_up_load=args.scale_up_load,
            scale_down_load=args.scale_down_load,
            target_load=args.target_load,
            kv_scale_up=None if args.no_kv else args.kv_scale_up,
            kv_scale_down=args.kv_scale_down,
            up_window_s=args.up_window,
            down_window_s=args.down_window,
            cooldown_s=args.cooldown,
            max_step_up=args.max_step_up if args.max_step_up is not None else args.step,
        )
        return ControllerConfig(
            policy=policy,
            launch_size=args.launch_size,
            max_relaunches=args.max_relaunches,
            recover_timeout_s=args.recover_timeout,
            heal_retry_s=args.heal_retry,
            heal_stall_after_s=args.heal_stall_after,
            autoscale=not args.no_autoscale,
            heal=not args.no_heal,
            op_prefix=args.op_prefix,
        )
    except ValueError as exc:
        raise _usage(f"invalid controller settings: {exc}") from exc


def build_launcher(args: argparse.Namespace) -> Launcher:
    from sglang_elastic_ep.controller.launchers.base import LauncherUnavailable
    from sglang_elastic_ep.controller.launchers.template import Template, TemplateError

    try:
        if args.launcher == "local":
            from sglang_elastic_ep.controller.launchers.local import LocalLauncher

            if not args.joiner_command:
                raise CliError(EXIT_USAGE, "--launcher local needs --command, the joiner "
                               f"command template (placeholders: {PLACEHOLDER_HELP})")
            return LocalLauncher(
                Template(args.joiner_command, "--command"),
                deployment=args.deployment,
                log_dir=args.log_dir,
                dist_init_addr=args.dist_init_addr,
                port_base=args.port_base,
                kill_grace_s=args.kill_grace,
            )
        from sglang_elastic_ep.controller.launchers.kubernetes import KubernetesLauncher

        if args.pod_template is None:
            raise CliError(EXIT_USAGE, "--launcher kubernetes needs --pod-template, a joiner "
                           "Pod manifest (see docs/kubernetes/joiner-pod-template.yaml)")
        try:
            text = args.pod_template.read_text()
        except OSError as exc:
            raise CliError(EXIT_USAGE, f"cannot read --pod-template: {exc}") from exc
        return KubernetesLauncher(
            Template(text, str(args.pod_template)),
            deployment=args.deployment,
            namespace=args.namespace,
            dist_init_addr=args.dist_init_addr,
            port_base=args.port_base,
            context=args.kube_context,
        )
    except (TemplateError, LauncherUnavailable) as exc:
        raise CliError(EXIT_USAGE, str(exc)) from exc


def build_loop(
    args: argparse.Namespace,
    console: Console,
    *,
    launcher: Launcher | None = None,
    transport: httpx.BaseTransport | None = None,
) -> ControllerLoop:
    from sglang_elastic_ep.controller.loop import ControllerLoop, LoopSettings
    from sglang_elastic_ep.core.controller import ElasticController

    config = build_controller_config(args)
    settings = LoopSettings(
        url=args.url,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        metrics_urls=tuple(args.metrics_url or ()),
        poll_interval_s=args.poll_interval,
        http_timeout_s=args.http_timeout,
        read_timeout_s=args.read_timeout,
        retries=args.retries,
        dry_run=args.dry_run,
        json_log=args.json,
    )
    return ControllerLoop(
        ElasticController(config),
        launcher if launcher is not None else build_launcher(args),
        settings,
        console=console,
        transport=transport,
    )


def cmd_controller(args: argparse.Namespace, console: Console) -> int:
    loop = build_loop(args, console)
    if threading.current_thread() is threading.main_thread():
        def on_term(signum: int, frame: object) -> None:
            loop.request_stop()

        signal.signal(signal.SIGTERM, on_term)
    mode = "dry run: deciding only" if args.dry_run else f"launcher {args.launcher}"
    loop.log.info(f"controller for {args.url} ({mode}); sizes [{args.min_size}, "
                  f"{args.max_size}], deployment {args.deployment}")
    try:
        loop.run(once=args.once)
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return EXIT_OK

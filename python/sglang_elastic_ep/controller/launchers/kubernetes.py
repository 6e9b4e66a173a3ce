"""Joiners as Kubernetes Pods, one per joiner, from a user-owned Pod template (YAML).

Needs the official client (``pip install 'sglang-elastic-ep[kubernetes]'``), imported only
when this launcher is built, so the rest of the product runs without it. The template's
``{placeholder}`` fields are filled in (see ``template.PLACEHOLDERS``); the launcher then sets
the Pod's name, its labels (deployment, rank offset, ranks, join mode, operation id; the
exact operation id also as an annotation) and ``restartPolicy: Never`` (a restarted container
would come back in the wrong join mode; the controller relaunches instead).

Deleting: only Pods carrying this deployment's label whose ranks all lie in the ranks given
(the server's ``safe_to_terminate_ranks``, or the failed ranks a replacement takes over), by
name. Every other Pod is left alone.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from sglang_elastic_ep.controller.launchers.base import (
    LauncherError,
    LauncherUnavailable,
    within,
)
from sglang_elastic_ep.controller.launchers.template import Template, TemplateError
from sglang_elastic_ep.core.controller import JoinerSpec, JoinMode, Launch

LABEL_DEPLOYMENT = "sglang-eep/deployment"
LABEL_RANK = "sglang-eep/rank"  # the joiner's first rank
LABEL_NUM_RANKS = "sglang-eep/num-ranks"
LABEL_JOIN_MODE = "sglang-eep/join-mode"
LABEL_OPERATION = "sglang-eep/operation-id"  # made label-safe; the annotation is exact
ANNOTATION_OPERATION = "sglang-eep/operation-id"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "sglang-eep-controller"
DEFAULT_PORT = 30000
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_ALIVE_PHASES = (None, "Pending", "Running", "Unknown")

INSTALL_HINT = "install the official client: pip install 'sglang-elastic-ep[kubernetes]'"


def label_value(text: str) -> str:
    """``text`` as a valid label value: 63 characters of [A-Za-z0-9._-], alphanumeric ends."""
    value = re.sub(r"[^A-Za-z0-9._-]", "_", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def load_core_api(context: str | None = None) -> Any:
    """A ``CoreV1Api`` from the in-cluster service account, else the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise LauncherUnavailable(f"the kubernetes launcher needs the kubernetes package; "
                                  f"{INSTALL_HINT}") from exc
    try:
        if context is None:
            try:
                config.load_incluster_config()
                return client.CoreV1Api()
            except config.ConfigException:
                pass
        config.load_kube_config(context=context)
    except (config.ConfigException, OSError) as exc:
        raise LauncherUnavailable(f"no Kubernetes credentials: {exc}") from exc
    return client.CoreV1Api()


def default_namespace() -> str:
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


class KubernetesLauncher:
    name = "kubernetes"

    def __init__(
        self,
        template: Template,
        *,
        deployment: str,
        namespace: str | None = None,
        dist_init_addr: str | None = None,
        port_base: int | None = None,
        core_api: Any | None = None,
        context: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not _DNS_LABEL.fullmatch(deployment) or len(deployment) > 40:
            raise LauncherUnavailable(
                f"--deployment {deployment!r} must be a DNS label of at most 40 characters "
                "(lowercase letters, digits, '-'): it starts every Pod name"
            )
        try:
            import yaml
            from kubernetes import client
        except ImportError as exc:
            raise LauncherUnavailable(f"the kubernetes launcher needs the kubernetes package; "
                                      f"{INSTALL_HINT}") from exc
        self._yaml = yaml
        self._client = client
        self.template = template
        self.deployment = deployment
        self.dist_init_addr = dist_init_addr
        self.port_base = port_base
        self._clock = clock
        # Fail at start-up on a template that does not make a Pod.
        checked = self._manifest(JoinerSpec(0, 1, JoinMode.SCALE, "check", 1))
        self.namespace = (
            namespace or checked.get("metadata", {}).get("namespace") or default_namespace()
        )
        self.core = core_api if core_api is not None else load_core_api(context)

    # --- Launcher -------------------------------------------------------------------

    def launch_joiner(self, spec: JoinerSpec) -> Launch:
        manifest = self._manifest(spec)
        manifest["metadata"]["namespace"] = self.namespace
        body = self._client.V1Pod.from_dict(manifest)
        try:
            pod = self.core.create_namespaced_pod(self.namespace, body)
        except self._client.ApiException as exc:
            raise LauncherError(
                f"creating Pod {manifest['metadata']['name']}: {exc.status} {exc.reason}"
            ) from exc
        return self._launch(pod)

    def launch_replacement(self, spec: JoinerSpec, *, stuck: bool = False) -> Launch:
        # A stuck server never finishes a graceful stop: its Pod goes without the grace.
        self._delete(spec.ranks, grace_period_seconds=0 if stuck else None)
        return self.launch_joiner(spec)

    def terminate(self, ranks: Collection[int]) -> list[Launch]:
        return self._delete(ranks)

    def list(self) -> list[Launch]:
        return [self._launch(pod) for pod in self._pods()]

    # --- internals ------------------------------------------------------------------

    def _manifest(self, spec: JoinerSpec) -> dict[str, Any]:
        port = self.port_base + spec.rank_offset if self.port_base is not None else DEFAULT_PORT
        text = self.template.render_joiner(spec, port=port, dist_init_addr=self.dist_init_addr,
                                          deployment=self.deployment)
        try:
            manifest = self._yaml.safe_load(text)
        except self._yaml.YAMLError as exc:
            raise TemplateError(f"{self.template.source} is not valid YAML: {exc}") from exc
        if not isinstance(manifest, dict) or manifest.get("kind", "Pod") != "Pod":
            raise TemplateError(f"{self.template.source} must be one Pod manifest (kind: Pod)")
        manifest.setdefault("apiVersion", "v1")
        manifest["kind"] = "Pod"
        meta = manifest.setdefault("metadata", {}) or {}
        manifest["metadata"] = meta
        suffix = secrets.token_hex(3)
        meta["name"] = f"{self.deployment}-r{spec.rank_offset}-{spec.mode.value}-{suffix}"
        meta.pop("generateName", None)
        meta["labels"] = {
            **(meta.get("labels") or {}),
            LABEL_DEPLOYMENT: self.deployment,
            LABEL_RANK: str(spec.rank_offset),
            LABEL_NUM_RANKS: str(spec.num_ranks),
            LABEL_JOIN_MODE: spec.mode.value,
            LABEL_OPERATION: label_value(spec.operation_id),
            LABEL_MANAGED_BY: MANAGED_BY,
        }
        meta["annotations"] = {**(meta.get("annotations") or {}),
                               ANNOTATION_OPERATION: spec.operation_id}
        pod_spec = manifest.get("spec")
        if not isinstance(pod_spec, dict) or not pod_spec.get("containers"):
            raise TemplateError(f"{self.template.source} has no spec.containers")
        pod_spec["restartPolicy"] = "Never"
        try:
            self._client.V1Pod.from_dict(manifest)
        except (ValueError, TypeError, AttributeError) as exc:  # pydantic's, or from_dict's
            raise TemplateError(f"{self.template.source} is not a valid Pod: {exc}") from exc
        return manifest

    def _pods(self) -> list[Any]:
        try:
            pods = self.core.list_namespaced_pod(
                self.namespace, label_selector=f"{LABEL_DEPLOYMENT}={self.deployment}"
            )
        except self._client.ApiException as exc:
            raise LauncherError(f"listing Pods: {exc.status} {exc.reason}") from exc
        # The selector already filters; checked again so no other Pod can ever be deleted.
        return [pod for pod in pods.items
                if (pod.metadata.labels or {}).get(LABEL_DEPLOYMENT) == self.deployment
                and self._span(pod) is not None]

    @staticmethod
    def _span(pod: Any) -> tuple[int, int] | None:
        labels = pod.metadata.labels or {}
        try:
            return int(labels[LABEL_RANK]), int(labels[LABEL_NUM_RANKS])
        except (KeyError, ValueError):
            return None

    def _launch(self, pod: Any) -> Launch:
        meta = pod.metadata
        labels = meta.labels or {}
        span = self._span(pod)
        assert span is not None
        try:
            mode = JoinMode(labels.get(LABEL_JOIN_MODE, "scale"))
        except ValueError:
            mode = JoinMode.SCALE
        phase = pod.status.phase if pod.status is not None else None
        created = meta.creation_timestamp
        return Launch(
            handle=meta.name,
            rank_offset=span[0],
            num_ranks=span[1],
            mode=mode,
            operation_id=(meta.annotations or {}).get(ANNOTATION_OPERATION)
            or labels.get(LABEL_OPERATION, ""),
            alive=phase in _ALIVE_PHASES and meta.deletion_timestamp is None,
            started_at=created.timestamp() if created is not None else self._clock(),
            exit_code=_exit_code(pod),
        )

    def _delete(self, ranks: Collection[int],
                grace_period_seconds: int | None = None) -> list[Launch]:
        deleted = []
        for pod in self._pods():
            launch = self._launch(pod)
            if not within(launch, ranks) or pod.metadata.deletion_timestamp is not None:
                continue
            try:
                # None: the Pod's own terminationGracePeriodSeconds (the client omits it).
                self.core.delete_namespaced_pod(pod.metadata.name, self.namespace,
                                                grace_period_seconds=grace_period_seconds)
            except self._client.ApiException as exc:
                if exc.status == 404:
                    continue  # already gone
                raise LauncherError(
                    f"deleting Pod {pod.metadata.name}: {exc.status} {exc.reason}"
                ) from exc
            deleted.append(launch)
        return deleted


def _exit_code(pod: Any) -> int | None:
    """The exit code of the Pod's first terminated container (the server), if any ended."""
    statuses = (pod.status.container_statuses or []) if pod.status is not None else []
    for container in statuses:
        terminated = container.state.terminated if container.state is not None else None
        if terminated is not None:
            return int(terminated.exit_code)
    return None

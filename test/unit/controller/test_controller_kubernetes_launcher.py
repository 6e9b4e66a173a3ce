"""The Kubernetes launcher against the official client with a faked API server.

The real ``CoreV1Api`` and ``ApiClient`` run (the client's own models, serialization and
deserialization); only ``ApiClient.call_api``, the one method that would open a connection, is
replaced by an in-memory Pod store. Nothing here talks to a live cluster.
"""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client  # noqa: E402
from kubernetes.client import rest  # noqa: E402

from sglang_elastic_ep.controller.launchers.base import Launcher, LauncherError  # noqa: E402
from sglang_elastic_ep.controller.launchers.kubernetes import (  # noqa: E402
    ANNOTATION_OPERATION,
    LABEL_DEPLOYMENT,
    LABEL_JOIN_MODE,
    LABEL_MANAGED_BY,
    LABEL_NUM_RANKS,
    LABEL_OPERATION,
    LABEL_RANK,
    KubernetesLauncher,
    label_value,
)
from sglang_elastic_ep.controller.launchers.template import Template, TemplateError  # noqa: E402
from sglang_elastic_ep.core.controller import JoinerSpec, JoinMode  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
DOCS_TEMPLATE = REPO / "docs" / "kubernetes" / "joiner-pod-template.yaml"
NS = "serving"


class _Raw:
    """What urllib3 would hand to ``rest.RESTResponse``."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = {200: "OK", 201: "Created", 404: "Not Found"}.get(status, "Error")
        self.data = json.dumps(body).encode()
        self.headers = {"content-type": "application/json"}


class FakeApiServer:
    """Pods of one fake cluster, served through ``ApiClient.call_api``."""

    def __init__(self, *, honour_selector: bool = True) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.delete_queries: dict[str, dict[str, list[str]]] = {}  # pod name -> query
        self.honour_selector = honour_selector

    def add(self, name: str, labels: dict[str, str], namespace: str = NS,
            phase: str = "Running") -> None:
        self.pods[(namespace, name)] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": phase},
        }

    def call_api(self, method: str, url: str, header_params: Any = None, body: Any = None,
                 post_params: Any = None, _request_timeout: Any = None) -> rest.RESTResponse:
        parsed = urlparse(url)
        self.requests.append((method, parsed.path, body))
        match = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", parsed.path)
        assert match, url
        namespace, name = match.groups()
        if method == "POST":
            pod = json.loads(json.dumps(body))  # what would go over the wire
            pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
            pod["status"] = {"phase": "Pending"}
            self.pods[(namespace, pod["metadata"]["name"])] = pod
            return rest.RESTResponse(_Raw(201, pod))
        if method == "GET" and name is None:
            selector = parse_qs(parsed.query).get("labelSelector", [""])[0]
            wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
            items = [p for (ns, _), p in self.pods.items() if ns == namespace and (
                not self.honour_selector
                or all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
            )]
            return rest.RESTResponse(_Raw(200, {"apiVersion": "v1", "kind": "PodList",
                                                "metadata": {}, "items": items}))
        if method == "DELETE":
            self.delete_queries[name] = parse_qs(parsed.query)
            pod = self.pods.pop((namespace, name), None)
            if pod is None:
                return rest.RESTResponse(_Raw(404, {"kind": "Status", "code": 404}))
            return rest.RESTResponse(_Raw(200, pod))
        raise AssertionError(f"unexpected {method} {url}")

    def names(self) -> set[str]:
        return {name for _, name in self.pods}

    def deleted(self) -> list[str]:
        return [path.rsplit("/", 1)[1] for method, path, _ in self.requests if method == "DELETE"]


@pytest.fixture
def fake() -> FakeApiServer:
    return FakeApiServer()


def core_api(fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch) -> Any:
    configuration = client.Configuration()
    configuration.host = "https://fake-apiserver:6443"
    api_client = client.ApiClient(configuration)
    monkeypatch.setattr(api_client, "call_api", fake.call_api)
    return client.CoreV1Api(api_client)


def make(fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch, text: str | None = None,
         **kw: Any) -> KubernetesLauncher:
    kw.setdefault("deployment", "dsv3")
    kw.setdefault("namespace", NS)
    kw.setdefault("dist_init_addr", "sglang-head-0.sglang-head:5000")
    template = Template(text if text is not None else DOCS_TEMPLATE.read_text(), "template")
    return KubernetesLauncher(template, core_api=core_api(fake, monkeypatch), **kw)


def spec(offset: int, mode: JoinMode = JoinMode.SCALE, op: str = "ctl-3-grow-to-16",
         size: int = 8) -> JoinerSpec:
    return JoinerSpec(offset, size, mode, op, offset + size)


def test_creates_one_pod_from_the_shipped_template_with_labels_and_filled_args(
    fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = make(fake, monkeypatch, port_base=31000)
    assert isinstance(launcher, Launcher)
    launch = launcher.launch_joiner(spec(8))

    (post,) = [(path, body) for method, path, body in fake.requests if method == "POST"]
    assert post[0] == f"/api/v1/namespaces/{NS}/pods"
    pod = post[1]
    meta = pod["metadata"]
    assert re.fullmatch(r"dsv3-r8-scale-[0-9a-f]{6}", meta["name"])
    assert meta["namespace"] == NS
    assert meta["labels"] == {
        "app.kubernetes.io/name": "sglang",
        "app.kubernetes.io/component": "elastic-ep-joiner",
        LABEL_DEPLOYMENT: "dsv3", LABEL_RANK: "8", LABEL_NUM_RANKS: "8",
        LABEL_JOIN_MODE: "scale", LABEL_OPERATION: "ctl-3-grow-to-16",
        LABEL_MANAGED_BY: "sglang-eep-controller",
    }
    assert meta["annotations"] == {ANNOTATION_OPERATION: "ctl-3-grow-to-16"}
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    args = container["args"]
    for expected in ("--tp=8", "--ep=8", "--dp=8", "--ep-join-mode=scale",
                     "--elastic-ep-join-rank-offset=8", "--port=31008",
                     "--dist-init-addr=sglang-head-0.sglang-head:5000"):
        assert expected in args
    assert container["ports"] == [{"name": "http", "containerPort": 31008}]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert container["env"] == [{"name": "SGLANG_EEP_OPERATION_ID",
                                 "value": "ctl-3-grow-to-16"}]

    # What the launcher reports comes back through the client's V1Pod model.
    assert (launch.handle, launch.rank_offset, launch.num_ranks, launch.mode,
            launch.operation_id, launch.alive) == (meta["name"], 8, 8, JoinMode.SCALE,
                                                   "ctl-3-grow-to-16", True)
    assert launch.started_at == datetime(2026, 1, 1, 0, 0, 5, tzinfo=timezone.utc).timestamp()
    assert [x.handle for x in launcher.list()] == [meta["name"]]


def test_terminate_deletes_only_the_pods_of_the_listed_ranks(
    fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = make(fake, monkeypatch)
    r8 = launcher.launch_joiner(spec(8, size=4))  # ranks 8-11
    r12 = launcher.launch_joiner(spec(12, size=4))  # ranks 12-15
    mine = {LABEL_DEPLOYMENT: "dsv3", LABEL_NUM_RANKS: "4"}
    fake.add("other-deployment-r12", {LABEL_DEPLOYMENT: "llama", LABEL_RANK: "12",
                                      LABEL_NUM_RANKS: "4"})
    fake.add("unlabelled-r12", {"app": "x"})
    fake.add("dsv3-without-rank", {LABEL_DEPLOYMENT: "dsv3"})
    fake.add("dsv3-other-namespace", {**mine, LABEL_RANK: "12"}, namespace="elsewhere")

    assert launcher.terminate([13, 14, 15]) == []  # 12 is not listed: the joiner stays whole
    assert fake.deleted() == []
    stopped = launcher.terminate([12, 13, 14, 15])
    assert [s.handle for s in stopped] == [r12.handle]
    assert fake.deleted() == [r12.handle]
    assert fake.names() == {r8.handle, "other-deployment-r12", "unlabelled-r12",
                            "dsv3-without-rank", "dsv3-other-namespace"}
    assert launcher.terminate([]) == []


def test_only_this_deployments_pods_even_if_the_server_ignored_the_selector(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeApiServer(honour_selector=False)
    launcher = make(fake, monkeypatch)
    fake.add("llama-r8", {LABEL_DEPLOYMENT: "llama", LABEL_RANK: "8", LABEL_NUM_RANKS: "8"})
    assert launcher.list() == []
    assert launcher.terminate(range(16)) == []
    assert fake.names() == {"llama-r8"}


def test_replacement_deletes_the_failed_ranks_pod_and_creates_a_recover_pod(
    fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = make(fake, monkeypatch)
    old = launcher.launch_joiner(spec(8))
    fake.pods[(NS, old.handle)]["status"]["phase"] = "Failed"
    assert [(x.handle, x.alive) for x in launcher.list()] == [(old.handle, False)]
    new = launcher.launch_replacement(spec(8, JoinMode.RECOVER, "ctl-recover-r8-1"))
    assert fake.deleted() == [old.handle]
    assert new.mode is JoinMode.RECOVER and new.handle.startswith("dsv3-r8-recover-")
    pod = fake.pods[(NS, new.handle)]
    assert "--ep-join-mode=recover" in pod["spec"]["containers"][0]["args"]
    assert pod["metadata"]["labels"][LABEL_OPERATION] == "ctl-recover-r8-1"
    assert "gracePeriodSeconds" not in fake.delete_queries[old.handle]  # the Pod's own grace


def test_a_stuck_ranks_pod_is_deleted_without_a_grace(
    fake: FakeApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher = make(fake, monkeypatch)
    old = launcher.launch_joiner(spec(8))
    launcher.launch_replacement(spec(8, JoinMode.RECOVER, "ctl-recover-r8-e0-1"), stuck=True)
    assert fake.deleted() == [old.handle]
    assert fake.delete_queries[old.handle]["gracePeriodSeconds"] == ["0"]


def test_a_pod_being_deleted_is_not_alive(fake: FakeApiServer,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = make(fake, monkeypatch)
    launch = launcher.launch_joiner(spec(8))
    fake.pods[(NS, launch.handle)]["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert [x.alive for x in launcher.list()] == [False]


def test_an_ended_pod_reports_its_servers_exit_code(fake: FakeApiServer,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = make(fake, monkeypatch)
    launch = launcher.launch_joiner(spec(8))
    assert launcher.list()[0].exit_code is None
    fake.pods[(NS, launch.handle)]["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "sglang", "image": "i", "imageID": "", "ready": False,
                               "restartCount": 0, "containerID": "c1",
                               "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}],
    }
    (ended,) = launcher.list()
    assert (ended.alive, ended.exit_code) == (False, 0)


def test_api_errors_become_launcher_errors(fake: FakeApiServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    launcher = make(fake, monkeypatch)

    def forbidden(*args: Any, **kwargs: Any) -> rest.RESTResponse:
        return rest.RESTResponse(_Raw(403, {"kind": "Status", "code": 403}))

    monkeypatch.setattr(launcher.core.api_client, "call_api", forbidden)
    with pytest.raises(LauncherError, match="403"):
        launcher.launch_joiner(spec(8))
    with pytest.raises(LauncherError, match="403"):
        launcher.list()


def test_long_operation_ids_make_valid_label_values() -> None:
    value = label_value("x" * 100 + ":y")
    assert len(value) <= 63 and re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", value)
    assert label_value("op:1") == "op_1"


def test_bad_templates_and_names_are_refused_at_start(fake: FakeApiServer,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TemplateError, match="kind: Pod"):
        make(fake, monkeypatch, "kind: Deployment\nspec: {}\n")
    with pytest.raises(TemplateError, match="no spec.containers"):
        make(fake, monkeypatch, "kind: Pod\nmetadata: {}\n")
    with pytest.raises(TemplateError, match="not a valid Pod"):
        make(fake, monkeypatch, "kind: Pod\nspec:\n  containers: 3\n")
    with pytest.raises(TemplateError, match="not valid YAML"):
        make(fake, monkeypatch, "kind: Pod\nspec: [\n")
    with pytest.raises(TemplateError, match="dist_init_addr"):
        make(fake, monkeypatch, dist_init_addr=None)
    with pytest.raises(LauncherError, match="DNS label"):
        make(fake, monkeypatch, deployment="Bad_Name")
    assert fake.requests == []  # nothing was created by a failed start

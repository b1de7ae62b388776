"""Render helm/elasticmoe in-process and validate what it renders.

Helm runs inside this process: helm-python-sdk ships Helm's Go SDK as a shared library
(`libhelm_c`, Helm v4), so `helm template` and `helm lint` need no binary and no network.

Validation: built-in kinds against the Kubernetes OpenAPI schemas that kubernetes-validate
ships (strict: an unknown field fails), for the oldest Kubernetes the chart supports and a
recent one. The CRDs have no schema there and are checked structurally: the RayService's pod
templates as core `PodTemplate`s, its serveConfigV2 with Ray Serve's own `ServeDeploySchema`,
the rest field by field; the ServiceMonitor field by field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml
from ray.serve.schema import ServeDeploySchema

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "elasticmoe"
RELEASE = "demo"
NAMESPACE = "ml"
K8S_VERSIONS = ("1.27", "1.33")  # Chart.yaml's kubeVersion floor, and a recent release
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def gpu_values() -> dict[str, Any]:
    return helm.values_from_yaml((CHART / "values-gpu.yaml").read_text())


def render_texts(values: dict[str, Any] | None = None, chart: Path | str = CHART) -> dict[str, str]:
    """`helm template` of the chart: template path -> rendered text (NOTES.txt included)."""
    with helm.Chart.load(chart) as loaded:
        return loaded.render(values, name=RELEASE, namespace=NAMESPACE)


def objects(texts: dict[str, str]) -> list[dict[str, Any]]:
    return [
        obj for path, text in texts.items() if not path.endswith("NOTES.txt")
        for obj in yaml.safe_load_all(text) if obj
    ]


def render(values: dict[str, Any] | None = None, chart: Path | str = CHART) -> list[dict[str, Any]]:
    return objects(render_texts(values, chart))


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [obj for obj in objs if obj["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_templates(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """'head' / 'worker' -> the pod template of the RayService's group."""
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    return {"head": cluster["headGroupSpec"]["template"], "worker": worker["template"]}


def ray_container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]  # KubeRay's rule: the first container runs Ray


def serve_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return yaml.safe_load(one(objs, "RayService")["spec"]["serveConfigV2"])


# ---- validation ------------------------------------------------------------------------------


def validate(obj: dict[str, Any]) -> None:
    """Raise if `obj` is not a valid object of its kind (no kind is passed over)."""
    if obj["kind"] == "RayService":
        check_rayservice(obj)
    elif obj["kind"] == "ServiceMonitor":
        check_servicemonitor(obj)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def _check_metadata(metadata: dict[str, Any], max_name: int = 63) -> None:
    assert _DNS_LABEL.match(metadata["name"]) and len(metadata["name"]) <= max_name, metadata["name"]
    assert all(isinstance(v, str) for v in metadata.get("labels", {}).values())


def _validate_pod_template(template: dict[str, Any]) -> None:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(wrapped, version, strict=True)


def _check_ray_start_params(params: Any) -> None:
    assert isinstance(params, dict) and params, params
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()), params


def check_rayservice(obj: dict[str, Any]) -> None:
    """The parts of the ray.io/v1 RayService schema the chart renders (KubeRay's Go types)."""
    assert obj["apiVersion"] == "ray.io/v1"
    _check_metadata(obj["metadata"], max_name=40)  # KubeRay appends -raycluster-xxxxx-head-svc
    spec = obj["spec"]
    assert set(spec) <= {"serveConfigV2", "rayClusterConfig", "upgradeStrategy"}, set(spec)
    assert isinstance(spec["serveConfigV2"], str)
    ServeDeploySchema.parse_obj(yaml.safe_load(spec["serveConfigV2"]))
    if "upgradeStrategy" in spec:
        assert spec["upgradeStrategy"]["type"] in {"NewCluster", "None", "NewClusterWithIncrementalUpgrade"}
    cluster = spec["rayClusterConfig"]
    assert set(cluster) <= {"rayVersion", "enableInTreeAutoscaling", "authOptions", "headGroupSpec",
                            "workerGroupSpecs"}
    assert isinstance(cluster["rayVersion"], str) and isinstance(cluster["enableInTreeAutoscaling"], bool)
    if "authOptions" in cluster:  # KubeRay >= 1.5.1 (AuthOptions: mode token or disabled)
        assert cluster["authOptions"] == {"mode": "token"} or cluster["authOptions"] == {"mode": "disabled"}
    head = cluster["headGroupSpec"]
    assert set(head) == {"rayStartParams", "template"}
    _check_ray_start_params(head["rayStartParams"])
    _validate_pod_template(head["template"])
    assert isinstance(cluster["workerGroupSpecs"], list) and cluster["workerGroupSpecs"]
    for group in cluster["workerGroupSpecs"]:
        assert set(group) == {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"}
        assert _DNS_LABEL.match(group["groupName"])
        counts = [group["minReplicas"], group["replicas"], group["maxReplicas"]]
        assert all(type(c) is int for c in counts) and counts == sorted(counts) and counts[0] >= 0, counts
        _check_ray_start_params(group["rayStartParams"])
        _validate_pod_template(group["template"])


def check_servicemonitor(obj: dict[str, Any]) -> None:
    """The parts of monitoring.coreos.com/v1 ServiceMonitor the chart renders."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    _check_metadata(obj["metadata"])
    spec = obj["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints"}, set(spec)
    labels = spec["selector"]["matchLabels"]
    assert labels and all(isinstance(v, str) for v in labels.values())
    assert all(isinstance(n, str) for n in spec["namespaceSelector"]["matchNames"])
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval"}, set(endpoint)
        assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")
        assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["interval"]), endpoint["interval"]


# ---- NetworkPolicy semantics -------------------------------------------------------------------


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"this evaluator reads matchLabels only: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def admits(policy: dict[str, Any], pod_labels: dict[str, str], port: int, source: dict[str, Any] | None) -> bool:
    """Whether `policy` lets `source` reach `port` of a pod labelled `pod_labels` (TCP).

    `source`: None for a client outside the cluster, else {"labels", "namespace_labels",
    "same_namespace"} of the calling pod. Only ingress policies are modelled.
    """
    spec = policy["spec"]
    if not _selects(spec["podSelector"], pod_labels):
        return True  # the policy does not isolate this pod
    for rule in spec.get("ingress", []):
        ports = rule.get("ports") or [{"port": port}]
        if not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        peers = rule.get("from")
        if not peers or any(_peer_matches(peer, source) for peer in peers):
            return True
    return False


def _peer_matches(peer: dict[str, Any], source: dict[str, Any] | None) -> bool:
    assert "ipBlock" not in peer, "this evaluator does not model ipBlock peers"
    if source is None:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], source["namespace_labels"]):
            return False
    elif not source["same_namespace"]:
        return False
    return "podSelector" not in peer or _selects(peer["podSelector"], source["labels"])


def ray_start_resources(params: dict[str, str]) -> dict[str, float]:
    """The custom resources of a `resources` rayStartParam (KubeRay's shell-quoted JSON)."""
    return json.loads(params["resources"].strip("'\"").replace('\\"', '"'))

"""helm/elasticmoe: lint, render and validate; probes, drain, network policy, keys, GPU values.

Helm and the validators run in-process (see helm_chart_checks); nothing here is skipped.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
from helm_chart_checks import (
    CHART,
    NAMESPACE,
    RELEASE,
    admits,
    gpu_values,
    objects,
    of_kind,
    one,
    pod_templates,
    ray_container,
    ray_start_resources,
    render,
    render_texts,
    serve_config,
    validate,
)

from coordinator.launch import LOCAL_RAY_DEFAULTS
from hmm.placement import DEVICE_RESOURCE

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALL_OPTIONAL = {
    "ingress": {"enabled": True, "className": "nginx",
                "hosts": [{"host": "moe.example.com", "paths": [{"path": "/", "pathType": "Prefix"}]}],
                "tls": [{"secretName": "moe-tls", "hosts": ["moe.example.com"]}]},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
                "grafanaDashboards": {"enabled": True}},
    "auth": {"existingSecret": "moe-keys"},
    "podDisruptionBudget": {"workers": True},
    "networkPolicy": {"metricsPeers": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
    "rayService": {"upgradeStrategy": "None"},
}
CASES = {"defaults": None, "gpu": gpu_values(), "all-optional": ALL_OPTIONAL}


def _lint_problems(values: dict | None) -> list[dict]:
    report = helm.lint(CHART, values, strict=True)
    return [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]


@pytest.mark.parametrize("values", [None, gpu_values()], ids=["defaults", "gpu"])
def test_lint_strict_passes(values):
    assert _lint_problems(values) == []


@pytest.mark.parametrize("case", CASES)
def test_every_rendered_object_validates(case):
    objs = render(CASES[case])
    kinds = sorted(obj["kind"] for obj in objs)
    expected = ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "RayService", "Service"]
    if case == "all-optional":
        expected += ["ConfigMap", "Ingress", "PodDisruptionBudget", "ServiceMonitor"]
    assert kinds == sorted(expected)
    for obj in objs:
        validate(obj)
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


def test_validation_is_not_vacuous():
    objs = render()
    service = one(objs, "Service")
    service["spec"]["ports"][0]["portt"] = 1  # unknown field
    with pytest.raises(kubernetes_validate.ValidationError, match="portt"):
        validate(service)
    rayservice = one(objs, "RayService")
    ray_container(pod_templates([rayservice])["head"])["resources"]["limits"]["cpu"] = {"bad": 1}
    with pytest.raises(kubernetes_validate.ValidationError, match="bad"):
        validate(rayservice)


def test_probes_go_to_health_and_ready_on_the_serve_port():
    head = ray_container(pod_templates(render())["head"])
    port = {p["name"]: p["containerPort"] for p in head["ports"]}["serve"]
    assert port == 8000
    assert head["livenessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}
    startup = head["startupProbe"]
    assert startup["httpGet"] == {"path": "/ready", "port": 8000}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load takes time
    custom = render({"probes": {"startup": {"path": "/ready", "periodSeconds": 20, "timeoutSeconds": 9,
                                            "failureThreshold": 7}}})
    assert ray_container(pod_templates(custom)["head"])["startupProbe"]["failureThreshold"] == 7


def test_head_submits_the_serve_config_itself():
    """KubeRay deploys serveConfigV2 only to a Ready head, which /ready gates: no deadlock."""
    objs = render()
    head_template = pod_templates(objs)["head"]
    command = ray_container(head_template)["lifecycle"]["postStart"]["exec"]["command"]
    assert "serve deploy /etc/elasticmoe/serve-config.yaml --address http://127.0.0.1:8265" in command[-1]
    mount = next(m for m in ray_container(head_template)["volumeMounts"] if m["mountPath"] == "/etc/elasticmoe")
    volume = next(v for v in head_template["spec"]["volumes"] if v["name"] == mount["name"])
    config_map = next(c for c in of_kind(objs, "ConfigMap") if c["metadata"]["name"] == volume["configMap"]["name"])
    assert config_map["data"]["serve-config.yaml"] == one(objs, "RayService")["spec"]["serveConfigV2"]


def _fake_commands(bin_dir: Path, log: Path, serve_failures: int) -> dict[str, str]:
    """PATH with `serve`, `elasticmoe` and `sleep` that log their argv; `serve` fails its first calls."""
    bin_dir.mkdir()
    for name, body in {
        "serve": f'echo "serve $*" >> {log}; n=$(grep -c "^serve" {log}); [ "$n" -gt {serve_failures} ]',
        "elasticmoe": f'echo "elasticmoe $*" >> {log}',
        "sleep": f'echo "sleep $*" >> {log}',
    }.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_lifecycle_hooks_run_as_rendered(tmp_path):
    """Run the head's postStart and preStop commands with logging stand-ins for the tools they call."""
    lifecycle = ray_container(pod_templates(render())["head"])["lifecycle"]
    log = tmp_path / "calls.log"
    env = _fake_commands(tmp_path / "bin", log, serve_failures=2)
    subprocess.run(lifecycle["postStart"]["exec"]["command"], env=env, check=True, timeout=30)
    deploy = "serve deploy /etc/elasticmoe/serve-config.yaml --address http://127.0.0.1:8265"
    assert log.read_text().splitlines() == [deploy, "sleep 5"] * 2 + [deploy]
    log.unlink()
    subprocess.run(lifecycle["preStop"]["exec"]["command"], env=env, check=True, timeout=30)
    assert log.read_text().splitlines() == ["sleep 5", "elasticmoe drain --url http://127.0.0.1:8000 --timeout-s 60"]


def _drain_numbers(template: dict) -> tuple[int, int]:
    """(preStop sleep, drain timeout) parsed from the head's preStop command."""
    script = ray_container(template)["lifecycle"]["preStop"]["exec"]["command"][-1]
    sleep, drain = (part.strip() for part in script.split(";"))
    assert sleep.startswith("sleep ") and drain.startswith("exec elasticmoe drain --url http://127.0.0.1:8000 ")
    return int(sleep.split()[1]), int(drain.split("--timeout-s")[1])


@pytest.mark.parametrize("values, expected", [
    (None, (5, 60, 75)),
    ({"drain": {"preStopSleepSeconds": 20, "timeoutSeconds": 100}, "terminationGracePeriodSeconds": 1}, (20, 100, 130)),
    ({"terminationGracePeriodSeconds": 1000}, (5, 60, 1000)),
], ids=["defaults", "grace-too-small", "grace-larger"])
def test_prestop_drains_within_the_grace_period(values, expected):
    templates = pod_templates(render(values))
    sleep, timeout = _drain_numbers(templates["head"])
    expected_grace = expected[2]
    assert (sleep, timeout) == expected[:2]
    for template in templates.values():
        assert template["spec"]["terminationGracePeriodSeconds"] == expected_grace >= sleep + timeout + 10
    # A worker drains its own node; when it cannot, it outlives the head's drain (its ranks serve
    # the head's requests in flight).
    worker_stop = ray_container(templates["worker"])["lifecycle"]["preStop"]["exec"]["command"]
    assert worker_stop[:2] == ["sh", "-c"] and f"--timeout-s {timeout} || sleep {sleep + timeout}" in worker_stop[2]


def test_a_stopped_worker_drains_its_own_node_first(tmp_path):
    """Run the worker's preStop with logging stand-ins: `elasticmoe drain-node` for the pod's own
    address; if it fails (the last devices, or no server), the pod sleeps through the head's drain."""
    log = tmp_path / "calls.log"
    env = _fake_commands(tmp_path / "bin", log, serve_failures=0)
    (tmp_path / "bin" / "hostname").write_text("#!/bin/sh\necho 10.1.2.3\n")
    (tmp_path / "bin" / "hostname").chmod(0o755)
    command = ray_container(pod_templates(render())["worker"])["lifecycle"]["preStop"]["exec"]["command"]
    subprocess.run(command, env=env, check=True, timeout=30)
    drain = f"elasticmoe drain-node --url http://{RELEASE}-elasticmoe:8000 --node 10.1.2.3 --timeout-s 60"
    assert log.read_text().splitlines() == [drain]
    (tmp_path / "bin" / "elasticmoe").write_text(f"#!/bin/sh\necho \"elasticmoe $*\" >> {log}; exit 1\n")
    log.unlink()
    subprocess.run(command, env=env, check=True, timeout=30)
    assert log.read_text().splitlines() == [drain, "sleep 65"]
    plain = render({"workers": {"drainOnStop": False}})
    command = ray_container(pod_templates(plain)["worker"])["lifecycle"]["preStop"]["exec"]["command"]
    log.unlink()
    subprocess.run(command, env=env, check=True, timeout=30)
    assert log.read_text().splitlines() == ["sleep 65"]


def test_every_ray_container_caps_malloc_arenas_and_openmp_spinning_as_a_local_ray_does():
    templates = pod_templates(render())
    assert set(templates) == {"head", "worker"}
    for group, template in templates.items():
        env = {e["name"]: e.get("value") for e in ray_container(template)["env"]}
        assert env["MALLOC_ARENA_MAX"] == LOCAL_RAY_DEFAULTS["MALLOC_ARENA_MAX"] == "2", group
        assert env["OMP_WAIT_POLICY"] == LOCAL_RAY_DEFAULTS["OMP_WAIT_POLICY"] == "PASSIVE", group
        assert env["GOMP_SPINCOUNT"] == LOCAL_RAY_DEFAULTS["GOMP_SPINCOUNT"] == "10000", group


def test_ray_token_authentication_from_the_operator_or_a_secret():
    def ray_env(objs: list[dict]) -> list[dict]:
        return [e for t in pod_templates(objs).values() for e in ray_container(t)["env"] if e["name"].startswith("RAY_")]

    default = render()  # KubeRay >= 1.5.1 makes the token and sets it on every pod
    assert one(default, "RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    assert ray_env(default) == []
    own = render({"rayAuth": {"mode": "secret", "existingSecret": "ray-token"}})
    assert "authOptions" not in one(own, "RayService")["spec"]["rayClusterConfig"]
    env = ray_env(own)
    assert len(env) == 4  # head and worker: the mode, and the token from the Secret
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in env
    assert {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ray-token", "key": "auth_token"}}} in env
    off = render({"rayAuth": {"mode": "disabled"}})
    assert "authOptions" not in one(off, "RayService")["spec"]["rayClusterConfig"] and ray_env(off) == []


_OUTSIDE = None
_OTHER_NS_POD = {"labels": {"app": "client"}, "namespace_labels": {"name": "apps"}, "same_namespace": False}
_RELEASE_POD = {"labels": {"app.kubernetes.io/instance": RELEASE}, "namespace_labels": {}, "same_namespace": True}
_OTHER_RELEASE_POD = {"labels": {"app.kubernetes.io/instance": "other"}, "namespace_labels": {}, "same_namespace": True}
_OPERATOR = {"labels": {"app.kubernetes.io/name": "kuberay-operator"}, "namespace_labels": {"name": "ray-system"},
             "same_namespace": False}
_MONITORING = {"labels": {"app": "prometheus"}, "namespace_labels": {"name": "monitoring"}, "same_namespace": False}
_GATEWAY = {"labels": {"app": "gw"}, "namespace_labels": {"name": "gateway"}, "same_namespace": False}
_RAY_AND_TORCH_PORTS = (6379, 8265, 10001, 52365, 8080, 8076, 10002, 29500, 45123)  # last: a rendezvous port


def test_network_policy_opens_the_api_and_keeps_ray_and_torch_ports_to_the_release():
    objs = render()
    policy = one(objs, "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress unrestricted, as documented
    for template in pod_templates(objs).values():
        labels = template["metadata"]["labels"]
        for source in (_OUTSIDE, _OTHER_NS_POD, _OTHER_RELEASE_POD, _RELEASE_POD):
            assert admits(policy, labels, 8000, source)
        for port in _RAY_AND_TORCH_PORTS:
            assert admits(policy, labels, port, _RELEASE_POD)
            for source in (_OUTSIDE, _OTHER_NS_POD, _OTHER_RELEASE_POD):
                assert not admits(policy, labels, port, source), (port, source)
        assert admits(policy, labels, 8265, _OPERATOR) and not admits(policy, labels, 6379, _OPERATOR)


def test_network_policy_with_serve_and_metrics_peers():
    policy = one(render({"networkPolicy": {
        "servePeers": [{"namespaceSelector": {"matchLabels": {"name": "gateway"}}}],
        "metricsPeers": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    }}), "NetworkPolicy")
    labels = {"app.kubernetes.io/instance": RELEASE}
    assert admits(policy, labels, 8000, _GATEWAY) and not admits(policy, labels, 8000, _OTHER_NS_POD)
    assert not admits(policy, labels, 8000, _OUTSIDE)
    assert admits(policy, labels, 8000, _MONITORING) and admits(policy, labels, 8080, _MONITORING)
    assert not admits(policy, labels, 6379, _GATEWAY) and not admits(policy, labels, 6379, _MONITORING)
    assert of_kind(render({"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def _key_envs(objs: list[dict]) -> dict[str, list[dict]]:
    """Container name -> its ELASTICMOE_*_KEY env entries, over every container of both groups."""
    found = {}
    for group, template in pod_templates(objs).items():
        for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
            found[f"{group}/{container['name']}"] = [e for e in container.get("env", []) if "KEY" in e["name"]]
    return found


def test_keys_come_only_from_secret_key_refs():
    api_key, admin_key = "sk-test-api-0123456789", "sk-test-admin-9876543210"
    texts = render_texts({"auth": {"apiKey": api_key, "adminKey": admin_key}})
    objs = objects(texts)
    secret = one(objs, "Secret")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == api_key
    assert base64.b64decode(secret["data"]["admin-key"]).decode() == admin_key
    for path, text in texts.items():
        if not path.endswith("secret.yaml"):
            for key in (api_key, admin_key):
                assert key not in text and base64.b64encode(key.encode()).decode() not in text, path
    envs = _key_envs(objs)
    for name in ("head/ray-head", "worker/ray-worker"):
        assert envs[name] == [
            {"name": f"ELASTICMOE_{kind}_KEY", "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"],
                                                                             "key": f"{kind.lower()}-key"}}}
            for kind in ("API", "ADMIN")
        ]
    existing = render({"auth": {"existingSecret": "moe-keys"}})
    assert of_kind(existing, "Secret") == []
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for es in _key_envs(existing).values() for e in es}
    assert refs == {"moe-keys"}
    assert all(es == [] for es in _key_envs(render()).values())


def test_schema_is_draft_07_and_closed_at_the_top():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False
    with helm.Chart.load(CHART) as chart:
        assert set(chart.values) <= set(schema["properties"])


@pytest.mark.parametrize("bad", [
    {"drain": {"timeoutSeconds": "60"}},
    {"unknownTopLevelKey": 1},
    {"coordinator": {"dtype": "float16"}},
    {"coordinator": {"no_such_field": 1}},
    {"workers": {"devicesPerPod": 0}},
    {"auth": {"apiKey": "short"}},
    {"probes": {"liveness": {"path": "health"}}},
    {"terminationGracePeriodSeconds": -1},
], ids=lambda bad: json.dumps(bad))
def test_schema_rejects_bad_values(bad):
    with pytest.raises(helm.HelmValuesError):
        render(bad)
    assert _lint_problems(bad)


@pytest.mark.parametrize("bad, message", [
    ({"coordinator": {"dp": 3}}, "coordinator.dp"),
    ({"workers": {"replicas": 3, "maxReplicas": 2}}, "minReplicas <= replicas <= maxReplicas"),
    ({"coordinator": {"kv_bytes_per_device": 2 << 30}}, "kv_bytes_per_device"),
    ({"autoscale": {"min_dp": 2, "max_dp": 1}}, "min_dp"),
    ({"auth": {"existingSecret": "x", "apiKey": "0123456789"}}, "auth"),
    ({"rayAuth": {"mode": "secret"}}, "rayAuth.existingSecret"),
    ({"coordinator": {"max_devices": 0}}, "max_devices"),
])
def test_cross_field_invariants_fail_the_render(bad, message):
    with pytest.raises(helm.HelmError, match=message):
        render(bad)


def test_worker_pods_offer_devices_and_the_group_may_grow():
    """Each worker pod is a Ray node offering `elasticmoe_device`; the serve args count the pods'
    devices at start; a group that may grow turns on KubeRay's in-tree autoscaler."""
    values = {"workers": {"replicas": 2, "minReplicas": 1, "maxReplicas": 4, "devicesPerPod": 3}}
    objs = render(values)
    cluster = one(objs, "RayService")["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 2, 4)
    assert ray_start_resources(group["rayStartParams"])[DEVICE_RESOURCE] == 3
    assert cluster["enableInTreeAutoscaling"] is True
    (app,) = serve_config(objs)["applications"]
    # Scales may ask for the pods the group may still add, and idle pods are given back.
    assert (app["args"]["num_devices"], app["args"]["max_devices"], app["args"]["release_idle_nodes"]) == (6, 12, True)
    fixed = render(None)
    assert one(fixed, "RayService")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    (app,) = serve_config(fixed)["applications"]
    assert "max_devices" not in app["args"] and "release_idle_nodes" not in app["args"]


def test_gpu_values_put_gpus_on_the_worker_group_only():
    templates = pod_templates(render(gpu_values()))
    worker = ray_container(templates["worker"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4 == worker["resources"]["requests"]["nvidia.com/gpu"]
    assert worker["image"].endswith(":0.1.0-cuda")
    assert "nvidia.com/gpu" not in json.dumps(templates["head"])
    assert all("nvidia.com/gpu" not in text for text in render_texts().values())


def test_serve_args_build_the_coordinator_config(tiny_model_dir):
    from coordinator.deployment import config_from_args

    growing = {"workers": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}}
    for values in (None, gpu_values(), growing):
        objs = render(values)
        (app,) = serve_config(objs)["applications"]
        assert app["import_path"] == "coordinator.deployment:app_builder" and app["route_prefix"] == "/"
        args = app["args"]
        assert set(args["autoscale"]) >= {"enabled", "min_dp", "max_dp", "slo_ttft_s", "slo_tpot_s",
                                          "target_attainment", "window_s", "cooldown_s"}
        config = config_from_args({**args, "model_dir": tiny_model_dir}, environ={})
        with helm.Chart.load(CHART) as chart:
            merged = chart.merge_values(values)
        assert (config.dp, config.dtype) == (merged["coordinator"]["dp"], merged["coordinator"]["dtype"])
        assert config.num_devices == merged["workers"]["replicas"] * merged["workers"]["devicesPerPod"]
        assert config.autoscale.enabled is merged["autoscale"]["enabled"]
        assert args["model_dir"] == merged["model"]["path"]
        assert config.max_devices == args.get("max_devices") and config.release_idle_nodes is bool(
            args.get("release_idle_nodes"))
        # No placement override: the coordinator and the ingress pin themselves to the head.
        assert "deployments" not in app


def test_model_is_generated_by_default_or_mounted_from_a_pvc():
    for template in pod_templates(render()).values():
        (init,) = template["spec"]["initContainers"]
        assert init["command"] == ["elasticmoe", "make-model", "--arch", "qwen3_moe", "--preset", "tiny",
                                   "--seed", "0", "--out", "/models/tiny-qwen3-moe"]
        assert {"name": "model", "emptyDir": {"sizeLimit": "2Gi"}} in template["spec"]["volumes"]
    for template in pod_templates(render({"model": {"pvc": {"claimName": "weights"}}})).values():
        assert "initContainers" not in template["spec"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} \
            in template["spec"]["volumes"]
        mount = next(m for m in ray_container(template)["volumeMounts"] if m["name"] == "model")
        assert mount == {"name": "model", "mountPath": "/models/tiny-qwen3-moe", "readOnly": True}


def test_service_and_disruption_budget_select_the_head_only():
    objs = render()
    templates = pod_templates(objs)
    head, worker = templates["head"]["metadata"]["labels"], templates["worker"]["metadata"]["labels"]

    def selects(selector: dict) -> tuple[bool, bool]:
        return (all(head.get(k) == v for k, v in selector.items()), all(worker.get(k) == v for k, v in selector.items()))

    service = one(objs, "Service")
    assert selects(service["spec"]["selector"]) == (True, False)
    assert service["spec"]["ports"][0]["targetPort"] == "serve"
    pdb = one(objs, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"]) == (True, False)
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]


def test_ingress_and_service_monitor_point_at_the_service():
    objs = render(ALL_OPTIONAL)
    service = one(objs, "Service")
    port_name = service["spec"]["ports"][0]["name"]
    backend = one(objs, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": port_name}}
    monitor = one(objs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(service["metadata"]["labels"].get(k) == v for k, v in selector.items())
    assert monitor["spec"]["endpoints"] == [{"port": port_name, "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def _dashboard_map(objs: list[dict]) -> dict[str, str]:
    maps = [c for c in of_kind(objs, "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    return maps[0]["data"] if maps else {}


def test_dashboards_come_through_the_symlink_when_rendering_and_packaging(tmp_path):
    assert (CHART / "dashboards").is_symlink() and DASHBOARDS, \
        "helm/elasticmoe/dashboards must link to deploy/grafana holding *.json dashboards"
    enabled = {"metrics": {"grafanaDashboards": {"enabled": True}}}
    data = _dashboard_map(render(enabled))
    assert sorted(data) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert json.loads(data[path.name]) == json.loads(path.read_text())
    archive = helm.package(CHART, destination=tmp_path)
    names = tarfile.open(archive).getnames()
    assert {f"elasticmoe/dashboards/{p.name}" for p in DASHBOARDS} <= set(names)
    assert "elasticmoe/values.schema.json" in names
    assert sorted(_dashboard_map(render(enabled, chart=archive))) == sorted(data)
    assert _dashboard_map(render()) == {}


def test_render_succeeds_with_no_dashboards(tmp_path):
    chart = Path(shutil.copytree(CHART, tmp_path / "elasticmoe", symlinks=True))
    (chart / "dashboards").unlink()
    (chart / "dashboards").mkdir()
    texts = render_texts({"metrics": {"grafanaDashboards": {"enabled": True}}}, chart=chart)
    assert _dashboard_map(objects(texts)) == {}
    assert "no dashboard ConfigMap was created" in texts["elasticmoe/templates/NOTES.txt"]


def test_notes_tell_how_to_reach_the_api():
    notes = render_texts()["elasticmoe/templates/NOTES.txt"]
    assert f"port-forward svc/{RELEASE}-elasticmoe 8000:8000" in notes
    assert "<no value>" not in notes

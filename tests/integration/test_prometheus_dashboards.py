"""Every Grafana panel query returns data from a real Prometheus scraping a real elastic server.

One elastic server per module (tiny Qwen3-MoE, float32, 2 devices, dp 1, an ESFT and a LoRA
adapter loaded at start) and one Prometheus (Debian's `prometheus`, installed with apt-get
when missing and running as root) scraping it every second, with its own data directory
and ports. The test sends base and adapter requests, scales dp 1 -> 2, waits until
Prometheus saw the new configuration, then runs every panel target and annotation query of
every dashboard in deploy/grafana/ (read from the JSON, Grafana's interval variables
substituted) through Prometheus's HTTP API and requires a non-empty result from each.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from elastic_server import running, tiny_config

from coordinator.launch import ElasticServer
from elasticmoe.utils.ports import free_port

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-moe"
ESFT, LORA = "esft-a", "lora-a"
DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "grafana").glob("*.json"))
# Grafana's variables in queries -> what an instant query uses instead (windows that cover the test).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m"}


def prometheus_binary() -> str:
    """The `prometheus` binary; installs Debian's package when missing (root only)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0:
        pytest.fail("no `prometheus` binary on PATH and not root: install it first "
                    "(apt-get install --no-install-recommends prometheus) or run as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]):
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    found = shutil.which("prometheus")
    if not found:
        pytest.fail("apt-get installed `prometheus` but no binary is on PATH")
    return found


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation of every dashboard."""
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                out.append((f"{path.name}: {panel['title']} [{target['refId']}]", target["expr"]))
        for ann in dashboard["annotations"]["list"]:
            if ann.get("expr"):
                out.append((f"{path.name}: annotation {ann['name']}", ann["expr"]))
    return out


def substitute(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}: add it to GRAFANA_VARIABLES"
    return expr


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    from elasticmoe.tools.make_esft_adapter import make_esft_adapter
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    root = tmp_path_factory.mktemp("prom-adapters")
    return {
        ESFT: str(make_esft_adapter(tiny_model_dir, str(root / ESFT), experts_per_layer=2, seed=1)),
        LORA: str(make_lora_adapter(tiny_model_dir, str(root / LORA), rank=4, seed=2)),
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapter_dirs) -> Iterator[ElasticServer]:
    config = tiny_config(tiny_model_dir, served_model_name=MODEL, max_esft_adapters=2, max_esft_experts=2,
                         esft_adapters=((ESFT, adapter_dirs[ESFT]),), max_loras=1, max_lora_rank=4,
                         lora_adapters=((LORA, adapter_dirs[LORA]),))
    with running(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory) -> Iterator[str]:
    """URL of a Prometheus scraping `server` every second."""
    binary = prometheus_binary()
    root = tmp_path_factory.mktemp("prometheus")
    target = server.url.removeprefix("http://")
    (root / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        f"scrape_configs:\n  - job_name: elasticmoe\n    static_configs:\n      - targets: ['{target}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    log = open(root / "prometheus.log", "wb")  # closed at teardown
    proc = subprocess.Popen(
        [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address={address}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://{address}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (root / "prometheus.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query(prometheus: str, expr: str) -> dict:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
    return body["data"]


def _values(prometheus: str, expr: str) -> list[float]:
    return [float(s["value"][1]) for s in _query(prometheus, expr)["result"]]


def _wait_for(prometheus: str, expr: str, timeout_s: float = 30.0) -> None:
    """Until the instant query `expr` has a result (a filter such as `x == 2`)."""
    deadline = time.monotonic() + timeout_s
    while not _values(prometheus, expr):
        assert time.monotonic() < deadline, f"prometheus never saw {expr}"
        time.sleep(0.5)


def _send_traffic(client: httpx.Client) -> None:
    for model in (MODEL, ESFT, LORA):
        r = client.post("/v1/completions", json={"model": model, "prompt": "the expert model serves",
                                                 "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"}).status_code == 404


def test_every_dashboard_query_has_data(server, prometheus):
    queries = dashboard_queries()
    assert len(queries) > 20, queries
    with httpx.Client(base_url=server.url, timeout=60) as client:
        _wait_for(prometheus, 'up{job="elasticmoe"} == 1')
        _send_traffic(client)
        # NOTE: counts of an instance between its last scrape and its retirement are lost
        _wait_for(prometheus, "elasticmoe_lora_hits_total >= 1")
        r = client.post("/admin/scale", json={"dp": 2})
        assert r.status_code == 202, r.text
        event_id = r.json()["event_id"]
        deadline = time.monotonic() + 90
        while (event := client.get(f"/admin/scale/{event_id}").json())["state"] == "running":
            assert time.monotonic() < deadline, event
            time.sleep(0.25)
        assert event["state"] == "succeeded", event
        _send_traffic(client)  # on the dp 2 instance: both ranks have counters

    _wait_for(prometheus, "elasticmoe_active_dp == 2")
    _wait_for(prometheus, 'elasticmoe_scale_events_total{outcome="succeeded"} == 1')
    _wait_for(prometheus, "elasticmoe_lora_hits_total >= 2")
    _wait_for(prometheus, 'count(elasticmoe_device_memory_layout_bytes{kind="adapters"} > 0) == 2')
    time.sleep(3)  # a few more scrapes, so every rate window holds samples after the last request

    # the layout's bytes by kind are exactly what the HMM charged, once the scale committed
    assert _values(prometheus, "elasticmoe_device_memory_used_bytes - on (device) "
                               "sum by (device) (elasticmoe_device_memory_layout_bytes)") == [0.0, 0.0]

    empty = []
    for where, expr in queries:
        if not _query(prometheus, substitute(expr))["result"]:
            empty.append(f"{where}: {expr}")
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_dashboard_queries_name_only_known_variables():
    for _, expr in dashboard_queries():
        substitute(expr)

"""Adapters on a server whose engines are vLLM replicas are refused up front, naming the backend."""

from types import SimpleNamespace

import pytest

from coordinator.adapters import ClusterAdapterHost
from elasticmoe.errors import AdapterLimitError


def _host(backend: str) -> ClusterAdapterHost:
    config = SimpleNamespace(backend=backend, adapter_eviction="coserve", profile=None, max_esft_adapters=4,
                             max_esft_experts=16, max_loras=2)
    cluster = SimpleNamespace(config=config, scale_events=SimpleNamespace(running=None), active=None)
    return ClusterAdapterHost(cluster, publish=lambda names: None)  # type: ignore[arg-type]


@pytest.mark.parametrize("load", [
    lambda host: host.load_blocking("law", "/adapters/law", {0: (1,)}),
    lambda host: host.load_lora_blocking("fr", "/adapters/fr"),
])
def test_adapters_need_the_native_backend(load):
    host = _host("vllm")
    with pytest.raises(AdapterLimitError, match="adapters need --backend native; this server runs --backend vllm"):
        load(host)
    assert host.adapters == {}  # nothing registered, nothing to clean up

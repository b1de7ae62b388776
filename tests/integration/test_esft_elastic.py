"""ESFT and LoRA adapters on the elastic cluster (tiny Qwen3-MoE, 3 devices, float32, no HTTP).

Three adapters loaded through the HMM (pages on the devices holding the base experts
they replace) serve requests equal to their merged models, base included; the same
after DP1 -> 2 (experts moved across devices, adapters with them) and DP2 -> 1; unloading
while one of its requests runs keeps that request unchanged, refuses new ones, and
returns every page to the pools. A LoRA adapter on attention and experts serves its merged
model at DP1 and after DP1 -> 2 (each rank holds its own experts' factors), beside ESFT.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from elastic_server import cluster_of, tiny_config

from coordinator.cluster import ClusterManager
from coordinator.scale_events import ScaleConflict, ScaleState
from coordinator.scaler import Scaler
from elasticmoe.config import EngineConfig
from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.errors import AdapterConflictError, UnknownAdapterError
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_esft_adapter import make_esft_adapter, write_merged_model
from imm.handover import spliced_stream

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NAMES = ("alpha", "beta", "gamma")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[Any, tuple[str, list[int], str]]:
    """name -> (adapter dir, greedy tokens of its merged model, merged model dir); None -> the base."""
    root = tmp_path_factory.mktemp("esft-elastic")
    out: dict[Any, tuple[str, list[int], str]] = {None: ("", _reference(tiny_model_dir), tiny_model_dir)}
    for seed, name in enumerate(NAMES, start=1):
        path = str(make_esft_adapter(tiny_model_dir, str(root / name), experts_per_layer=2, seed=seed, noise=0.5))
        merged = str(write_merged_model(tiny_model_dir, path, str(root / f"{name}-m")))
        out[name] = (path, _reference(merged), merged)
    assert len({tuple(v[1]) for v in out.values()}) == 4  # every adapter changes the output
    return out


def _reference(model_dir: str, params: SamplingParams = PARAMS) -> list[int]:
    engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=128))
    engine.add_request("ref", PROMPT, params)
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    return done[0].output_token_ids


@pytest.fixture(scope="module")
def cluster(tiny_model_dir) -> Iterator[ClusterManager]:
    config = tiny_config(tiny_model_dir, num_devices=3, max_esft_adapters=3, max_esft_experts=2,
                         max_loras=2, max_lora_rank=4)
    with cluster_of(config) as cl:
        yield cl


def _generate(cluster: ClusterManager, rid: str, adapter: str | None, params: SamplingParams = PARAMS) -> list[int]:
    rank = cluster.active.ranks[hash(rid) % cluster.active.dp]
    outs = [o for o in spliced_stream(rank.generate.remote(EngineRequest(rid, PROMPT, params, AdapterRef(adapter))))
            if isinstance(o, RequestOutput)]
    assert outs[-1].finished
    return outs[-1].output_token_ids


def _check_all(cluster: ClusterManager, adapters: dict, tag: str) -> None:
    for name in (None, *NAMES):
        for i in range(cluster.active.dp):  # every rank serves every adapter
            assert _generate(cluster, f"{tag}-{name}-{i}", name) == adapters[name][1], (tag, name)


def test_adapters_equal_merged_models_across_scaling(cluster, adapters):
    hmm, host = cluster.hmm, cluster.adapters
    used_before = {d: u.used for d, u in hmm.usage().items()}
    for name in NAMES:
        host.load_blocking(name, adapters[name][0], _experts(adapters[name][0]))
    assert sum(u.used for u in hmm.usage().values()) > sum(used_before.values())  # pages for the experts
    _check_all(cluster, adapters, "dp1")

    for dp in (2, 1):
        event = Scaler(cluster).scale(dp)
        assert event.state is ScaleState.SUCCEEDED, event.error
        _check_all(cluster, adapters, f"dp{dp}")

    for name in NAMES:
        assert host.unload_blocking(name, wait=True)
    assert {d: u.used for d, u in hmm.usage().items()} == used_before  # every page returned
    assert hmm.adapters == {} and host.adapters == {}


def test_unload_under_load_then_reload(cluster, adapters):
    hmm, host = cluster.hmm, cluster.adapters
    used_before = {d: u.used for d, u in hmm.usage().items()}
    host.load_blocking("alpha", adapters["alpha"][0], _experts(adapters["alpha"][0]))
    long = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
    rank = cluster.active.ranks[0]
    stream = spliced_stream(rank.generate.remote(EngineRequest("long-alpha", PROMPT, long, AdapterRef("alpha"))))
    first = next(stream)
    assert isinstance(first, RequestOutput) and not first.finished
    assert host.unload_blocking("alpha") is False  # its request still runs
    with pytest.raises(ScaleConflict, match="unloading"):
        Scaler(cluster).start(2)
    with pytest.raises(UnknownAdapterError):
        _generate(cluster, "refused", "alpha")
    outs = [first, *[o for o in stream if isinstance(o, RequestOutput)]]
    assert outs[-1].finished and outs[-1].output_token_ids == _reference(adapters["alpha"][2], long)
    deadline = time.monotonic() + 10
    while "alpha" in host.adapters:  # released in the background once the request finished
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert {d: u.used for d, u in hmm.usage().items()} == used_before
    host.load_blocking("alpha", adapters["alpha"][0], _experts(adapters["alpha"][0]))
    assert _generate(cluster, "reloaded", "alpha") == adapters["alpha"][1]


def _experts(path: str) -> dict[int, tuple[int, ...]]:
    from elasticmoe.adapters.esft import EsftConfig

    return EsftConfig.from_file(f"{path}/expert_cfg.json").experts



def test_lora_across_scaling(cluster, adapters, tmp_path):
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter, write_lora_merged_model

    base = cluster.config.model_dir
    path = str(make_lora_adapter(base, str(tmp_path / "lora"), rank=4, seed=11,
                                 target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")))
    want = _reference(str(write_lora_merged_model(base, path, str(tmp_path / "merged"))))
    host = cluster.adapters
    host.load_lora_blocking("style", path)
    assert [a["type"] for a in asyncio_run(host.describe()) if a["name"] == "style"] == ["lora"]
    for i in range(cluster.active.dp):
        assert _generate(cluster, f"lora-dp1-{i}", "style") == want
    event = Scaler(cluster).scale(2)
    assert event.state is ScaleState.SUCCEEDED, event.error
    for i in range(cluster.active.dp):  # the new instance loaded it for its own placement
        assert _generate(cluster, f"lora-dp2-{i}", "style") == want
    # A learned router over it, registered on the active instance and carried across a scale.
    from elasticmoe.adapters.lora_router import LoraRouter, random_router

    r = random_router(("style",), cluster.hmm.model_config.hidden_size, top_k=1)
    host.load_router_blocking("mix", LoraRouter(r.adapters, 1, r.w1, r.b1, r.w2, r.b2))
    assert Scaler(cluster).scale(1).state is ScaleState.SUCCEEDED
    rank = cluster.active.ranks[0]
    routed = [o for o in spliced_stream(rank.generate.remote(EngineRequest(
        "learned", PROMPT, PARAMS, AdapterRef(routing={"type": "learned", "router": "mix"}))))
              if isinstance(o, RequestOutput)]
    assert routed[-1].output_token_ids == want  # top-1 of one adapter: that adapter
    with pytest.raises(AdapterConflictError, match=r"routers \['mix'\]"):
        host.unload_blocking("style")  # the router depends on it
    assert host.unload_blocking("mix") and host.routers == {}
    assert host.unload_blocking("style", wait=True)
    with pytest.raises(UnknownAdapterError):
        _generate(cluster, "lora-gone", "style")


def asyncio_run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


def test_esft_adapters_beyond_the_slots_swap_in_on_demand(cluster, adapters, tmp_path):
    """Four adapters over three slots: the fourth is registered on disk, a request for it makes
    the coordinator swap out a resident one (its rows back to the pools) and swap it in; the same
    under EP at dp 2; every adapter's output equals its merged model, whichever was swapped."""
    hmm, host = cluster.hmm, cluster.adapters
    residency = host.residency
    residency.min_resident_s = 0.0  # no request waits between the swaps here
    for name in list(host.adapters):  # what the tests before left
        assert host.unload_blocking(name, wait=True)
    used_before = {d: u.used for d, u in hmm.usage().items()}
    extra = str(make_esft_adapter(cluster.config.model_dir, str(tmp_path / "delta"), experts_per_layer=2, seed=9,
                                  noise=0.5))
    want = {**{n: adapters[n][1] for n in NAMES},
            "delta": _reference(str(write_merged_model(cluster.config.model_dir, extra, str(tmp_path / "delta-m"))))}
    for name in NAMES:
        host.load_blocking(name, adapters[name][0], _experts(adapters[name][0]), usage_probability=0.3)
    info = host.load_blocking("delta", extra, _experts(extra), usage_probability=0.1)
    assert info["slot"] is None and host.swapped_out == ("delta",)  # registered on disk, not refused
    assert cluster.feed.current.swapped_out == ("delta",) and "delta" in cluster.feed.current.adapters
    with pytest.raises(UnknownAdapterError):  # no rank admits it before its swap
        _generate(cluster, "early-delta", "delta")
    for dp in (1, 2):
        if cluster.active.dp != dp:
            assert Scaler(cluster).scale(dp).state is ScaleState.SUCCEEDED
        for name in ("delta", *NAMES, "delta"):
            asyncio_run(residency.make_resident(name))
            assert name not in host.swapped_out and len(host.swapped_out) == 1  # one on disk: three slots
            for i in range(cluster.active.dp):
                assert _generate(cluster, f"swap-dp{dp}-{name}-{i}", name) == want[name], (dp, name)
    assert residency.num_swaps_in >= 4 and residency.num_evictions >= 4
    assert {a["name"]: a["resident"] for a in asyncio_run(host.describe())} == {
        n: n not in host.swapped_out for n in (*NAMES, "delta")}
    with pytest.raises(UnknownAdapterError):
        asyncio_run(residency.make_resident("nobody"))
    for name in (*NAMES, "delta"):  # resident or on disk alike
        assert host.unload_blocking(name, wait=True)
    assert hmm.adapters == {} and host.adapters == {}
    assert Scaler(cluster).scale(1).state is ScaleState.SUCCEEDED
    assert sum(u.used for u in hmm.usage().values()) == sum(used_before.values())  # every row's pages returned

"""The vLLM backend (`--backend vllm`) on a real cluster, in the venv with the `vllm` extra
(`make test-vllm`; skipped where vLLM is not installed).

One Ray cluster (2 logical devices, no HTTP: the ingress's own `RouterEngineClient` over the
published ranks) and four vLLM engines for the module: the dp 1 instance, the pooled dp 2
standby (two replicas), and dp 1 again; plus one vLLM engine in this process, run directly on
the checkpoint, as the oracle:

- greedy tokens through the backend (weights from the HMM through our loader) equal vLLM's own;
- the weights are the HMM's: what vLLM reads as given is mapped in place, its CPU repacks are
  copies, both measured per tensor kind (printed as JSON for the docs);
- scale 1 -> 2 -> 1 replicas while clients stream back to back: every request completes, with the
  same tokens and text as without scaling, the running ones recomputed on their new replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM backend's tests run in .venv-vllm (make test-vllm)")

from elastic_server import cluster_of, tiny_config  # noqa: E402

from coordinator.cluster import ClusterManager  # noqa: E402
from coordinator.engine_client import RouterEngineClient  # noqa: E402
from coordinator.router import Router  # noqa: E402
from coordinator.scale_events import ScaleState  # noqa: E402
from coordinator.scaler import Scaler  # noqa: E402
from elasticmoe.engine.engine_request import EngineRequest  # noqa: E402
from elasticmoe.sampling_params import SamplingParams  # noqa: E402
from imm.vllm_loader import WeightReport  # noqa: E402
from imm.vllm_support import CPU_HEAD_SIZES  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23], [30, 31]]
MAX_TOKENS = 40
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory) -> str:
    from elasticmoe.tools.make_model import make_model

    return str(make_model("qwen3_moe", "tiny-vllm", seed=0, out=str(tmp_path_factory.mktemp("models") / "m")))


@pytest.fixture(scope="module")
def direct(vllm_model) -> list[list[int]]:
    """Greedy tokens per prompt from vLLM run directly on the checkpoint (its own loader), in this
    process (the only vLLM engine here: the backend's run in the rank processes)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=vllm_model, dtype="float32", enforce_eager=True, seed=0, skip_tokenizer_init=True,
              kv_cache_memory_bytes=8 << 20)
    params = VllmSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def cluster(vllm_model) -> Iterator[ClusterManager]:
    # NOTE: no standby refill after a scale (standby_delay_s): the start pools dp 2, the scale back
    # to dp 1 boots its instance; that keeps the module at four vLLM engines.
    config = tiny_config(vllm_model, backend="vllm", kv_bytes_per_device=8 << 20, standby_pool=True,
                         standby_delay_s=3600)
    with cluster_of(config) as cl:
        yield cl


async def _complete(client: RouterEngineClient, prompt: list[int]) -> tuple[list[int], str]:
    out = None
    async for item in client.generate(EngineRequest(uuid.uuid4().hex, prompt, PARAMS)):
        out = item
    assert out is not None and out.finished and out.finish_reason == "length", out
    return out.output_token_ids, out.text


async def _with_ingress(cluster: ClusterManager, body: Any) -> Any:
    """Run `body(client)` with an ingress client whose router follows what the cluster publishes."""
    router: Router[Any] = Router(max_hold_s=60)
    router.update(cluster.routing)

    async def follow() -> None:
        while True:
            state = cluster.routing
            if router.state is None or state.key != router.state.key:
                router.update(state)
            await asyncio.sleep(0.005)

    follower = asyncio.create_task(follow())
    client = RouterEngineClient(router, tokenizer=None, max_queued=64)
    try:
        return await body(client)
    finally:
        follower.cancel()


@pytest.fixture(scope="module")
def baseline(cluster) -> list[tuple[list[int], str]]:
    """(tokens, text) per prompt through the backend at dp 1, nothing scaling."""

    async def body(client: RouterEngineClient) -> list[tuple[list[int], str]]:
        return list(await asyncio.gather(*[_complete(client, p) for p in PROMPTS]))

    return asyncio.run(_with_ingress(cluster, body))


def test_greedy_outputs_equal_vllm_run_directly(baseline, direct):
    assert [tokens for tokens, _ in baseline] == direct
    assert all(len(t) == MAX_TOKENS and text for t, text in baseline)


def test_logit_bias_reaches_vllm_through_the_backend(cluster, baseline):
    """A bias of 100 forces its token and one of -100 bans the token vLLM chose first."""
    banned = baseline[0][0][0]

    async def body(client: RouterEngineClient) -> tuple[list[int], list[int]]:
        async def tokens(bias: dict[int, float]) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=bias)
            out = None
            async for item in client.generate(EngineRequest(uuid.uuid4().hex, PROMPTS[0], params)):
                out = item
            assert out is not None and out.finished, out
            return out.output_token_ids

        return await tokens({42: 100.0}), await tokens({banned: -100.0})

    forced, without_first = asyncio.run(_with_ingress(cluster, body))
    assert forced == [42] * 6
    assert banned not in without_first


def test_the_vllm_head_sizes_we_check_are_vllms():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES


def test_weights_are_attached_from_the_hmm(cluster, baseline):
    inst = cluster.active
    assert inst is not None and inst.backend == "vllm" and inst.dp == 1
    (report,) = inst.attach_reports
    assert isinstance(report, WeightReport) and report.is_zero_copy
    sizes = dict(cluster.hmm.layout.sizes.dense)
    norms = sum(b for n, b in sizes.items() if "norm" in n.rsplit(".", 1)[-1])
    kinds = report.kinds
    # Read in place: the norms, the embedding (lookups) and the LM head's parameter.
    assert kinds["norms"].mapped == norms and kinds["norms"].copied == 0
    assert kinds["embed"].mapped == sizes["embed"] and kinds["lm_head"].mapped == sizes["lm_head"]
    # Every byte of the model is accounted for, once as mapped or copied at least.
    experts = sum(b for _, _, b in cluster.hmm.layout.sizes.expert_stacks) * cluster.hmm.layout.sizes.num_experts
    assert kinds["experts"].mapped + kinds["experts"].copied == experts
    assert report.bytes_mapped + report.bytes_copied >= sum(sizes.values()) + experts
    assert report.attach_s < 1.0  # built in standby on a replica's handles; attach moves the mapped ones
    print(json.dumps({"weights": report.as_dict()}))  # the docs quote it (docs/engine.md, vLLM backend)


def test_scale_1_2_1_under_streaming_load_loses_nothing(cluster, baseline):
    results: list[tuple[int, list[int], str]] = []
    events = []
    cluster.wait_standby()  # the pool's dp 2 (two replicas, engines built) is ready: the steady state
    assert sorted(cluster.standby.pool) == [2]

    async def body(client: RouterEngineClient) -> None:
        stop = asyncio.Event()

        async def loop(i: int) -> None:
            while not stop.is_set():
                tokens, text = await _complete(client, PROMPTS[i])
                results.append((i, tokens, text))

        clients = [asyncio.create_task(loop(i)) for i in range(len(PROMPTS))]
        await asyncio.sleep(0.5)  # every client is mid-stream
        scaler = Scaler(cluster)
        for dp in (2, 1):
            events.append(await asyncio.to_thread(scaler.scale, dp))
            await asyncio.sleep(0.5)  # streams progress on the new instance
        stop.set()
        await asyncio.gather(*clients)  # a failed request raises here

    asyncio.run(_with_ingress(cluster, body))
    for event in events:
        assert event.state is ScaleState.SUCCEEDED, event.to_dict()
        print(json.dumps({"scale": event.to_dict()}))
    assert sum(e.requests_handed_over for e in events) > 0  # requests were running at the switchovers
    assert events[0].scale_latency_s < events[1].scale_latency_s  # dp 2 came from the pool, dp 1 booted now
    assert cluster.active is not None and cluster.active.dp == 1
    assert len(results) >= 2 * len(PROMPTS)
    for i, tokens, text in results:
        assert (tokens, text) == baseline[i], f"prompt {i} changed"

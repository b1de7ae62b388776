"""EP=2 across two processes (gloo all-to-all) gives the same logits as EP=1."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_runs import greedy_run

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.parallel.lockstep import run_until_all_done
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.utils.ports import free_port

# Different prompt counts, lengths and output lengths per rank: rank 1 runs out of
# work first and must keep stepping (empty forwards) while rank 0 finishes.
MAX_TOKENS = {0: 10, 1: 4}
RANK_PROMPTS = {0: [[5, 6, 7, 8, 9] * 6, list(range(40, 61)), [3, 4]], 1: [[11, 12, 13]]}


def _ep_worker(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, ep_rank=rank, ep_size=world, num_threads=1))
        assert engine.weights["layers.1.moe.w13"].shape[0] == engine.model_config.num_experts // world
        tokens, logits = greedy_run(engine, RANK_PROMPTS[rank], MAX_TOKENS[rank], dist.group.WORLD)
        # NOTE: numpy, not tensors: torch's queue shares tensors through a socket of this process,
        # which may have exited by the time the parent reads them.
        queue.put((rank, (tokens, [t.numpy() for t in logits])))
    except BaseException as e:  # report instead of leaving the parent waiting for a result
        queue.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_ep2_matches_ep1(arch, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_ep_worker, args=(r, 2, port, model_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    failures = [r for r in results.values() if isinstance(r, str)]
    assert not failures, failures
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    for rank, prompts in RANK_PROMPTS.items():
        reference = greedy_run(LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32)), prompts, MAX_TOKENS[rank])
        got = results[rank]
        assert got[0] == reference[0], f"rank {rank}: tokens differ"
        assert len(got[1]) == len(reference[1])
        for a, b in zip(got[1], reference[1], strict=True):
            assert (torch.from_numpy(a) - b).abs().max().item() <= 1e-4


def _lora_worker(rank: int, world: int, port: int, model_dir: str, adapter_dir: str, queue) -> None:
    from elasticmoe.adapters.lora import LoraAdapter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, ep_rank=rank, ep_size=world,
                                        num_threads=1, max_loras=1, max_lora_rank=4))
        a = LoraAdapter.open("style", adapter_dir, engine.model_config)
        engine.adapters.load_lora("style", a.modules, a.weights, a.config.scaling)
        # Rank 0 mixes LoRA and base requests, rank 1 runs base only: its experts still apply the
        # LoRA factors of the adapter tokens rank 0 sends them.
        adapters = {0: ["style", None, "style"], 1: [None]}[rank]
        for i, (p, name) in enumerate(zip(RANK_PROMPTS[rank], adapters, strict=True)):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rank], ignore_eos=True),
                               name)
        outs = run_until_all_done(engine, dist.group.WORLD)
        queue.put((rank, {o.request_id: o.output_token_ids for o in outs if o.finished}))
    except BaseException as e:
        queue.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ep2_lora_on_experts_matches_ep1(tiny_model_dir, tmp_path):
    """Expert LoRA factors live with their expert's rank; the adapter slot of each (token, expert)
    pair travels with it through the all-to-all: EP=2 gives EP=1's tokens."""
    from elasticmoe.adapters.lora import LoraAdapter
    from elasticmoe.tools.make_lora_adapter import make_lora_adapter

    adapter_dir = str(make_lora_adapter(tiny_model_dir, str(tmp_path / "lora"), rank=4, seed=5,
                                        target_modules=("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_lora_worker, args=(r, 2, port, tiny_model_dir, adapter_dir, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    assert not [r for r in results.values() if isinstance(r, str)], results
    for p in procs:
        p.join(timeout=60)

    reference = LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32, max_loras=1, max_lora_rank=4))
    a = LoraAdapter.open("style", adapter_dir, reference.model_config)
    reference.adapters.load_lora("style", a.modules, a.weights, a.config.scaling)
    for rank, names in {0: ["style", None, "style"], 1: [None]}.items():
        for i, (p, name) in enumerate(zip(RANK_PROMPTS[rank], names, strict=True)):
            reference.add_request(f"{rank}-{i}", p,
                                  SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rank], ignore_eos=True), name)
    want = {}
    while reference.has_unfinished_requests():
        want.update({o.request_id: o.output_token_ids for o in reference.step() if o.finished})
    for rank in (0, 1):
        for rid, tokens in results[rank].items():
            assert tokens == want[f"{rank}-{rid}"], (rank, rid)

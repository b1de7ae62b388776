"""EP=2 across two processes (gloo all-to-all) gives the same logits as EP=1."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.parallel.lockstep import run_until_all_done
from elasticmoe.sampling_params import SamplingParams

# Different prompt counts, lengths and output lengths per rank: rank 1 runs out of
# work first and must keep stepping (empty forwards) while rank 0 finishes.
MAX_TOKENS = {0: 10, 1: 4}
RANK_PROMPTS = {0: [[5, 6, 7, 8, 9] * 6, list(range(40, 61)), [3, 4]], 1: [[11, 12, 13]]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(engine: LLMEngine, prompts, max_tokens: int, group=None) -> tuple[dict, list[torch.Tensor]]:
    logits: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def record(hidden):
        out = original(hidden)
        logits.append(out.clone())
        return out

    engine.model.compute_logits = record  # type: ignore[method-assign]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    if group is None:
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
    else:
        outs = run_until_all_done(engine, group)
    return {o.request_id: o.output_token_ids for o in outs if o.finished}, [t for t in logits if t.numel()]


def _ep_worker(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        engine = LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, ep_rank=rank, ep_size=world, num_threads=1))
        assert engine.weights["layers.1.moe.w13"].shape[0] == engine.model_config.num_experts // world
        tokens, logits = _run(engine, RANK_PROMPTS[rank], MAX_TOKENS[rank], dist.group.WORLD)
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
    port = _free_port()
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
        reference = _run(LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32)), prompts, MAX_TOKENS[rank])
        got = results[rank]
        assert got[0] == reference[0], f"rank {rank}: tokens differ"
        assert len(got[1]) == len(reference[1])
        for a, b in zip(got[1], reference[1], strict=True):
            assert (torch.from_numpy(a) - b).abs().max().item() <= 1e-4

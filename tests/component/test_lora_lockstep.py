"""LoRA swaps under EP: two ranks (processes, gloo) with one LoRA slot and three adapters in host
memory each; every rank asks for different adapters, the lockstep loop swaps them in on both ranks
at once (`engine.lora_lockstep`), and every request's tokens equal an EP=1 engine holding every
adapter resident (itself equal to the merged models: tests/component/test_lora_engine.py). With
usage probabilities declared, the loop also preloads the most probable adapter on both ranks alike,
before the requests and again once they are done. Slots of attention modules only are each rank's
own: there the ranks swap alone."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticmoe.adapters.lora import LoraAdapter
from elasticmoe.config import EngineConfig, ModelConfig
from elasticmoe.engine.engine_request import AdapterRef, EngineRequest
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams
from elasticmoe.tools.make_lora_adapter import make_lora_adapter
from elasticmoe.utils.ports import free_port

pytestmark = pytest.mark.slow

NAMES = ("law", "med", "code")
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Each rank asks for other adapters, interleaved, so the one slot must change under live requests.
RANK_REQUESTS = {0: [("a0", [5, 6, 7, 8], "med"), ("a1", [9, 10, 11], "law"), ("a2", [12, 13], "code")],
                 1: [("b0", [20, 21, 22], "code"), ("b1", [23, 24, 25, 26], "med"), ("b2", [27, 28], None)]}


def _engine(model_dir: str, rank: int = 0, world: int = 1, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=torch.float32, num_kv_blocks=128, num_threads=1,
                                  ep_rank=rank, ep_size=world, max_lora_rank=8, **kwargs))


def _load_all(engine: LLMEngine, paths: dict[str, str], model_dir: str, usage: dict[str, float] | None = None) -> None:
    cfg = ModelConfig.from_pretrained(model_dir)
    for name in NAMES:  # the same order on every rank, as the coordinator loads them
        a = LoraAdapter.open(name, paths[name], cfg)
        engine.adapters.load_lora(name, a.modules, a.weights, a.config.scaling,
                                  usage_probability=(usage or {}).get(name))


def _wait_until(condition, timeout_s: float = 20.0) -> bool:
    """Poll `condition` (read from the loop thread's state: plain ints and dicts) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _worker(rank: int, port: int, model_dir: str, paths: dict[str, str], queue, finished, usage=None,
            targets=None) -> None:
    from imm.lockstep_loop import LockstepAsyncLLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        engine = _engine(model_dir, rank, 2, max_loras=1, max_cpu_loras=len(NAMES), lora_target_modules=targets)
        _load_all(engine, paths, model_dir, usage)
        lora = engine.adapters.lora
        llm = LockstepAsyncLLM(engine, dist.group.WORLD)
        llm.start()
        if usage:  # the most probable adapter replaces the first one loaded before any request
            assert _wait_until(lambda: lora.num_preloads == 1 and lora.slot_of == {"code": 0}), lora.slot_of

        async def one(rid: str, prompt: list[int], adapter: str | None) -> list[int]:
            tokens: list[int] = []
            async for out in llm.generate(EngineRequest(rid, prompt, PARAMS, AdapterRef(adapter))):
                tokens += out.new_token_ids
            return tokens

        async def main() -> dict[str, list[int]]:
            outs = await asyncio.gather(*(one(*r) for r in RANK_REQUESTS[rank]))
            return {r[0]: o for r, o in zip(RANK_REQUESTS[rank], outs, strict=True)}

        tokens = asyncio.run(main())
        if usage:  # and comes back once the requests that displaced it are done
            assert _wait_until(lambda: lora.slot_of == {"code": 0}), lora.slot_of
        finished.wait(timeout=120)  # a stop stops every rank's loop: the other may still be serving
        llm.shutdown()  # NOTE: the loop has stopped: the state read below no longer moves
        slots = dict(lora.slot_of)
        stats = engine.adapters.stats()
        lockstep = engine.adapters.lockstep_lora is not None
        queue.put((rank, (tokens, slots, stats["swaps_in"], stats["preloads"], lockstep)))
    except BaseException as e:  # report instead of leaving the parent waiting
        queue.put((rank, f"rank {rank} failed: {e!r}"))
        raise
    finally:
        dist.destroy_process_group()


def _run_ranks(model_dir: str, paths: dict[str, str], usage=None, targets=None) -> dict[int, tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    finished = ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=(r, port, model_dir, paths, queue, finished, usage, targets))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failures = [r for r in results.values() if isinstance(r, str)]
    assert not failures, failures
    return results


def _resident_tokens(model_dir: str, paths: dict[str, str]) -> dict[str, list[int]]:
    """Every request's tokens on an EP=1 engine holding every adapter resident."""
    reference = _engine(model_dir, max_loras=len(NAMES))
    _load_all(reference, paths, model_dir)
    for rid, prompt, adapter in [r for rs in RANK_REQUESTS.values() for r in rs]:
        reference.add_request(rid, prompt, PARAMS, adapter)
    want: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        want.update({o.request_id: o.output_token_ids for o in reference.step() if o.finished})
    return want


@pytest.mark.parametrize("usage", [None, {"code": 0.5, "law": 0.1, "med": 0.2}], ids=["on-demand", "preloading"])
def test_ranks_swap_the_same_adapters_into_the_same_slots(tiny_model_dir, tmp_path, usage):
    paths = {name: make_lora_adapter(tiny_model_dir, str(tmp_path / name), rank=4, seed=i,
                                     target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
             for i, name in enumerate(NAMES)}
    results = _run_ranks(tiny_model_dir, paths, usage)
    (tokens0, slots0, swaps0, preloads0, lockstep0), (tokens1, slots1, swaps1, preloads1, _) = results[0], results[1]
    assert {**tokens0, **tokens1} == _resident_tokens(tiny_model_dir, paths)  # as if it never left its slot
    assert lockstep0 and slots0 == slots1 and swaps0 == swaps1 >= 3  # the same swaps on both ranks
    assert preloads0 == preloads1 and (preloads0 == 0) == (usage is None)


def test_attention_only_slots_swap_on_each_rank_alone(tiny_model_dir, tmp_path):
    """Slots of q_proj and v_proj serve only their own rank's tokens: each rank swaps its own
    adapters (no lockstep plan, no gather per round), so the ranks end up holding different ones,
    and every request's tokens still equal the all-resident engine's."""
    paths = {name: make_lora_adapter(tiny_model_dir, str(tmp_path / name), rank=4, seed=i,
                                     target_modules=("q_proj", "v_proj"))
             for i, name in enumerate(NAMES)}
    results = _run_ranks(tiny_model_dir, paths, targets=("q_proj", "v_proj"))
    (tokens0, slots0, swaps0, _, lockstep0), (tokens1, slots1, swaps1, _, lockstep1) = results[0], results[1]
    assert {**tokens0, **tokens1} == _resident_tokens(tiny_model_dir, paths)
    assert not lockstep0 and not lockstep1
    # rank 0 went med -> law -> code, rank 1 code -> med: each its own swaps, its own last adapter
    assert slots0 == {"code": 0} and slots1 == {"med": 0}, (slots0, slots1)
    assert swaps0 >= 3 and swaps1 >= 2

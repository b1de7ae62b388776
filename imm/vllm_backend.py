"""`VllmBackend`: vLLM as the engine of an instance rank (`--backend vllm`, the optional `vllm` extra).

A vLLM rank is a data-parallel replica: it holds every expert (the HMM's replicated layout, ep = 1)
and joins no group, because vLLM's CPU communicator cannot run expert parallelism across ranks.
vLLM runs inside the rank's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: its engine core and its
single worker are this process), stepped by the same lockstep loop as the native engine (alone).

- standby (`prepare`): vLLM imported (10-20 s of a cold start), its config resolved and, given a
  `seed` (the handle set of a committed replica on this node, `imm.instance.seeds_from_hmm`), its
  engine constructed on those HMM tensors through our loader (`imm.vllm_loader`): model built,
  weights bound or repacked, KV cache allocated;
- `attach`: the weights vLLM reads as given are moved onto this rank's own device tensors (same
  bytes: a replica), which takes milliseconds; without a seed the engine is constructed here;
- handover: snapshots carry tokens and text state, not KV (`imm.vllm_core`): the next replica
  recomputes them.

vLLM sizes its own KV cache (`kv_cache_bytes` of the engine options, in this process; the HMM holds
none for a vLLM instance) and runs eagerly (`enforce_eager`: compiling on CPU would add minutes
to every engine start, which is what the standby pool exists to hide).
"""

from __future__ import annotations

import os

# NOTE: before vLLM is imported: its engine core and worker run in this process, where the
# rank's HMM mappings are (the loader takes tensors staged here, not pickled handles).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn
from vllm.engine.arg_utils import EngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.llm_engine import LLMEngine

from elasticmoe.config import EngineOptions, ModelConfig
from elasticmoe.models.registry import model_family
from elasticmoe.parallel.expert_placement import ExpertPlacement
from elasticmoe.tokenizer import Tokenizer
from hmm.providers import Handle
from imm.engine_backend import BackendName, EngineCounters
from imm.loop_backend import LoopBackend
from imm.vllm_core import VllmEngineCore
from imm.vllm_loader import KEY, LOAD_FORMAT, StagedWeights, WeightReport, measure, rebind, stage, unstage


def checkpoint_rows(model_dir: str) -> dict[str, int]:
    """Checkpoint tensor name -> its dim-0 size, from the safetensors headers (no tensor is read)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        p.name for p in root.glob("*.safetensors")]
    rows: dict[str, int] = {}
    for name in files:
        with safe_open(str(root / name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                rows[key] = int(f.get_slice(key).get_shape()[0])
    return rows


def _worker_model(worker: Any) -> nn.Module:
    return worker.get_model()


class VllmBackend(LoopBackend):
    """vLLM's `LLMEngine` on HMM weights, stepped alone (see the module docstring)."""

    name: BackendName = "vllm"
    uses_ep_group = False

    def __init__(self) -> None:
        super().__init__()
        self.key = uuid.uuid4().hex  # under which this rank's weights are staged for the loader
        self.vllm_config: Any = None
        self.model_config: ModelConfig | None = None
        self.tokenizer: Tokenizer | None = None
        self.engine: Any = None  # vLLM's LLMEngine
        self.staged: StagedWeights | None = None  # the HMM tensors the engine reads
        self.build_report: WeightReport | None = None  # how the engine was built (standby or attach)
        self._specs: dict[str, Any] = {}
        self._rows: dict[str, int] = {}

    async def prepare(
        self, model_dir: str, options: EngineOptions, rank: int, dp: int, seed: Mapping[str, Handle] | None
    ) -> None:
        # NOTE: no torch.set_num_threads here: OpenMP's thread count is per thread, and vLLM's CPU
        # attention checks that its metadata (built on the loop thread) and its kernels agree; the
        # rank's process gets OMP_NUM_THREADS at its start instead (`imm.vllm_support.rank_env`).
        self.model_config = cfg = await asyncio.to_thread(ModelConfig.from_pretrained, model_dir)
        self.tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
        specs = model_family(cfg.arch).param_specs(cfg, tuple(range(cfg.num_experts)))
        self._specs = {s.name: s for s in specs}
        self._rows = await asyncio.to_thread(checkpoint_rows, model_dir)
        self.vllm_config = await asyncio.to_thread(self._engine_config, model_dir, options)
        if seed is not None:
            self.build_report = await asyncio.to_thread(self._build, seed)

    def _engine_config(self, model_dir: str, options: EngineOptions) -> Any:
        args = EngineArgs(
            model=model_dir, dtype=str(options.dtype).removeprefix("torch."), seed=0,
            max_model_len=options.max_model_len, max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens, kv_cache_memory_bytes=options.kv_cache_bytes,
            enable_prefix_caching=options.enable_prefix_caching,
            enforce_eager=True, skip_tokenizer_init=True, disable_log_stats=True,
            load_format=LOAD_FORMAT, model_loader_extra_config={KEY: self.key},
        )
        return args.create_engine_config(UsageContext.ENGINE_CONTEXT)

    def _build(self, handles: Mapping[str, Handle]) -> WeightReport:
        """Construct vLLM's engine on `handles` (blocking; once per process: vLLM registers its layers
        globally)."""
        if self.engine is not None:
            raise RuntimeError("the vLLM engine is already built")
        staged = StagedWeights(handles, self._specs, self._rows)
        stage(self.key, staged)
        try:
            self.engine = LLMEngine.from_vllm_config(self.vllm_config, disable_log_stats=True)
        finally:
            unstage(self.key)
        self.staged = staged
        assert staged.report is not None
        return staged.report

    def model(self) -> nn.Module:
        """vLLM's model module (its single worker is this process)."""
        return self.engine.collective_rpc(_worker_model)[0]

    async def attach(
        self, handle_set: Mapping[str, Handle], placement: ExpertPlacement, group: Any, fence_kv: bool
    ) -> WeightReport:
        """This rank's device tensors become the engine's weights (see the module docstring)."""
        if self.vllm_config is None or self.model_config is None or self.tokenizer is None:
            raise RuntimeError("attach before build_skeleton")
        if self.core is not None:
            raise RuntimeError("already attached")
        t0 = time.perf_counter()
        if self.engine is None:
            report = await asyncio.to_thread(self._build, handle_set)
        else:
            assert self.staged is not None
            model = await asyncio.to_thread(self.model)
            self.staged = await asyncio.to_thread(rebind, model, self.staged, handle_set)
            report = measure(model, self.staged, rss_anon_delta=0)
        cfg = self.model_config
        eos = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(cfg.eos_token_ids)))
        max_len = int(self.vllm_config.model_config.max_model_len)
        self.core = VllmEngineCore(self.engine, self.tokenizer, eos, cfg.vocab_size, max_len)
        return dataclasses.replace(report, attach_s=time.perf_counter() - t0)

    def counters(self) -> EngineCounters:
        core, loop = self.core, super().counters()
        if not isinstance(core, VllmEngineCore):
            return loop
        blocks, free = core.kv_blocks()
        return dataclasses.replace(loop, num_kv_blocks=blocks, num_free_kv_blocks=free)

    async def shutdown(self) -> None:
        """Stop the loop and drop the engine (its mappings of the HMM's tensors go with it)."""
        await super().shutdown()
        engine, self.engine, self.staged = self.engine, None, None
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            await asyncio.to_thread(shutdown)

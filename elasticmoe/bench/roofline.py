"""This machine's roofline, measured in the benchmark's own run, and each step's place under it.

`measure_machine()` times a large read (memory bandwidth) and large bf16 and fp32 GEMMs (peaks),
best of a few tries. `StepWork.of(...)` is the least a step must do: the FLOPs of its tokens
(projections, the routed experts and the attention over their context) and the bytes it must
read (every weight it touches once, the KV context of its decodes). A step's roofline time is
max(FLOPs / peak, bytes / bandwidth); a phase's fraction of the roofline is the sum of its steps'
roofline times over their measured wall time (1.0 = at the roofline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from elasticmoe.layers.linear import linear
from elasticmoe.models.common import CausalLM
from elasticmoe.utils.cpu_features import detect_cpu_features


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass(frozen=True, slots=True)
class MachinePeaks:
    read_gb_s: float  # streaming read bandwidth, GB/s
    gemm_gflop_s: dict[str, float]  # "bfloat16" / "float32" -> GFLOP/s
    isa: str  # what our kernels run on (CpuFeatures.kernel_isa) and the bf16 GEMM path
    num_threads: int

    def gemm_peak(self, dtype: torch.dtype) -> float:
        return self.gemm_gflop_s[str(dtype).removeprefix("torch.")]

    def best(self, other: MachinePeaks) -> MachinePeaks:
        """Each figure's best of two measurements (a shared machine only ever slows them down)."""
        gemm = {k: max(v, other.gemm_gflop_s.get(k, 0.0)) for k, v in self.gemm_gflop_s.items()}
        return MachinePeaks(max(self.read_gb_s, other.read_gb_s), gemm, self.isa, self.num_threads)


def measure_machine(repeats: int = 5, gemm_size: int = 2048, read_mib: int = 512) -> MachinePeaks:
    """Bandwidth and GEMM peaks of this machine now (with torch's threads); a few seconds."""
    buf = torch.ones(read_mib << 18, dtype=torch.float32)  # filled, so every page is real memory
    read_s = _best_of(lambda: buf.sum(), repeats)
    peaks = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(gemm_size, gemm_size).to(dtype)
        b = torch.randn(gemm_size, gemm_size).to(dtype)
        # The engine's projections (`layers.linear`): in fp32 oneDNN's GEMM, not PyTorch's own (MKL's,
        # which on AMD hosts runs AVX2 code at half of it: Zen 5, 194-204 against 470-480 GFLOP/s).
        seconds = _best_of(partial(linear, a, b), repeats)
        peaks[str(dtype).removeprefix("torch.")] = 2 * gemm_size**3 / seconds / 1e9
    features = detect_cpu_features()
    return MachinePeaks(buf.nbytes / read_s / 1e9, peaks, f"{features.kernel_isa} (bf16 GEMM: {features.bf16_gemm})",
                        torch.get_num_threads())


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """Per-token and per-step costs of a model, from its weights."""

    dense_flops_per_token: float  # 2 x (attention projections + router + dense/shared MLP) over layers
    expert_flops: float  # 2 x one expert's params (w13 + w2)
    top_k: int
    expert_layers: list[tuple[int, int]]  # per MoE layer: (dense expert slots, bytes of one expert)
    dense_bytes: int  # weights every step reads whole (all but experts and embeddings)
    lm_head_flops_per_row: float
    attn_flops_per_pair: float  # 4 x heads x head_dim (QK and PV) per (query, key) pair per layer
    kv_bytes_per_token: int  # the KV pool's bytes per token, all layers
    num_layers: int

    @classmethod
    def of(cls, model: CausalLM, kv_pool: torch.Tensor) -> ModelCosts:
        cfg = model.cfg
        experts = {id(t) for block in model.moe_blocks() for t in (block.w13, block.w2)}
        expert_layers = [(block.num_base_slots or block.w13.shape[0],
                          (block.w13[0].numel() + block.w2[0].numel()) * block.w13.element_size())
                         for block in model.moe_blocks()]
        expert_params = [block.w13[0].numel() + block.w2[0].numel() for block in model.moe_blocks()]
        dense = [t for name, t in model.weights.items() if id(t) not in experts and name not in ("embed", "lm_head")]
        dense_params = sum(t.numel() for t in dense if t.dim() >= 2)
        head_dim = cfg.head_dim if not cfg.is_mla else cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return cls(
            dense_flops_per_token=2.0 * dense_params,
            expert_flops=2.0 * (expert_params[0] if expert_params else 0),
            top_k=cfg.top_k,
            expert_layers=expert_layers,
            dense_bytes=sum(t.numel() * t.element_size() for t in dense) + model.lm_head.nbytes,
            lm_head_flops_per_row=2.0 * model.lm_head.numel(),
            attn_flops_per_pair=4.0 * cfg.num_heads * head_dim,
            kv_bytes_per_token=kv_pool[:, 0, 0].numel() * kv_pool.element_size(),
            num_layers=cfg.num_layers,
        )


@dataclass(frozen=True, slots=True)
class StepWork:
    flops: float
    bytes: float
    is_prefill: bool

    @classmethod
    def of(cls, costs: ModelCosts, spans: list[tuple[int, int]], num_sampled: int) -> StepWork:
        """`spans`: (tokens already computed, tokens this step) per scheduled request."""
        num_tokens = sum(n for _, n in spans)
        pairs = sum(n * start + n * (n + 1) / 2 for start, n in spans)  # (query, key) pairs, causal
        flops = num_tokens * (costs.dense_flops_per_token + len(costs.expert_layers) * costs.top_k * costs.expert_flops)
        flops += pairs * costs.attn_flops_per_pair * costs.num_layers + num_sampled * costs.lm_head_flops_per_row
        # Experts one layer touches: all, or the expected number of distinct ones its pairs hit.
        nbytes = float(costs.dense_bytes)
        for num_slots, expert_bytes in costs.expert_layers:
            hit = num_slots * (1 - (1 - costs.top_k / num_slots) ** num_tokens)
            nbytes += hit * expert_bytes
        # KV context the decodes read, and every token's new KV written.
        nbytes += sum(start for start, n in spans if n == 1) * costs.kv_bytes_per_token
        nbytes += num_tokens * costs.kv_bytes_per_token
        return cls(flops, nbytes, is_prefill=any(n > 1 for _, n in spans))

    def roofline_s(self, peaks: MachinePeaks, dtype: torch.dtype) -> float:
        return max(self.flops / (peaks.gemm_peak(dtype) * 1e9), self.bytes / (peaks.read_gb_s * 1e9))


def phase_fractions(steps: list[tuple[StepWork, float]], peaks: MachinePeaks, dtype: torch.dtype) -> dict:
    """Per phase (prefill = steps with any prompt token; decode = the rest) and overall: measured
    seconds, roofline seconds and their ratio, plus the phase's achieved GFLOP/s and GB/s."""
    out = {}
    for phase, chosen in (("prefill", [s for s in steps if s[0].is_prefill]),
                          ("decode", [s for s in steps if not s[0].is_prefill]), ("all", steps)):
        measured = sum(t for _, t in chosen)
        ideal = sum(w.roofline_s(peaks, dtype) for w, _ in chosen)
        out[phase] = {
            "num_steps": len(chosen),
            "measured_s": measured,
            "roofline_s": ideal,
            "fraction_of_roofline": ideal / measured if measured else None,
            "gflop_s": sum(w.flops for w, _ in chosen) / measured / 1e9 if measured else None,
            "gb_s": sum(w.bytes for w, _ in chosen) / measured / 1e9 if measured else None,
        }
    return out

"""The offloading benchmark end to end on a tiny trace, and the trace recorder on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from offload_factories import make_trace, mixed_routes

from elasticmoe.bench import offload_sim
from elasticmoe.bench.offload_trace import PromptSpec, record_trace
from elasticmoe.offload.trace import RoutingTrace


def test_the_benchmark_reports_every_policy_at_every_budget(tmp_path, capsys):
    trace_path, plot_path = tmp_path / "trace.npz", tmp_path / "hit_rate.png"
    make_trace(mixed_routes(num_requests=6), speculate=True).save(trace_path)
    result = offload_sim.main(["--trace", str(trace_path), "--budgets", "0.34,1", "--prefetch-distance", "1",
                               "--json", "--plot", str(plot_path)])
    assert json.loads(capsys.readouterr().out) == result
    rows = result["results"]
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        (p, c) for c in (4, 12) for p in ("finemoe", "lru", "lfu", "on_demand")]
    for row in rows:
        assert 0.0 <= row["hit_rate"] <= 1.0
        assert row["bytes_moved"] == (row["misses"] + row["prefetch_loads"]) * 1000
    assert result["trace"]["num_requests"] == 6 and plot_path.stat().st_size > 0


def test_the_domain_shift_reports_aged_and_never_aged_counts(tmp_path, capsys):
    trace_path = tmp_path / "trace.npz"
    make_trace(mixed_routes(num_requests=4)).save(trace_path)
    result = offload_sim.main(["--trace", str(trace_path), "--budgets", "0.34", "--prefetch-distance", "1",
                               "--policies", "lfu,lru", "--domain-shift", "2"])
    assert result["config"]["domain_shift"] == 2
    assert [(r["policy"], r["capacity"], r["past_passes"]) for r in result["domain_shift"]] == [("lfu", 4, 2),
                                                                                                ("lru", 4, 2)]
    for row in result["domain_shift"]:
        assert 0.0 <= row["hit_rate_aged"] <= 1.0 and 0.0 <= row["hit_rate_never_aged"] <= 1.0
    assert "after a domain shift" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        offload_sim.main(["--trace", str(trace_path), "--domain-shift", "-1"])


def test_a_budget_below_one_layer_of_experts_is_refused():
    assert offload_sim.budget_capacity(0.5, 8, 32) == 128
    with pytest.raises(ValueError, match="one layer's 32 experts"):
        offload_sim.budget_capacity(0.1, 8, 32)


def test_unknown_policy_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        offload_sim.main(["--trace", "unused.npz", "--policies", "lru,belady"])
    assert "belady" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    from elasticmoe.tools.make_model import make_model

    return str(make_model("qwen3_moe", "tiny", seed=0, out=str(tmp_path_factory.mktemp("models") / "qwen3")))


def test_recorded_traces_hold_the_routers_decisions(tiny_qwen3_moe, tmp_path):
    spec = PromptSpec(num_requests=3, prompt_tokens=6, new_tokens=2, num_topics=2)
    trace = record_trace(tiny_qwen3_moe, spec, batch_size=2)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (2, 8, 2)
    assert trace.iteration_num_tokens.tolist() == [6, 1, 1] * 3
    assert trace.expert_bytes == 3 * 64 * 32 * 4  # hidden x moe_intermediate, float32 weights
    assert torch.allclose(trace.gate_probs.sum(-1), torch.ones(trace.gate_probs.shape[:2]), atol=1e-5)
    assert torch.equal(trace.topk_ids, torch.topk(trace.gate_probs, 2, dim=-1).indices)
    assert trace.next_gate_probs is not None
    assert torch.allclose(trace.next_gate_probs[:, 0].sum(-1), torch.ones(len(trace.gate_probs)), atol=1e-5)
    assert not trace.next_gate_probs[:, -1].any()  # no layer after the last
    prefills = [trace.iterations_of(r)[0] for r in range(3)]
    assert torch.equal(trace.prompt_embedding, trace.iteration_embedding[prefills])
    trace.save(tmp_path / "t.npz")
    loaded = RoutingTrace.load(tmp_path / "t.npz")
    assert torch.equal(loaded.gate_probs, trace.gate_probs) and loaded.meta == trace.meta

"""train_model (offline corpus, split, short training run) and routing_entropy (hand-computed cases)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from elasticmoe.bench.routing_entropy import entropy, mean_entropy, routing_entropy
from elasticmoe.tools.train_model import load_corpus, split_corpus


def _one_hot_iteration(expert: int, num_experts: int = 4, layers: int = 1) -> torch.Tensor:
    """One token routed entirely to `expert` in every layer: [1, layers, E]."""
    probs = torch.zeros(1, layers, num_experts)
    probs[..., expert] = 1.0
    return probs


# ---------------------------------------------------------------------------- entropy


def test_uniform_routing_has_entropy_log_e():
    iterations = [torch.full((3, 2, 8), 1 / 8) for _ in range(4)]
    result = routing_entropy(iterations)
    assert result.fine == pytest.approx([math.log(8)] * 2)
    assert result.coarse == pytest.approx([math.log(8)] * 2)


def test_one_expert_always_has_entropy_zero():
    result = routing_entropy([_one_hot_iteration(2) for _ in range(5)])
    assert result.fine == pytest.approx([0.0], abs=1e-6)
    assert result.coarse == pytest.approx([0.0], abs=1e-6)


def test_peaked_iterations_flat_request_is_fine_low_coarse_high():
    # Each iteration picks one expert (fine entropy 0) but all four take turns, so the
    # request-level aggregate is uniform (coarse entropy log 4): FineMoE's Fig. 3 point.
    result = routing_entropy([_one_hot_iteration(e) for e in range(4)])
    assert result.fine_mean == pytest.approx(0.0, abs=1e-6)
    assert result.coarse_mean == pytest.approx(math.log(4))
    # Fig. 3(c): aggregating over 1, 2, 3, 4 iterations -> log 1, log 2, log 3, log 4.
    assert [row[0] for row in result.cumulative] == pytest.approx([math.log(t) for t in (1, 2, 3, 4)], abs=1e-6)


def test_iteration_distribution_averages_tokens():
    # Two tokens at [0.5, 0.5, 0, 0] and [0, 0, 0.5, 0.5] -> uniform over 4 in one iteration.
    probs = torch.tensor([[[0.5, 0.5, 0.0, 0.0]], [[0.0, 0.0, 0.5, 0.5]]])
    assert routing_entropy([probs]).fine == pytest.approx([math.log(4)])


def test_topk_counts_shares_not_probabilities():
    # One token, k=2: the two largest get 1/2 each whatever their probabilities -> log 2.
    probs = torch.tensor([[[0.7, 0.2, 0.06, 0.04]]])
    assert routing_entropy([probs], top_k=2).fine == pytest.approx([math.log(2)])
    expected = -sum(p * math.log(p) for p in (0.7, 0.2, 0.06, 0.04))
    assert routing_entropy([probs]).fine == pytest.approx([expected])


def test_mean_entropy_over_requests_of_different_lengths():
    a = routing_entropy([_one_hot_iteration(0)])  # fine 0, coarse 0
    b = routing_entropy([_one_hot_iteration(0), _one_hot_iteration(1)])  # fine 0, coarse log 2
    mean = mean_entropy([a, b])
    assert mean.coarse == pytest.approx([math.log(2) / 2])
    assert len(mean.cumulative) == 2
    assert mean.cumulative[1] == pytest.approx([math.log(2)])  # only b reaches t=2


def test_entropy_rejects_empty_input():
    with pytest.raises(ValueError):
        routing_entropy([])
    assert float(entropy(torch.tensor([1.0, 0.0]))) == pytest.approx(0.0)


# ---------------------------------------------------------------------------- corpus


def test_corpus_split_is_deterministic_and_disjoint():
    docs = load_corpus()
    assert docs == load_corpus()
    train, heldout = split_corpus(docs)
    train_names, heldout_names = {d.name for d in train}, {d.name for d in heldout}
    assert not train_names & heldout_names
    assert len(train) + len(heldout) == len(docs)
    assert 0.03 < len(heldout) / len(docs) < 0.25
    assert sum(len(d.text) for d in docs) < 8 * 1024 * 1024  # loads fast


# ---------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory) -> Path:
    from elasticmoe.tools.train_model import main

    out = tmp_path_factory.mktemp("trained") / "tiny"
    # 40 steps of the tiny preset take about a second; the time budget never binds.
    assert main(["--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out), "--steps", "40",
                 "--minutes", "10", "--seed", "0", "--prompts", "20"]) == 0
    return out


def test_training_lowers_loss_and_writes_summary(trained_tiny):
    summary = json.loads((trained_tiny / "training.json").read_text())
    assert summary["steps"] == 40
    assert summary["heldout_loss"] < summary["initial_heldout_loss"] - 0.3
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["corpus_bytes"] > 100_000
    lines = (trained_tiny / "heldout_prompts.jsonl").read_text().splitlines()
    assert len(lines) == 20 and all(json.loads(line)["prompt"] for line in lines)


def test_checkpoint_has_make_model_layout(trained_tiny, tmp_path):
    from elasticmoe.tools.make_model import make_model

    tiny_model_dir = make_model("qwen3_moe", "tiny", seed=0, out=str(tmp_path / "random"))
    made = {p.name for p in Path(tiny_model_dir).iterdir()}
    trained = {p.name for p in trained_tiny.iterdir()}
    assert made <= trained
    assert trained - made == {"heldout_prompts.jsonl", "training.json"}
    made_cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    trained_cfg = json.loads((trained_tiny / "config.json").read_text())
    assert set(made_cfg) == set(trained_cfg)
    assert trained_cfg["dtype"] == made_cfg["dtype"]


def test_checkpoint_loads_in_transformers_and_engine(trained_tiny):
    from transformers import AutoModelForCausalLM

    from elasticmoe.llm import LLM
    from elasticmoe.sampling_params import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(trained_tiny)
    assert model.config.model_type == "qwen3_moe"
    prompt = json.loads((trained_tiny / "heldout_prompts.jsonl").read_text().splitlines()[0])["prompt"]
    llm = LLM(str(trained_tiny), dtype="float32")
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4


def test_routing_entropy_cli_on_trained_checkpoint(trained_tiny, capsys):
    from elasticmoe.bench.routing_entropy import main

    assert main(["--model", str(trained_tiny), "--prompts", "3", "--new-tokens", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 3
    for mode in ("probs", "topk"):
        assert 0.0 <= report[mode]["fine_mean"] <= report[mode]["coarse_mean"] + 1e-6 <= report["max_entropy"] + 1e-5
        assert len(report[mode]["cumulative_mean"]) == 3

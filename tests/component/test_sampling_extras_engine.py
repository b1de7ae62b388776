"""vLLM's `allowed_token_ids`, `min_p` and `include_stop_str_in_output` in the engine: greedy
generation over allowed tokens equals transformers' `generate` with the same mask; seeded min-p
answers differ from plain ones and stay within the allowed set; a stop string kept in the text
ends it exactly where the plain run's text is cut, streamed or not."""

from __future__ import annotations

import pytest
import torch

from elasticmoe.config import EngineConfig
from elasticmoe.engine.llm_engine import LLMEngine
from elasticmoe.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 230, 11]
ALLOWED = [7, 40, 41, 300, 301, 302, 400]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=tiny_model_dir, dtype=torch.float32))


def _run(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], str, list[str]]:
    engine.add_request("r", PROMPT, params)
    ids, deltas, text = [], [], ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
            deltas.append(out.new_text)
            if out.finished:
                text = out.text
    return ids, text, deltas


def test_greedy_over_allowed_tokens_equals_transformers_with_the_same_mask(engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    def only_allowed(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(scores, dtype=torch.bool)
        mask[:, ALLOWED] = False
        return scores.masked_fill(mask, float("-inf"))

    ours, _, _ = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                             allowed_token_ids=ALLOWED))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          logits_processor=LogitsProcessorList([only_allowed]))
    assert ours == ref[0, len(PROMPT) :].tolist() and set(ours) <= set(ALLOWED)


def test_min_p_changes_seeded_answers_and_keeps_within_allowed_tokens(engine):
    plain, _, _ = _run(engine, SamplingParams(temperature=1.5, seed=3, max_tokens=24, ignore_eos=True))
    strict, _, _ = _run(engine, SamplingParams(temperature=1.5, seed=3, max_tokens=24, ignore_eos=True, min_p=1.0))
    greedy, _, _ = _run(engine, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert plain != strict
    assert strict == greedy  # min_p 1 leaves the most likely token only
    both, _, _ = _run(engine, SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, min_p=0.2,
                                             allowed_token_ids=ALLOWED))
    assert set(both) <= set(ALLOWED)


def test_a_kept_stop_string_ends_the_text(engine):
    _, whole, _ = _run(engine, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    stop = whole[6:9]
    cut = whole.index(stop)
    _, dropped, dropped_deltas = _run(engine, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                             stop=[stop]))
    _, kept, kept_deltas = _run(engine, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True))
    assert dropped == whole[:cut] and kept == whole[: cut + len(stop)]
    assert "".join(dropped_deltas) == dropped and "".join(kept_deltas) == kept  # streams carry the same


def test_bad_words_equal_transformers_bad_words_ids(engine, tiny_model_dir):
    """A one-token word is never generated; a two-token word's second token is banned right after
    its first (transformers' `bad_words_ids`, the same rule)."""
    from transformers import AutoModelForCausalLM

    plain, _, _ = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    bad = [[plain[3]], [plain[5], plain[6]]]  # both would be generated without the ban
    ours, _, _ = _run(engine, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, bad_words_token_ids=bad))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          bad_words_ids=bad)
    assert ours == ref[0, len(PROMPT) :].tolist() and ours != plain
    assert plain[3] not in ours
    assert not any(a == plain[5] and b == plain[6] for a, b in zip(ours, ours[1:], strict=False))


def test_bad_words_over_http_are_tokenized_and_banned(tiny_model_dir):
    from in_process_server import post, serving

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with serving(tiny_model_dir, "tiny") as app:
        plain = post(app, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
        words = [t.strip() for t in plain["logprobs"]["tokens"] if t.strip().isalpha() and len(t.strip()) > 1]
        assert words, plain["logprobs"]["tokens"]  # a whole word the model generates as one token
        banned = post(app, "/v1/completions", {**body, "bad_words": [words[0]]})
        assert banned.status_code == 200, banned.text
        assert banned.json()["choices"][0]["text"] != plain["text"]
        too_many = post(app, "/v1/completions", {**body, "bad_words": ["w"] * 65})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "bad_words"


@pytest.mark.parametrize("prompt", ["the expert model", PROMPT])
def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(tiny_model_dir, prompt):

    from in_process_server import post, serving, sse_events

    from elasticmoe.tokenizer import Tokenizer

    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    echoed = prompt if isinstance(prompt, str) else Tokenizer(tiny_model_dir).decode(prompt)
    with serving(tiny_model_dir, "tiny") as app:
        plain = post(app, "/v1/completions", body).json()["choices"]
        echo = post(app, "/v1/completions", {**body, "echo": True}).json()
        assert [c["text"] for c in echo["choices"]] == [echoed + c["text"] for c in plain]
        assert echo["usage"]["completion_tokens"] == 12  # the prompt is not counted twice
        events = sse_events(post(app, "/v1/completions", {**body, "echo": True, "stream": True}))
        for index in range(2):
            texts = [c["text"] for e in events for c in e["choices"] if c["index"] == index]
            assert texts[0] == echoed and "".join(texts) == echoed + plain[index]["text"]

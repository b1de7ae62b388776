"""`VllmEngineCore` against a hand-made stand-in for vLLM's `LLMEngine` (no model, no engine start):
the request bookkeeping around vLLM, which decides what a client sees at a handover or a resume.

The stand-in emits one token per step, a function of the request's whole sequence so far (as a
greedy model would), so a request recomputed elsewhere from its tokens continues identically."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="the vLLM backend's tests run in .venv-vllm (make test-vllm)")

from elasticmoe.engine.engine_request import AdapterRef, EngineRequest  # noqa: E402
from elasticmoe.errors import InvalidRequestError, UnknownAdapterError  # noqa: E402
from elasticmoe.outputs import RequestOutput  # noqa: E402
from elasticmoe.sampling_params import SamplingParams  # noqa: E402
from elasticmoe.structured_outputs import StructuredOutputs  # noqa: E402
from elasticmoe.tokenizer import Tokenizer  # noqa: E402
from imm.vllm_core import VllmEngineCore  # noqa: E402

VOCAB, EOS, MAX_LEN = 512, 2, 256


@dataclass
class _Completion:
    token_ids: list[int]
    logprobs: None = None


@dataclass
class _Output:
    request_id: str
    outputs: list[_Completion]
    finished: bool
    num_cached_tokens: int | None = None  # prompt tokens vLLM's prefix cache held


@dataclass
class FakeVllm:
    """vLLM's `add_request` / `step` / `abort_request` with a deterministic 'model'."""

    live: dict[str, tuple[list[int], int, list[int]]] = field(default_factory=dict)  # id -> tokens, budget, stops
    aborted: list[str] = field(default_factory=list)
    prompts: dict[str, dict] = field(default_factory=dict)  # id -> the prompt as given
    cached: dict[str, int] = field(default_factory=dict)  # id -> prompt tokens to report cached

    def add_request(self, request_id: str, prompt: dict, params) -> None:
        self.prompts[request_id] = prompt
        self.live[request_id] = (list(prompt["prompt_token_ids"]), params.max_tokens, list(params.stop_token_ids))

    def step(self) -> list[_Output]:
        outs = []
        for request_id, (tokens, budget, stops) in list(self.live.items()):
            token = 3 + (sum(tokens) * 31 + len(tokens)) % (VOCAB - 3)
            tokens.append(token)
            budget -= 1
            finished = budget == 0 or token in stops
            self.live[request_id] = (tokens, budget, stops)
            if finished:
                del self.live[request_id]
            outs.append(_Output(request_id, [_Completion([token])], finished, self.cached.get(request_id)))
        return outs

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.live.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    from elasticmoe.tools.make_model import make_model

    return Tokenizer(make_model("qwen3_moe", "tiny-vllm", seed=0, out=str(tmp_path_factory.mktemp("m") / "m")))


def make_core(tokenizer: Tokenizer) -> VllmEngineCore:
    return VllmEngineCore(FakeVllm(), tokenizer, (EOS,), VOCAB, MAX_LEN)


def run(core: VllmEngineCore, steps: int | None = None) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while core.has_unfinished_requests() and (steps is None or steps > 0):
        outs += core.step()
        steps = None if steps is None else steps - 1
    return outs


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_a_handed_over_request_continues_where_its_stream_stopped(tokenizer):
    whole = make_core(tokenizer)
    whole.add(EngineRequest("r", [5, 6, 7], PARAMS))
    reference = run(whole)
    old, new = make_core(tokenizer), make_core(tokenizer)
    old.add(EngineRequest("r", [5, 6, 7], PARAMS))
    before = run(old, steps=9)
    (snap,) = old.export_requests(hand_over_kv=True)
    assert old.requests == {} and old.engine.aborted == ["r"]  # vLLM's blocks freed on the old replica
    assert snap.block_ids == () and len(snap.token_ids) == 3 + 9
    new.import_requests([snap], kv_is_shared=True)  # recomputed whatever the flag: a replica cannot share KV
    assert new.engine.live["r"][0] == list(snap.token_ids) and new.engine.live["r"][1] == 24 - 9
    after = run(new)
    spliced = before + after
    assert [t for o in spliced for t in o.new_token_ids] == reference[-1].output_token_ids
    assert "".join(o.new_text for o in spliced) == "".join(o.new_text for o in reference)
    assert after[-1].finished and after[-1].finish_reason == "length" and len(after[-1].output_token_ids) == 24


def test_a_resumed_request_emits_only_what_follows(tokenizer):
    whole = make_core(tokenizer)
    whole.add(EngineRequest("r", [9, 8], PARAMS))
    reference = run(whole)
    ids = reference[-1].output_token_ids
    text_so_far = "".join(o.new_text for o in reference[:10])
    core = make_core(tokenizer)
    core.add(EngineRequest("r", [9, 8], PARAMS).resumed(ids[:10], len(text_so_far)))
    rest = run(core)
    assert [t for o in rest for t in o.new_token_ids] == ids[10:]
    assert text_so_far + "".join(o.new_text for o in rest) == "".join(o.new_text for o in reference)


def test_stop_strings_are_ours_and_stop_vllm(tokenizer):
    probe = make_core(tokenizer)
    probe.add(EngineRequest("p", [5, 6, 7], PARAMS))
    text = "".join(o.new_text for o in run(probe))
    stop = text[6:9]
    core = make_core(tokenizer)
    core.add(EngineRequest("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])))
    outs = run(core)
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert "".join(o.new_text for o in outs) == text[: text.index(stop)]
    assert core.engine.aborted == ["r"] and not core.engine.live  # vLLM would have gone on


def test_logit_bias_and_repetition_penalty_reach_vllm(tokenizer):
    """Both mean the same after a handover: the bias has no state, and the repetition penalty covers
    the prompt and the output, which vLLM then holds as its prompt."""
    from imm.vllm_core import vllm_params

    core = make_core(tokenizer)
    core.add(EngineRequest("r", [5], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={7: -100.0},
                                                    repetition_penalty=1.3)))
    params = vllm_params(core.requests["r"], (EOS,))
    assert (params.logit_bias, params.repetition_penalty, params.presence_penalty) == ({7: -100.0}, 1.3, 0.0)


def test_min_p_and_allowed_tokens_reach_vllm(tokenizer):
    """Neither has state across a handover."""
    from imm.vllm_core import vllm_params

    core = make_core(tokenizer)
    core.add(EngineRequest("r", [5], SamplingParams(temperature=0.8, max_tokens=8, min_p=0.3,
                                                    allowed_token_ids=[5, 6, 7])))
    params = vllm_params(core.requests["r"], (EOS,))
    assert (params.min_p, sorted(params.allowed_token_ids)) == (0.3, [5, 6, 7])


def test_min_tokens_left_reach_vllm_after_a_resume(tokenizer):
    """vLLM counts from where it got the request: a resumed request asks it for what is left."""
    from imm.vllm_core import vllm_params

    core = make_core(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8)
    core.add(EngineRequest("r", [5], params))
    assert vllm_params(core.requests["r"], (EOS,)).min_tokens == 8
    core.add(EngineRequest("s", [5], params).resumed([9, 10, 11], 3))
    assert vllm_params(core.requests["s"], (EOS,)).min_tokens == 5
    core.add(EngineRequest("t", [5], params).resumed(list(range(3, 13)), 10))
    assert vllm_params(core.requests["t"], (EOS,)).min_tokens == 0


def test_eos_and_stop_token_ids_reach_vllm(tokenizer):
    core = make_core(tokenizer)
    core.add(EngineRequest("r", [5], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[7])))
    assert core.engine.live["r"][2] == [7, EOS]
    core.add(EngineRequest("s", [5], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    assert core.engine.live["s"][2] == []


@pytest.mark.parametrize(
    "request_,param",
    [
        (EngineRequest("a", [], PARAMS), "prompt"),
        (EngineRequest("b", "text", PARAMS), "prompt"),
        (EngineRequest("c", [VOCAB], PARAMS), "prompt"),
        (EngineRequest("d", list(range(3, 3 + MAX_LEN)), PARAMS), "prompt"),
        (EngineRequest("e", [5] * 240, PARAMS), "max_tokens"),
        (EngineRequest("f", [5], PARAMS, adapter=AdapterRef("esft-a")), "model"),
        (EngineRequest("g", [5], SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0})), "logit_bias"),
        # vLLM would count the output only from where it got the request: a handover would change it
        (EngineRequest("h", [5], SamplingParams(max_tokens=4, presence_penalty=0.5)), "presence_penalty"),
        (EngineRequest("i", [5], SamplingParams(max_tokens=4, frequency_penalty=-0.5)), "frequency_penalty"),
        (EngineRequest("k", [5], SamplingParams(max_tokens=4, bad_words_token_ids=[[7]])), "bad_words"),
        # refused by the field it came in
        (EngineRequest("j", [5], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
            "json_object", field="response_format"))), "response_format"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(tokenizer, request_, param):
    core = make_core(tokenizer)
    with pytest.raises(InvalidRequestError) as caught:
        core.add(request_)
    assert caught.value.param == param
    if param == "model":
        assert isinstance(caught.value, UnknownAdapterError)
    assert core.requests == {} and not core.engine.live


def test_abort_and_fail_all_free_vllms_requests(tokenizer):
    core = make_core(tokenizer)
    core.add(EngineRequest("a", [5], PARAMS))
    core.add(EngineRequest("b", [6], PARAMS))
    run(core, steps=2)
    core.abort("a")
    failed = core.fail_all(RuntimeError("boom"))
    assert [o.request_id for o in failed] == ["b"] and failed[0].finish_reason == "error"
    assert core.engine.aborted == ["a", "b"] and not core.has_unfinished_requests()


def test_a_cache_salt_reaches_vllm_and_its_cached_tokens_come_back(tokenizer):
    fake = FakeVllm(cached={"salted": 32})
    core = VllmEngineCore(fake, tokenizer, (EOS,), VOCAB, MAX_LEN)
    core.add(EngineRequest("salted", list(range(5, 45)), SamplingParams(max_tokens=3, ignore_eos=True,
                                                                          cache_salt="tenant-a")))
    core.add(EngineRequest("plain", list(range(5, 45)), SamplingParams(max_tokens=3, ignore_eos=True)))
    assert fake.prompts["salted"]["cache_salt"] == "tenant-a" and "cache_salt" not in fake.prompts["plain"]
    finished = {o.request_id: o for o in run(core) if o.finished}
    assert (finished["salted"].num_cached_tokens, finished["plain"].num_cached_tokens) == (32, 0)

"""The bad-input table: requests a user or an attacker may send, each with the exact answer due.

Shared by the single-process server (tests/component/test_bad_inputs.py, real engine in-process)
and the elastic server (tests/e2e/test_elastic_server_api.py). Each case is
`(id, method, path, body, status, param)`: `body` is a dict sent as JSON, or `bytes` sent as-is
with `Content-Type: application/json`; `param` is the field the error must name (None: no field).
Every answer is in OpenAI's error format, and the engine must serve normally afterwards.
The model is the tiny Qwen3-MoE of `make-model` (vocabulary 512, context 2048).
"""

from __future__ import annotations

from typing import Any

MODEL = "tiny-qwen3-moe"
VOCAB = 512
CONTEXT = 2048
BIG = 2**70
USER = [{"role": "user", "content": "hi"}]

Case = tuple[str, str, str, Any, int, str | None]


def _c(id_: str, body: Any, status: int = 400, param: str | None = None) -> Case:
    """A completion request with the given extra fields (a valid prompt unless it says otherwise)."""
    if isinstance(body, dict):
        body = {"model": MODEL, "prompt": "the expert", "max_tokens": 4, **body}
    return (id_, "POST", "/v1/completions", body, status, param)


def _chat(id_: str, body: dict, status: int = 400, param: str | None = None) -> Case:
    return (id_, "POST", "/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 4, **body},
            status, param)


def _raw(text: str) -> bytes:
    """A body with JSON escapes Python's json.dumps would not write (lone surrogates, NaN)."""
    return text.encode("utf-8")


CASES: list[Case] = [
    # ---- numeric fields out of range or of the wrong type
    _c("top_k-huge", {"top_k": 1180591620717411303424}, param="top_k"),
    _c("top_k-huge-sampled", {"top_k": 2**40, "temperature": 0.7}, param="top_k"),
    _c("top_k-int32+1", {"top_k": 2**31}, param="top_k"),
    _c("top_k-minus-2", {"top_k": -2}, param="top_k"),
    _c("top_k-string", {"top_k": "x"}, param="top_k"),
    _c("top_k-float", {"top_k": 1.5}, param="top_k"),
    _c("seed-2^64", {"seed": 2**64}, param="seed"),
    _c("seed-below-int64", {"seed": -(2**63) - 1}, param="seed"),
    _c("seed-2^70", {"seed": BIG}, param="seed"),
    _c("seed-string", {"seed": "abc"}, param="seed"),
    _c("seed-float", {"seed": 1.5}, param="seed"),
    _c("max_tokens-0", {"max_tokens": 0}, param="max_tokens"),
    _c("max_tokens-negative", {"max_tokens": -1}, param="max_tokens"),
    _c("max_tokens-int32+1", {"max_tokens": 2**31}, param="max_tokens"),
    _c("max_tokens-2^70", {"max_tokens": BIG}, param="max_tokens"),
    _c("max_tokens-string", {"max_tokens": "ten"}, param="max_tokens"),
    _c("max_tokens-past-context", {"max_tokens": 10**6}, param="max_tokens"),
    _c("logprobs-21", {"logprobs": 21}, param="logprobs"),
    _c("logprobs-negative", {"logprobs": -1}, param="logprobs"),
    _c("logprobs-2^70", {"logprobs": BIG}, param="logprobs"),
    _c("temperature-negative", {"temperature": -0.1}, param="temperature"),
    _c("temperature-too-high", {"temperature": 2.01}, param="temperature"),
    _c("temperature-string", {"temperature": "hot"}, param="temperature"),
    _c("temperature-NaN", _raw(f'{{"model": "{MODEL}", "prompt": "x", "temperature": NaN}}'), param="temperature"),
    _c("temperature-Infinity", _raw(f'{{"model": "{MODEL}", "prompt": "x", "temperature": Infinity}}'),
       param="temperature"),
    _c("top_p-0", {"top_p": 0}, param="top_p"),
    _c("top_p-too-high", {"top_p": 1.5}, param="top_p"),
    _c("top_p-negative", {"top_p": -1}, param="top_p"),
    _c("top_p-NaN", _raw(f'{{"model": "{MODEL}", "prompt": "x", "top_p": NaN}}'), param="top_p"),
    _c("n-17", {"n": 17}, param="n"),
    _c("n-0", {"n": 0}, param="n"),
    _c("n-2^70", {"n": BIG}, param="n"),
    _c("echo-with-logprobs", {"echo": True, "logprobs": 1}, param="echo"),
    _c("echo-string", {"echo": "yes"}, param="echo"),
    # ---- penalties and logit bias
    _c("presence_penalty-2.5", {"presence_penalty": 2.5}, param="presence_penalty"),
    _c("frequency_penalty-NaN", _raw(f'{{"model": "{MODEL}", "prompt": "x", "frequency_penalty": NaN}}'),
       param="frequency_penalty"),
    _c("logit_bias-101", {"logit_bias": {"5": 101}}, param="logit_bias"),
    _c("logit_bias-past-vocab", {"logit_bias": {str(VOCAB): 1}}, param="logit_bias"),
    _c("logit_bias-key-not-a-token-id", {"logit_bias": {"abc": 1}}, param="logit_bias"),
    _c("logit_bias-key-negative", {"logit_bias": {"-5": 1}}, param="logit_bias"),
    _c("logit_bias-2000-tokens", {"logit_bias": {str(i): 1 for i in range(2000)}}, param="logit_bias"),
    # ---- parameters this server does not implement: refused by name, never silently ignored
    _c("repetition_penalty-0", {"repetition_penalty": 0}, param="repetition_penalty"),
    _c("min_p-1.5", {"min_p": 1.5}, param="min_p"),
    _c("min_p-string", {"min_p": "low"}, param="min_p"),
    _c("allowed_token_ids-empty", {"allowed_token_ids": []}, param="allowed_token_ids"),
    _c("allowed_token_ids-past-vocab", {"allowed_token_ids": [5, VOCAB]}, param="allowed_token_ids"),
    _c("allowed_token_ids-negative", {"allowed_token_ids": [-3]}, param="allowed_token_ids"),
    _c("include_stop_str_in_output-string", {"include_stop_str_in_output": "yes"}, param="include_stop_str_in_output"),
    _c("bad_words-65", {"bad_words": ["x"] * 65}, param="bad_words"),
    _c("bad_words-empty-word", {"bad_words": [""]}, param="bad_words"),
    _c("bad_words-word-too-long", {"bad_words": ["x" * 300]}, param="bad_words"),
    _c("prompt_logprobs", {"prompt_logprobs": 1}, param="prompt_logprobs"),
    _c("min_tokens-above-max_tokens", {"max_tokens": 4, "min_tokens": 5}, param="min_tokens"),
    _c("min_tokens-negative", {"min_tokens": -1}, param="min_tokens"),
    _c("best_of-3", {"best_of": 3}, param="best_of"),
    _c("prompt-two-token-lists", {"prompt": [[5, 6], [7]]}, param="prompt"),
    _c("guided_whitespace_pattern", {"guided_whitespace_pattern": " *"}, param="guided_whitespace_pattern"),
    # ---- structured outputs
    _c("guided_regex-unclosed", {"guided_regex": "[a-"}, param="guided_regex"),
    _c("guided_regex-too-long", {"guided_regex": "a" * 70_000}, param="guided_regex"),
    _c("guided_grammar-undefined-rule", {"guided_grammar": "start: nowhere"}, param="guided_grammar"),
    _c("guided_json-not-json", {"guided_json": "{oops"}, param="guided_json"),
    _c("guided_choice-empty", {"guided_choice": []}, param="guided_choice"),
    _c("guided_choice-300", {"guided_choice": [f"c{i}" for i in range(300)]}, param="guided_choice"),
    _c("guided-two-at-once", {"guided_regex": "a", "guided_json": {"type": "object"}}, param="guided_regex"),
    _c("structured_outputs-unknown-key", {"structured_outputs": {"xml": "<a/>"}}, param="structured_outputs.xml"),
    _c("structured_outputs-two-keys", {"structured_outputs": {"regex": "a", "choice": ["b"]}},
       param="structured_outputs"),
    _c("structured_outputs-not-an-object", {"structured_outputs": "json"}, param="structured_outputs"),
    # ---- stop conditions
    _c("stop-five", {"stop": ["a", "b", "c", "d", "e"]}, param="stop"),
    _c("stop-empty", {"stop": ""}, param="stop"),
    _c("stop-one-empty", {"stop": ["ok", ""]}, param="stop"),
    _c("stop-too-long", {"stop": "x" * 2000}, param="stop"),
    _c("cache-salt-too-long", {"cache_salt": "s" * 129}, param="cache_salt"),
    _c("stop-number", {"stop": 123}, param="stop"),
    _c("stop-lone-surrogate", _raw(f'{{"model": "{MODEL}", "prompt": "x", "stop": ["\\ud800"]}}'), param="stop"),
    _c("stop_token_ids-negative", {"stop_token_ids": [-1]}, param="stop_token_ids"),
    _c("stop_token_ids-2^40", {"stop_token_ids": [2**40]}, param="stop_token_ids"),
    _c("stop_token_ids-past-vocab", {"stop_token_ids": [VOCAB + 88]}, param="stop_token_ids"),
    _c("stop_token_ids-string", {"stop_token_ids": "x"}, param="stop_token_ids"),
    _c("stop_token_ids-too-many", {"stop_token_ids": list(range(300))}, param="stop_token_ids"),
    # ---- the prompt
    ("prompt-missing", "POST", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    _c("prompt-empty-list", {"prompt": []}, param="prompt"),
    _c("prompt-two-strings", {"prompt": ["a", "b"]}, param="prompt"),
    _c("prompt-negative-id", {"prompt": [-1]}, param="prompt"),
    _c("prompt-id-2^40", {"prompt": [2**40]}, param="prompt"),
    _c("prompt-id-2^70", {"prompt": [BIG]}, param="prompt"),
    _c("prompt-id-past-vocab", {"prompt": [VOCAB + 88]}, param="prompt"),
    _c("prompt-empty-string", {"prompt": ""}, param="prompt"),
    _c("prompt-lone-surrogate", _raw(f'{{"model": "{MODEL}", "prompt": "ab\\ud800cd"}}'), param="prompt"),
    _c("prompt-surrogate-in-list", _raw(f'{{"model": "{MODEL}", "prompt": ["\\udfff"]}}'), param="prompt"),
    _c("prompt-number", {"prompt": 123}, param="prompt"),
    _c("prompt-object", {"prompt": {"a": 1}}, param="prompt"),
    _c("prompt-nested-list", {"prompt": [[1, [2]]]}, param="prompt"),
    _c("prompt-past-context", {"prompt": [5] * (CONTEXT + 10)}, param="prompt"),
    _c("prompt-text-past-context", {"prompt": "word " * 4000}, param="prompt"),
    _c("prompt-3.9MB", {"prompt": "expert " * 557_000}, param="prompt"),  # refused before tokenizing
    # ---- model, flags, extensions
    ("model-missing", "POST", "/v1/completions", {"prompt": "x"}, 400, "model"),
    _c("model-unknown", {"model": "gpt-nope"}, status=404, param="model"),
    _c("model-too-long", {"model": "m" * 300}, param="model"),
    _c("model-number", {"model": 123}, param="model"),
    _c("model-lone-surrogate", _raw('{"model": "\\ud83d", "prompt": "x"}'), param="model"),
    _c("stream-string", {"stream": "yes"}, param="stream"),
    _c("stream_options-without-stream", {"stream_options": {"include_usage": True}}, param="stream_options"),
    _c("stream_options-bad", {"stream": True, "stream_options": {"include_usage": "x"}}, param="stream_options"),
    _c("ignore_eos-string", {"ignore_eos": "x"}, param="ignore_eos"),
    _c("user-too-long", {"user": "u" * 300}, param="user"),
    _c("user-lone-surrogate", _raw(f'{{"model": "{MODEL}", "prompt": "x", "user": "\\udc00"}}'), param="user"),
    _c("lora_routing-string", {"lora_routing": "x"}, param="lora_routing"),
    _c("lora_routing-bad-breaks", {"lora_routing": {"type": "vocab", "breaks": "x", "adapters": ["a"]}},
       param="lora_routing"),
    _c("lora_routing-breaks-past-vocab", {"lora_routing": {"breaks": [BIG], "adapters": ["a", None]}},
       param="lora_routing"),
    _c("lora_routing-unknown-router", {"lora_routing": {"type": "learned", "router": "nope"}},
       param="lora_routing"),
    # ---- bodies that are not a request
    _c("body-not-json", b"this is not json"),
    _c("body-json-list", b"[]"),
    _c("body-json-null", b"null"),
    _c("body-json-string", b'"x"'),
    _c("body-empty", b""),
    _c("body-invalid-utf8", b'{"model": "\xff\xfe", "prompt": "x"}'),
    _c("body-deeply-nested", b"[" * 100_000 + b"]" * 100_000),
    _c("body-nested-in-field", b'{"model": "x", "prompt": "x", "lora_routing": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    _c("body-truncated", b'{"model": "x", "prompt": "x"'),
    # ---- chat
    _chat("chat-messages-empty", {"messages": []}, param="messages"),
    ("chat-messages-missing", "POST", "/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    _chat("chat-messages-string", {"messages": "hi"}, param="messages"),
    _chat("chat-role-unknown", {"messages": [{"role": "wizard", "content": "x"}]}, param="messages"),
    _chat("chat-image-part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
          param="messages"),
    _chat("chat-part-without-text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
          param="messages"),
    ("chat-content-lone-surrogate", "POST", "/v1/chat/completions",
     _raw(f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a\\ud800"}}]}}'), 400, "messages"),
    _chat("chat-name-too-long", {"messages": [{"role": "user", "content": "x", "name": "n" * 300}]},
          param="messages"),
    _chat("chat-too-many-messages", {"messages": USER * 5000}, param="messages"),
    _chat("chat-too-many-parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]},
          param="messages"),
    _chat("chat-past-context", {"messages": [{"role": "user", "content": "word " * 4000}]}, param="messages"),
    _chat("chat-3.9MB", {"messages": [{"role": "user", "content": "expert " * 557_000}]}, param="messages"),
    _chat("chat-top_logprobs-without-logprobs", {"top_logprobs": 2}, param="top_logprobs"),
    _chat("chat-top_logprobs-21", {"logprobs": True, "top_logprobs": 21}, param="top_logprobs"),
    _chat("chat-logprobs-string", {"logprobs": "x"}, param="logprobs"),
    _chat("chat-max_completion_tokens-0", {"max_completion_tokens": 0}, param="max_completion_tokens"),
    _chat("chat-max_completion_tokens-2^40", {"max_completion_tokens": 2**40}, param="max_completion_tokens"),
    _chat("chat-max_tokens-0", {"max_tokens": 0}, param="max_tokens"),
    _chat("chat-n-17", {"n": 17}, param="n"),
    _chat("chat-response_format-unknown-type", {"response_format": {"type": "json"}}, param="response_format"),
    _chat("chat-response_format-bad-schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, param="response_format"),
    _chat("chat-response_format-schema-missing", {"response_format": {"type": "json_schema"}}, param="response_format"),
    _chat("chat-tools-auto", {"tools": [{"type": "function", "function": {"name": "f"}}]}, param="tool_choice"),
    _chat("chat-tools-bad-name", {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
          param="tools"),
    _chat("chat-tool_choice-unknown-function", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                                "tool_choice": {"type": "function", "function": {"name": "g"}}},
          param="tool_choice"),
    _chat("chat-tool_choice-required-no-tools", {"tool_choice": "required"}, param="tool_choice"),
    _chat("chat-cache-salt-empty", {"cache_salt": ""}, param="cache_salt"),
    _chat("chat-cache-salt-slash", {"cache_salt": "tenant/a"}, param="cache_salt"),
    _chat("chat-template-kwargs-server-argument", {"chat_template_kwargs": {"add_generation_prompt": False}},
          param="chat_template_kwargs"),
    _chat("chat-template-kwargs-not-an-object", {"chat_template_kwargs": ["enable_thinking"]},
          param="chat_template_kwargs"),
    _chat("chat-template-kwargs-oversized", {"chat_template_kwargs": {"note": "x" * 300_000}},
          param="chat_template_kwargs"),
    _chat("chat-frequency_penalty--3", {"frequency_penalty": -3}, param="frequency_penalty"),
    _chat("chat-logit_bias-past-vocab", {"logit_bias": {"100000": -100}}, param="logit_bias"),
    _chat("chat-seed-2^64", {"seed": 2**64}, param="seed"),
    _chat("chat-top_k-2^70", {"top_k": BIG}, param="top_k"),
    _chat("chat-model-unknown", {"model": "gpt-nope"}, status=404, param="model"),
    # ---- routes and methods
    ("route-unknown", "GET", "/nope", None, 404, None),
    ("route-v1-unknown", "POST", "/v1/embeddings", {"model": MODEL, "input": "x"}, 404, None),
    ("method-get-completions", "GET", "/v1/completions", None, 405, None),
    ("method-put-models", "PUT", "/v1/models", None, 405, None),
    ("method-delete-chat", "DELETE", "/v1/chat/completions", None, 405, None),
    # ---- the admin API
    ("adapter-path-component-300", "POST", "/admin/adapters", {"name": "a", "path": "/tmp/" + "x" * 300}, 400, "path"),
    ("adapter-path-nul", "POST", "/admin/adapters", {"name": "a", "path": "/tmp/a\x00b"}, 400, "path"),
    ("adapter-path-too-long", "POST", "/admin/adapters", {"name": "a", "path": "/a" * 3000}, 400, "path"),
    ("adapter-path-missing-dir", "POST", "/admin/adapters", {"name": "a", "path": "/nonexistent/adapter"}, 400, "path"),
    ("adapter-path-lone-surrogate", "POST", "/admin/adapters",
     _raw('{"name": "a", "path": "/tmp/\\ud800"}'), 400, "path"),
    ("adapter-name-traversal", "POST", "/admin/adapters", {"name": "../x", "path": "/tmp"}, 400, "name"),
    ("adapter-name-missing", "POST", "/admin/adapters", {"path": "/tmp"}, 400, "name"),
    ("adapter-type-unknown", "POST", "/admin/adapters", {"name": "a", "path": "/tmp", "type": "weird"}, 400, "type"),
    ("adapter-usage-above-1", "POST", "/admin/adapters", {"name": "a", "path": "/tmp", "usage_probability": 1.5},
     400, "usage_probability"),
    ("adapter-usage-negative", "POST", "/admin/adapters", {"name": "a", "path": "/tmp", "usage_probability": -0.1},
     400, "usage_probability"),
    ("adapter-usage-string", "POST", "/admin/adapters", {"name": "a", "path": "/tmp", "usage_probability": "hi"},
     400, "usage_probability"),
    ("adapter-unload-unknown", "DELETE", "/admin/adapters/nope", None, 404, "name"),
    ("adapter-unknown-field", "POST", "/admin/adapters", {"name": "a", "path": "/tmp", "usage_probabilty": 0.5},
     400, "usage_probabilty"),
]

# Only the elastic server has these routes.
ELASTIC_CASES: list[Case] = [
    ("scale-dp-0", "POST", "/admin/scale", {"dp": 0}, 400, "dp"),
    ("scale-dp-string", "POST", "/admin/scale", {"dp": "2"}, 400, "dp"),
    ("scale-dp-bool", "POST", "/admin/scale", {"dp": True}, 400, "dp"),
    ("scale-dp-2^70", "POST", "/admin/scale", {"dp": BIG}, 400, "dp"),
    ("scale-dp-too-many-devices", "POST", "/admin/scale", {"dp": 99}, 400, "dp"),
    ("scale-strategy-unknown", "POST", "/admin/scale", {"dp": 1, "strategy": "nope"}, 400, "strategy"),
    ("scale-event-unknown", "GET", "/admin/scale/nope", None, 404, "event_id"),
    ("autoscaler-enabled-string", "POST", "/admin/autoscaler", {"enabled": "yes"}, 400, "enabled"),
    # settings only a restart changes must not look applied
    ("autoscaler-min_dp", "POST", "/admin/autoscaler", {"enabled": True, "min_dp": 2}, 400, "min_dp"),
    ("scale-field-misspelt", "POST", "/admin/scale", {"dp": 1, "stratgy": "cold_restart"}, 400, "stratgy"),
]


def check_error(case: Case, status: int, body: Any) -> None:
    """Assert that an answer is the one `case` is due, in OpenAI's error format."""
    id_, _, _, _, want_status, want_param = case
    assert status == want_status, f"{id_}: status {status}, want {want_status}: {body}"
    assert isinstance(body, dict) and set(body) == {"error"}, f"{id_}: not an OpenAI error body: {body}"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == want_status, f"{id_}: {error}"
    assert error["param"] == want_param, f"{id_}: param {error['param']!r}, want {want_param!r}: {error}"
    assert "Traceback" not in error["message"] and 'File "' not in error["message"], f"{id_}: {error}"
    assert "not a directory" not in error["message"], f"{id_}: hints at which paths exist: {error}"

"""The offline API and the make-model command, as a user calls them."""

from __future__ import annotations

import pytest

from elasticmoe import LLM, SamplingParams
from elasticmoe.cli import main


def test_llm_generate_and_chat(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = llm.generate("the model", params)
    batch = llm.generate(["the model", [5, 6, 7]], params)
    assert len(single) == 1 and len(batch) == 2
    assert single[0].output_token_ids == batch[0].output_token_ids  # same prompt, same greedy output
    assert single[0].text and single[0].finish_reason == "length"
    reply = llm.chat([{"role": "user", "content": "hello"}], params)
    chat_prompt = llm.engine.tokenizer.decode(reply.prompt_token_ids, skip_special_tokens=False)
    assert chat_prompt.startswith("<|im_start|>user\nhello<|im_end|>") and chat_prompt.endswith("assistant\n")
    assert len(reply.output_token_ids) == 8


def test_make_model_cli(tmp_path, capsys):
    assert main(["make-model", "--arch", "mixtral", "--preset", "tiny", "--seed", "3", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "model.safetensors").is_file()
    with pytest.raises(SystemExit) as info:
        main(["make-model", "--arch", "gpt2", "--out", str(tmp_path)])
    assert info.value.code == 2  # argparse names the bad choice
    assert "invalid choice" in capsys.readouterr().err

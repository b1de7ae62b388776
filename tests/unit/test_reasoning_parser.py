"""Thinking apart from the answer (`entrypoints/openai/reasoning.py`): whole answers, and the same
answers streamed in pieces cut at every position."""

from __future__ import annotations

import pytest

from elasticmoe.entrypoints.openai.reasoning import ReasoningStream, split, thinks

CASES = [
    # (answer, thinking, reasoning, content)
    ("<think>\nThe user greets.\n</think>\n\nHello!", True, "The user greets.", "Hello!"),
    ("The template opened the block.\n</think>\n\nHi", True, "The template opened the block.", "Hi"),
    ("<think>\n\n</think>\n\nJust the answer", True, "", "Just the answer"),
    ("<think>\nStill thinking when cut", True, "Still thinking when cut", None),
    ("<think>a < b and c </thin k></think>x </think> y", True, "a < b and c </thin k>", "x </think> y"),
    ("<thinker> is not the tag</think>ok", True, "<thinker> is not the tag", "ok"),
    ("Hello!\n\nLine two", False, None, "Hello!\n\nLine two"),
    ("<think>\nplan\n\n</think>\n\n<tool_call>{}</tool_call>", True, "plan", "<tool_call>{}</tool_call>"),
]


@pytest.mark.parametrize("answer, thinking, reasoning, content", CASES)
def test_a_whole_answer_splits_into_reasoning_and_content(answer, thinking, reasoning, content):
    assert split(answer, thinking) == (reasoning, content)


@pytest.mark.parametrize("answer, thinking, reasoning, content", CASES)
def test_a_streamed_answer_cut_anywhere_gives_the_same_parts(answer, thinking, reasoning, content):
    for cuts in [(i,) for i in range(len(answer) + 1)] + [tuple(range(len(answer) + 1))]:
        stream = ReasoningStream(thinking)
        got_reasoning, got_content, start = "", "", 0
        for end in (*cuts, len(answer)):
            r, c = stream.feed(answer[start:end], finished=end == len(answer))
            got_reasoning, got_content, start = got_reasoning + r, got_content + c, end
        assert got_reasoning == (reasoning or ""), cuts
        assert got_content == (content or ""), cuts


def test_a_reasoning_part_goes_out_as_it_is_generated():
    stream = ReasoningStream(thinking=True)
    assert stream.feed("<think>\nFirst", False) == ("First", "")
    assert stream.feed(" thought\n", False) == (" thought", "")  # the newline waits: </think> may follow
    assert stream.feed("more\n</th", False) == ("\nmore", "")
    assert stream.feed("ink>\n\nAns", False) == ("", "Ans")
    assert stream.feed("wer", True) == ("", "wer")


def test_which_requests_think():
    assert not thinks(None, None)
    assert thinks("qwen3", None) and thinks("qwen3", {"enable_thinking": True})
    assert not thinks("qwen3", {"enable_thinking": False})
    assert thinks("deepseek_r1", {"enable_thinking": False})  # R1 always thinks

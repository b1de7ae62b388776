"""The tokenizer decodes on transformers' own `tokenizers` backend, cached on disk.

Decoding through the backend must equal transformers' `decode` exactly (random ids with
special tokens, both `skip_special_tokens`, one token at a time), for the three families'
tiny tokenizers; a second process loads the cached backend without importing transformers;
a tokenizer that encodes loads transformers at once (its first request must not wait for
it), and with the cache filled loads the class `AutoTokenizer` chose, without PyTorch (the elastic
server's ingress), encoding and rendering chats alike; the cache follows the tokenizer's files; a torn cache file or an unwritable cache directory
costs the speed-up, never the output; and a tokenizer whose decode does more than its
backend (space cleanup of a WordPiece model) keeps decoding through transformers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ARCHS
from transformers import AutoTokenizer

from elasticmoe.errors import InvalidRequestError
from elasticmoe.tokenizer import Tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "tokenizer-cache"
    monkeypatch.setenv("ELASTICMOE_TOKENIZER_CACHE", str(path))
    return path


def _id_runs(vocab_size: int, special: list[int], n: int = 200) -> list[list[int]]:
    rng = random.Random(0)
    pool = list(range(vocab_size)) + special * 20  # special tokens often, as in real outputs
    return [[rng.choice(pool) for _ in range(rng.randint(1, 24))] for _ in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_backend_decode_equals_transformers(tiny_model_dirs, cache, arch):
    model_dir = tiny_model_dirs[arch]
    hf = AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer(model_dir)
    assert ours._backend is not None, "the tiny fast tokenizer should decode on its backend"
    assert list(cache.glob("*.json")), "the backend was not cached"
    assert ours.vocab_size == len(hf) and hf.eos_token_id in ours.eos_token_ids
    for ids in _id_runs(len(hf), hf.all_special_ids):
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    for token_id in range(len(hf)):
        assert ours.token_text(token_id) == hf.decode([token_id])


def test_a_second_process_decodes_from_the_cache_without_transformers(tiny_model_dir, cache):
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = _id_runs(len(hf), hf.all_special_ids, n=20)
    first = Tokenizer(tiny_model_dir)  # builds the backend through transformers and caches it
    script = (
        "import json, sys\n"
        "from elasticmoe.tokenizer import Tokenizer\n"
        f"t = Tokenizer({tiny_model_dir!r}, encodes=False)\n"
        f"out = [t.decode(i) for i in {ids!r}]\n"
        "print(json.dumps({'transformers': 'transformers' in sys.modules, 'out': out,"
        " 'eos': t.eos_token_ids, 'vocab': t.vocab_size}))\n"
    )
    env = {**os.environ, "ELASTICMOE_TOKENIZER_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["transformers"] is False
    assert doc["out"] == [hf.decode(i, skip_special_tokens=True) for i in ids]
    assert (tuple(doc["eos"]), doc["vocab"]) == (first.eos_token_ids, first.vocab_size)


def test_a_tokenizer_that_encodes_loads_transformers_at_construction(tiny_model_dir, cache):
    Tokenizer(tiny_model_dir)  # the cache is filled
    ours = Tokenizer(tiny_model_dir)
    assert "hf" in ours.__dict__ and ours._backend is not None  # loaded, and decoding on the backend
    assert "hf" not in Tokenizer(tiny_model_dir, encodes=False).__dict__
    assert ours.encode("hello world") == AutoTokenizer.from_pretrained(tiny_model_dir).encode("hello world")


TEXTS = ["hello world", "  leading spaces and\ttabs\n", "émoji 🙂 and ümlauts", "<|im_end|> as text", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is an expert?"}]


def _chat_ids(tokenizer: Tokenizer) -> list[int] | None:
    try:
        return tokenizer.apply_chat_template(CHAT)
    except InvalidRequestError:  # the tiny tokenizer has no template
        return None


@pytest.mark.parametrize("arch", ARCHS)
def test_the_class_named_by_the_cache_encodes_as_autotokenizer_does(tiny_model_dirs, cache, arch):
    first = Tokenizer(tiny_model_dirs[arch])  # through AutoTokenizer; the cache names its class
    (entry,) = cache.glob("*.json")
    assert json.loads(entry.read_text())["hf_class"] == f"{type(first.hf).__module__}:{type(first.hf).__qualname__}"
    again = Tokenizer(tiny_model_dirs[arch])
    assert again._hf_class is type(first.hf)
    assert [again.encode(t) for t in TEXTS] == [first.encode(t) for t in TEXTS]
    assert _chat_ids(again) == _chat_ids(first)
    assert (again.eos_token_ids, again.vocab_size) == (first.eos_token_ids, first.vocab_size)


def test_a_process_that_encodes_from_the_cache_loads_no_torch(tiny_model_dir, cache):
    first = Tokenizer(tiny_model_dir)
    script = (
        "import json, sys\n"
        "from elasticmoe.tokenizer import Tokenizer\n"
        f"t = Tokenizer({tiny_model_dir!r})\n"
        f"print(json.dumps({{'torch': 'torch' in sys.modules, 'ids': [t.encode(x) for x in {TEXTS!r}],"
        f" 'chat': t.apply_chat_template({CHAT!r})}}))\n"
    )
    env = {**os.environ, "ELASTICMOE_TOKENIZER_CACHE": str(cache)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["torch"] is False
    assert doc["ids"] == [first.encode(t) for t in TEXTS] and doc["chat"] == first.apply_chat_template(CHAT)


@pytest.mark.parametrize("named", ["os:system", "transformers.nope:Nope", "transformers:__version__", 7])
def test_a_cache_naming_no_transformers_tokenizer_class_loads_through_autotokenizer(tiny_model_dir, cache, named):
    Tokenizer(tiny_model_dir)
    (entry,) = cache.glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "hf_class": named}))
    ours = Tokenizer(tiny_model_dir)
    assert ours._hf_class is None
    assert ours.encode("hello world") == AutoTokenizer.from_pretrained(tiny_model_dir).encode("hello world")
    assert json.loads(entry.read_text())["hf_class"] != named  # written again, naming the real class


def test_the_cache_follows_the_tokenizer_files(tiny_model_dir, cache, tmp_path):
    Tokenizer(tiny_model_dir)
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["eos_token"] = config["pad_token"]  # another eos: another tokenizer
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer(changed)
    assert len(list(cache.glob("*.json"))) == 2
    assert AutoTokenizer.from_pretrained(str(changed)).eos_token_id in ours.eos_token_ids
    # The weights are not part of the key: a checkpoint re-saved in bf16 shares the entry.
    (changed / "model.safetensors").write_bytes(b"not the same weights")
    Tokenizer(changed)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_torn_cache_file_is_rebuilt(tiny_model_dir, cache):
    Tokenizer(tiny_model_dir)
    (entry,) = cache.glob("*.json")
    entry.write_text('{"backend": "{\\"vers')  # a writer that died mid-file (no atomic replace)
    ours = Tokenizer(tiny_model_dir, encodes=False)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ours.decode([5, 6, 7]) == hf.decode([5, 6, 7], skip_special_tokens=True)
    assert json.loads(entry.read_text())["vocab_size"] == len(hf)  # rewritten whole


def test_an_unwritable_cache_costs_speed_not_output(tiny_model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ELASTICMOE_TOKENIZER_CACHE", str(blocker / "cache"))  # cannot be created
    ours = Tokenizer(tiny_model_dir)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert ours.decode([5, 6, 7, 2], skip_special_tokens=False) == hf.decode([5, 6, 7, 2])


def test_a_decode_with_space_cleanup_stays_with_transformers(tmp_path, cache):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[SEP]": 1, "hello": 2, "world": 3, ",": 4, "!": 5, "do": 6, "##n": 7, "'": 8, "t": 9}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    model_dir = tmp_path / "wordpiece"
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]",
                            clean_up_tokenization_spaces=True).save_pretrained(str(model_dir))
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    ours = Tokenizer(model_dir)
    assert ours._backend is None and not list(cache.glob("*.json"))
    ids = [2, 4, 3, 5, 6, 7, 8, 9]
    assert hf.decode(ids) != backend.decode(ids)  # the cleanup changes this text ...
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)  # ... and we keep it


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_deltas_add_up_to_the_whole_decode(tiny_model_dirs, cache, arch, skip_special_tokens):
    """Streamed one token at a time after a prompt (special tokens and ids outside the tokenizer's
    vocabulary among them), the deltas are the decode of prompt tail and output minus the tail's."""
    from elasticmoe.tokenizer import _PREFIX_WINDOW, IncrementalDetokenizer

    tok = Tokenizer(tiny_model_dirs[arch])
    special = list(tok.hf.all_special_ids)
    for run in _id_runs(tok.vocab_size + 50, special, n=60):  # + 50: ids the tokenizer does not know
        prompt, out = run[:7], run[7:]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens)
        got = "".join(detok.add(i) for i in out)
        tail = prompt[-_PREFIX_WINDOW:]
        whole = tok.decode(tail + out, skip_special_tokens)[len(tok.decode(tail, skip_special_tokens)) :]
        assert got == whole.rstrip("\ufffd") or whole.endswith("\ufffd") and whole.startswith(got)


def test_tokens_that_add_no_text_do_not_grow_the_window(tiny_model_dir, cache):
    """A run of skipped special tokens (or unknown ids) keeps each token's decodes short: the
    window stays the prompt's tail instead of one token longer per token."""
    from elasticmoe.tokenizer import IncrementalDetokenizer

    tok = Tokenizer(tiny_model_dir)
    special = tok.hf.all_special_ids[0]
    detok = IncrementalDetokenizer(tok, tok.encode("a prompt", add_special_tokens=False), True)
    assert "".join(detok.add(i) for i in [special] * 1000 + [tok.vocab_size + 7] * 1000) == ""
    assert len(detok.ids) - detok.prefix_offset <= 5  # what the next token's decodes read
    assert "".join(detok.add(i) for i in tok.encode(" hello", add_special_tokens=False)) == " hello"

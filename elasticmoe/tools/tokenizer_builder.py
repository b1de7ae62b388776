"""Build a byte-level BPE tokenizer locally (no hub): trained on a seeded,
generated English-like corpus, with ChatML special tokens and chat template."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML, as Qwen models use it. `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = """the of and to in is was that for on with as by at from his her they this which be are an
have it not or had but one all were when we there can been has more if will would who so out up into
time about than other its only new some could these two may first then do any like my now over such our
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last might us great old
year off come since against go came right used take three states himself few house use during without
again place around however home small found thought went say part once general high upon school every
does got united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end why
called didn't eyes find going look asked later knew point next city give group toward young let room
expert model token layer memory serve scale elastic request batch cache block device router weight
adapter shared mixture rank stream engine latency throughput cluster queue prefill decode sample""".split()


def _corpus(seed: int, num_sentences: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ".", "?", "!", ","]))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer with at most `vocab_size` entries (special tokens included),
    trained on the seeded generated corpus."""
    return train_bpe(_corpus(seed, 4000), vocab_size)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts`, with this module's special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str) -> None:
    """Save as an HF fast tokenizer (tokenizer.json + tokenizer_config.json with chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)
    # Keep the template and a widely known class name in tokenizer_config.json too,
    # so older transformers (e.g. the one vLLM pins) load the same tokenizer.
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

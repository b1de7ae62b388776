"""Per-request sampling parameters, validated at construction.

Every invalid value raises `ValueError` naming the offending field, so the
OpenAI layer can turn it into a 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticmoe.errors import InvalidRequestError
from elasticmoe.structured_outputs import StructuredOutputs

_GREEDY_EPS = 1e-5

MAX_INT32 = 2**31 - 1  # bound of every count and token id a request may carry
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch.Generator takes
MAX_LOGPROBS = 20
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|: OpenAI's range
MAX_LOGIT_BIAS = 100.0  # |bias| of one token: OpenAI's range (100 bans or forces a token)
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_REPETITION_PENALTY = 100.0
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary served today; the engine checks its own
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 64
MAX_CACHE_SALT_CHARS = 128  # vLLM's bound and characters, so a salt valid here is valid on its backend too
CACHE_SALT_FORBIDDEN = frozenset("@/\\\0")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class SamplingParamError(InvalidRequestError):
    """An invalid sampling value; `.param` names the field."""


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per sampled token
    skip_special_tokens: bool = True
    # OpenAI's penalties on the output so far: each token's logit loses `frequency_penalty` per time
    # it was generated, and `presence_penalty` once if it was.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's and transformers' multiplicative penalty on every token of the prompt and output so far:
    # a positive logit is divided by it, a negative one multiplied (1: off).
    repetition_penalty: float = 1.0
    # vLLM's: no EOS, stop token or stop string ends the request before this many output tokens.
    min_tokens: int = 0
    # The answer must match a JSON schema, a regex, a choice or a grammar (checked when built).
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: a sampled token needs at least `min_p` times the most likely token's probability.
    min_p: float = 0.0
    # vLLM's: only these tokens may be generated (None: any).
    allowed_token_ids: list[int] | None = None
    # vLLM's: a stop string that ends the answer stays in its text.
    include_stop_str_in_output: bool = False
    # vLLM's `bad_words` as token ids (the API tokenizes each word, with and without a leading
    # space): a sequence's last token is banned wherever the output ends with the tokens before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt (a tenant's
    # secret: others cannot learn its prompts from how fast theirs start).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32):
            raise SamplingParamError("max_tokens", f"must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}")
        # NOTE: `not a <= x <= b` is also true for NaN, so NaN is refused too.
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise SamplingParamError("top_k", f"must be -1, 0 (disabled) or an integer in [1, {MAX_INT32}], "
                                     f"got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise SamplingParamError("seed", f"must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise SamplingParamError("stop", f"each stop sequence must be a string of 1 to {MAX_STOP_CHARS} "
                                         f"characters, got {s!r:.40}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_INT32:
                raise SamplingParamError("stop_token_ids", f"each stop token id must be an integer in [0, {MAX_INT32}], "
                                         f"got {t!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingParamError(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not 0.0 < rp <= MAX_REPETITION_PENALTY:
            raise SamplingParamError("repetition_penalty", f"must be a number in (0, {MAX_REPETITION_PENALTY:g}], "
                                     f"got {rp!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT32:
            raise SamplingParamError("min_tokens", f"must be an integer in [0, {MAX_INT32}], got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                     f"got {self.min_tokens}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise SamplingParamError("structured_outputs", f"must be a StructuredOutputs, got "
                                     f"{type(self.structured_outputs).__name__}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not 1 <= len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
                raise SamplingParamError("allowed_token_ids", f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, "
                                         f"got {len(self.allowed_token_ids)}")
            if not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids):
                raise SamplingParamError("allowed_token_ids", f"must be token ids in [0, {MAX_INT32}]")
        if self.cache_salt is not None and (
                not isinstance(self.cache_salt, str) or not 1 <= len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
                or any(c in CACHE_SALT_FORBIDDEN for c in self.cache_salt)):
            raise SamplingParamError("cache_salt", f"must be 1 to {MAX_CACHE_SALT_CHARS} characters without '@', '/', "
                                     "'\\' or NUL (vLLM's rule)")
        self.bad_words_token_ids = [list(seq) for seq in self.bad_words_token_ids or []]
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise SamplingParamError("bad_words", f"at most {MAX_BAD_WORDS} words")
        for seq in self.bad_words_token_ids:
            if not 1 <= len(seq) <= MAX_BAD_WORD_TOKENS or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in seq):
                raise SamplingParamError("bad_words", f"each word must be 1 to {MAX_BAD_WORD_TOKENS} tokens")
        self.logit_bias = dict(self.logit_bias or {})
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise SamplingParamError("logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token <= MAX_INT32:
                raise SamplingParamError("logit_bias", f"keys must be token ids in [0, {MAX_INT32}], got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise SamplingParamError("logit_bias", f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                                         f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids these parameters name (stop, biased and allowed tokens) exist in a vocabulary of
        `vocab_size`; `SamplingParamError` naming the field otherwise. Every engine backend checks
        this when it takes a request (the bounds above hold for any model)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words", [t for seq in self.bad_words_token_ids for t in seq])):
            if any(t >= vocab_size for t in ids):
                raise SamplingParamError(name, f"token ids must be < vocab size {vocab_size}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def adjusts_logits(self) -> bool:
        """The sampler changes this request's logits before choosing (penalties, bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)

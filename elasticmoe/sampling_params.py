"""Per-request sampling parameters, validated at construction.

Every invalid value raises `ValueError` naming the offending field, so the
OpenAI layer can turn it into a 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticmoe.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise SamplingParamError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamError("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingParamError("seed", f"must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamError("stop", f"each stop sequence must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise SamplingParamError("stop_token_ids", f"each stop token id must be an integer >= 0, got {t!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise SamplingParamError("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

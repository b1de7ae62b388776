"""What each request of the load generator looks like: prompt/output lengths, model, prompt.

A `LengthDist` is parsed from a short spec (`parse_length`):

    N | fixed:N              always N
    uniform:LO:HI            integer uniform on [LO, HI]
    normal:MEAN:STD[:LO:HI]  rounded normal, clipped to [LO, HI] (default [1, unbounded])
    lognormal:MEDIAN:SIGMA[:LO:HI]   rounded exp(N(ln MEDIAN, SIGMA)), clipped likewise

An `AdapterMix` picks each request's `model` among the base model and adapters, with Zipf
weights (rank i gets weight 1 / (i + 1)^alpha; alpha = 0 is uniform) or explicit ones.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Literal

LengthKind = Literal["fixed", "uniform", "normal", "lognormal"]
_NUM_PARAMS = {"fixed": (1,), "uniform": (2,), "normal": (2, 4), "lognormal": (2, 4)}

# Short common words for text prompts: most are one token in BPE vocabularies.
WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by one had not but "
    "what all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called"
).split()


@dataclasses.dataclass(frozen=True, slots=True)
class LengthDist:
    """A distribution of token counts; `sample` always returns an int in `[lo, hi]` (hi None: unbounded)."""

    kind: LengthKind
    a: float  # fixed: N; uniform: LO; normal: MEAN; lognormal: MEDIAN
    b: float = 0.0  # uniform: HI; normal: STD; lognormal: SIGMA
    lo: int = 1
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _NUM_PARAMS:
            raise ValueError(f"unknown distribution {self.kind!r}; want fixed, uniform, normal or lognormal")
        if self.lo < 1 or (self.hi is not None and self.hi < self.lo):
            raise ValueError(f"need 1 <= LO <= HI, got {self.lo}, {self.hi}")
        if self.kind in ("fixed", "uniform") and not (self.a == int(self.a) and self.b == int(self.b)):
            raise ValueError(f"{self.kind}: lengths must be integers, got {self.a}, {self.b}")
        if self.kind == "fixed" and self.a < 1:
            raise ValueError(f"fixed: need N >= 1, got {self.a:g}")
        if self.kind == "uniform" and not 1 <= self.a <= self.b:
            raise ValueError(f"uniform: need 1 <= LO <= HI, got {self.a:g}, {self.b:g}")
        if self.kind == "normal" and not (self.a > 0 and self.b >= 0):
            raise ValueError(f"normal: need MEAN > 0 and STD >= 0, got {self.a:g}, {self.b:g}")
        if self.kind == "lognormal" and not (self.a > 0 and self.b >= 0):
            raise ValueError(f"lognormal: need MEDIAN > 0 and SIGMA >= 0, got {self.a:g}, {self.b:g}")

    @property
    def bounds(self) -> tuple[int, int | None]:
        """The smallest and largest value `sample` can return (None: unbounded)."""
        if self.kind == "fixed":
            return int(self.a), int(self.a)
        if self.kind == "uniform":
            return int(self.a), int(self.b)
        return self.lo, self.hi

    def spec(self) -> str:
        """The spec `parse_length` reads back as this distribution (for reports)."""
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        clip = f":{self.lo}:{'' if self.hi is None else self.hi}" if (self.lo, self.hi) != (1, None) else ""
        return f"{self.kind}:{self.a:g}:{self.b:g}{clip}"

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        x = rng.gauss(self.a, self.b) if self.kind == "normal" else rng.lognormvariate(math.log(self.a), self.b)
        n = max(self.lo, round(x))
        return n if self.hi is None else min(self.hi, n)


def parse_length(text: str) -> LengthDist:
    """`fixed:32`, `32`, `uniform:16:64`, `normal:64:16`, `normal:64:16:8:128`, `lognormal:64:0.5`, ...

    Raises `ValueError` with a readable message for anything else."""
    kind, *params = text.strip().split(":")
    if not params and kind.isdigit():
        kind, params = "fixed", [kind]
    if kind not in _NUM_PARAMS:
        raise ValueError(f"unknown distribution {kind!r} in {text!r}; want fixed, uniform, normal or lognormal")
    if len(params) not in _NUM_PARAMS[kind]:
        want = " or ".join(str(n) for n in _NUM_PARAMS[kind])
        raise ValueError(f"{kind} takes {want} parameters, got {len(params)} in {text!r}")
    try:
        values = [float(p) for p in params[:2]]
        lo = int(params[2]) if len(params) > 2 and params[2] else 1
        hi = int(params[3]) if len(params) > 3 and params[3] else None
    except ValueError:
        raise ValueError(f"not a number in {text!r}") from None
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"not a finite number in {text!r}")
    return LengthDist(kind, values[0], values[1] if len(values) > 1 else 0.0, lo, hi)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterMix:
    """Model names (base model and/or adapters) and their relative request weights."""

    names: tuple[str, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.names or any(not n for n in self.names):
            raise ValueError(f"need one or more non-empty model names, got {list(self.names)}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"model names repeat: {list(self.names)}")
        if len(self.weights) != len(self.names):
            raise ValueError(f"{len(self.names)} model names but {len(self.weights)} weights")
        if any(not (w >= 0 and math.isfinite(w)) for w in self.weights) or sum(self.weights) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all 0, got {list(self.weights)}")

    @classmethod
    def single(cls, name: str) -> AdapterMix:
        return cls((name,), (1.0,))

    @classmethod
    def zipf(cls, names: Sequence[str], alpha: float) -> AdapterMix:
        """Rank i (0-based, in `names` order) gets weight 1 / (i + 1)^alpha."""
        if not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha: need a finite value >= 0, got {alpha}")
        return cls(tuple(names), tuple(1.0 / (i + 1) ** alpha for i in range(len(names))))

    @property
    def probabilities(self) -> tuple[float, ...]:
        total = sum(self.weights)
        return tuple(w / total for w in self.weights)

    def sample(self, rng: random.Random) -> str:
        if len(self.names) == 1:
            return self.names[0]
        return rng.choices(self.names, weights=self.weights)[0]


def parse_names(text: str) -> list[str]:
    """"a, b,c" -> ["a", "b", "c"]."""
    return [n.strip() for n in text.split(",") if n.strip()]


def parse_weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(f"want comma-separated numbers, got {text!r}") from None


def make_prompt(
    rng: random.Random, length: int, kind: Literal["tokens", "text"], vocab_size: int, first_token_id: int = 5
) -> list[int] | str:
    """`length` random token ids in `[first_token_id, vocab_size)` (exact length, special ids skipped),
    or `length` random words (about `length` tokens, depending on the tokenizer)."""
    if kind == "tokens":
        return [rng.randrange(first_token_id, vocab_size) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))

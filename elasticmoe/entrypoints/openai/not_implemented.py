"""Parameters of the OpenAI API (and of vLLM's extensions to it) that change what a request returns
and that this server does not implement.

Each comes with the values that ask for nothing besides null (`best_of` 1, no functions). Any other value is refused with a 400 naming the field. Ignored, a request for a
legacy function call or a suffix would get an answer made without them, and its client could
not tell. Fields the API does not know at all are still ignored
(`protocol._Request`): an SDK that sends a newer option keeps working.
"""

from __future__ import annotations

import reprlib
from typing import Any

from elasticmoe.sampling_params import SamplingParamError

# The refused value as the error shows it: bounded in length and depth (a body may nest deeply).
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 3, 60, 60, 8, 8

# Both endpoints.
SHARED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (),
    "guided_whitespace_pattern": (),
}
# /v1/completions only.
COMPLETIONS: dict[str, tuple[Any, ...]] = {"best_of": (1,), "suffix": ("",)}
# /v1/chat/completions only.
CHAT: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
}


def refuse(data: Any, table: dict[str, tuple[Any, ...]], prefix: str = "") -> None:
    """Raise `SamplingParamError` for the first parameter of `table` that the raw request body
    `data` (or an object inside it, whose field names start with `prefix`) sets to anything but
    null or one of its neutral values."""
    if not isinstance(data, dict):
        return
    for name, neutral in table.items():
        value = data.get(name)
        if value is not None and value not in neutral:  # `in` compares by equality: 0 and 0.0 alike
            allowed = " or ".join(["null", *(repr(n) for n in neutral)])
            raise SamplingParamError(prefix + name, f"is not supported by this server: omit it or send {allowed} "
                                           f"(got {_SHORT.repr(value)})")

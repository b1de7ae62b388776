"""The engine's side of structured outputs (`elasticmoe.structured_outputs`): one llguidance
matcher per constrained request, which masks the tokens its grammar forbids before sampling and
advances with every token sampled.

The matcher is state of this engine only (`Request.matcher`): a request that comes here resumed or
handed over gets a new one, which consumes the output tokens so far, so it continues where the
grammar was. Logprobs stay the model's (as vLLM reports them); the mask only chooses.

A request ends ("stop") as soon as its grammar is complete (a JSON object closed, a choice
spelled out), as vLLM does, with no EOS token needed. Where a request's own adjustments forbid
every token the grammar allows (`min_tokens` holding back the EOS a complete JSON value can only
be followed by), the grammar wins: the row samples from the grammar's tokens unadjusted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from functools import cached_property

import llguidance
import numpy as np
import torch

from elasticmoe.engine.request import Request
from elasticmoe.errors import InvalidRequestError
from elasticmoe.structured_outputs import parser_limits
from elasticmoe.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class StructuredOutputError(RuntimeError):
    """A constrained request's matcher refused a token or failed: that request fails, the engine goes on."""


class GrammarMatchers:
    """Builds and drives the matchers of one engine's constrained requests.

    A grammar is compiled once and each request gets a copy of its fresh matcher: a copy takes
    2-6 us against 1.8 ms (a 20-property schema) to 20 ms (a 47 KB one) for a compile, on the
    engine's thread. `n` choices, clients that send the same schema or tools with every request,
    and a scale that hands over many constrained requests at once pay it once
    (`MAX_COMPILED` grammars are kept, least recently used first out)."""

    MAX_COMPILED = 32

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar -> its fresh matcher
        self.num_compiles = 0

    @cached_property
    def _lltokenizer(self) -> llguidance.LLTokenizer | InvalidRequestError:
        """The model's tokenizer as llguidance reads it, built on the first constrained request (16 ms
        for a 4k vocabulary here; it grows with the vocabulary); or, for a tokenizer it cannot read,
        the error every constrained request gets (built once either way)."""
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_str(self.tokenizer.backend_json())
            backend.no_padding()
            backend.no_truncation()
            n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self.eos_token_ids or None)
        except InvalidRequestError as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - llguidance or tokenizers refusing this tokenizer
            logger.warning("structured outputs unavailable: llguidance cannot read this model's tokenizer: %r", exc)
            return InvalidRequestError("structured_outputs", f"are not available for this model: its tokenizer "
                                       f"cannot be read for them ({str(exc)[:200]})")

    def attach(self, request: Request) -> None:
        """Give a constrained request its matcher, past its output so far (a resumed or handed-over
        request's). `InvalidRequestError` naming the field if the grammar does not compile for this
        model, or if that output does not match it; nothing is kept then."""
        constraint = request.params.structured_outputs
        if constraint is None:
            return
        lltokenizer = self._lltokenizer
        if isinstance(lltokenizer, InvalidRequestError):  # named by the field the request used
            raise InvalidRequestError(constraint.field, lltokenizer.message)
        matcher = self._fresh(lltokenizer, constraint.grammar, constraint.field)
        output = request.output_token_ids
        if output and not matcher.consume_tokens(output):
            raise InvalidRequestError("resume", "the output so far does not match the request's structured output")
        request.matcher = matcher

    def _fresh(self, lltokenizer: llguidance.LLTokenizer, grammar: str, field: str) -> llguidance.LLMatcher:
        """A matcher of `grammar` at its start: a copy of the compiled one (compiled now if new)."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            compiled = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=parser_limits())
            self.num_compiles += 1
            if compiled.is_error():  # not kept: the next request with it gets the same answer
                raise InvalidRequestError(field, f"does not compile for this model: {compiled.get_error()[:500]}")
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return compiled.deep_copy()

    def constrain(self, chosen_from: torch.Tensor, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`chosen_from` [N, V] (the logits to choose from, adjusted or not) with each constrained
        row's forbidden tokens at -inf; a copy if any row is constrained (`logits`, the model's,
        are never written: logprobs come from them)."""
        rows = [i for i, r in enumerate(requests) if r.matcher is not None]
        if not rows:
            return chosen_from
        vocab = chosen_from.shape[-1]
        lltokenizer = self._lltokenizer
        assert not isinstance(lltokenizer, InvalidRequestError)  # no request got a matcher without it
        words = (lltokenizer.vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.int32)
        for j, i in enumerate(rows):
            matcher = requests[i].matcher
            if not matcher.is_error():
                matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, bitmask[j].nbytes)
            if matcher.is_error():  # e.g. its grammar hit a parser limit: the sampler retries row by row
                raise StructuredOutputError(f"request {requests[i].request_id}: {matcher.get_error()[:300]}")
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(bits.astype(np.bool_))
        index = torch.tensor(rows)
        masked = chosen_from.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=-1)
        if dead.any():  # the request's adjustments forbid all the grammar allows: the grammar wins
            raw = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
            masked[dead] = raw[dead]
        out = chosen_from.clone()
        out[index] = masked
        return out

    @staticmethod
    def advance(request: Request, token_id: int) -> bool:
        """Feed the sampled token to the request's matcher; True if its grammar is now complete
        (the request stops). False for an unconstrained request."""
        matcher = request.matcher
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            raise StructuredOutputError(f"request {request.request_id}: token {token_id} does not match its "
                                        f"structured output: {matcher.get_error()[:300]}")
        return bool(matcher.is_stopped())

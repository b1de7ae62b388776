"""Which DP rank probably holds a request's prompt prefix in its KV cache: the router's memory of
the prefixes it sent where (SGLang's cache-aware router keeps an approximate radix tree the same
way; the ranks are not asked).

Each rank's engine caches the prefixes it computed (`elasticmoe.engine.block_manager`), and the
router's default choice, the least-loaded rank, scatters the requests of one system prompt or one
conversation over every rank: at dp N each rank computes the prefix once, and a conversation's
next turn finds its earlier turns cached 1/N of the time. So the router names each request's
first blocks as the engines do (`elasticmoe.engine.prefix_hash`, blocks of `block_size` tokens,
salted with the adapter), remembers which rank it sent each name to (bounded, least recently used
first out), and prefers, among the ranks at most `slack` requests busier than the least-loaded one,
the rank holding the longest run of the request's names. An approximation: a rank may
have evicted a prefix since; the cost of a wrong guess is one prefill, as without affinity.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence

from elasticmoe.engine.prefix_hash import extend_block_hashes

DEFAULT_BLOCK_SIZE = 16  # the engines' (EngineConfig.block_size)
MAX_DEPTH = 32  # blocks named per request: 512 tokens of prefix
MAX_NAMES = 1 << 15  # per rank: ~4.5 MB (137 bytes a name, measured), 1,024 prompts of 32 blocks
SLACK = 4  # requests in flight a rank may have beyond the least-loaded one's and still be preferred


class PrefixAffinity:
    def __init__(self, num_ranks: int, block_size: int = DEFAULT_BLOCK_SIZE, max_depth: int = MAX_DEPTH,
                 max_names: int = MAX_NAMES, slack: int = SLACK) -> None:
        self.block_size, self.max_depth, self.max_names, self.slack = block_size, max_depth, max_names, slack
        self._names: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_ranks)]

    def names(self, token_ids: Sequence[int], adapter: str | None, cache_salt: str | None = None) -> list[bytes]:
        """The names of the request's first full blocks (at most `max_depth`), excluding the block
        of its last token, which an engine always computes; apart per adapter and `cache_salt`."""
        depth = min(self.max_depth, (len(token_ids) - 1) // self.block_size)
        names: list[bytes] = []
        salt = b"" if adapter is None and cache_salt is None else json.dumps([adapter, cache_salt]).encode()
        extend_block_hashes(names, token_ids, depth * self.block_size, self.block_size, salt)
        return names

    def depth(self, rank: int, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, `rank` was sent."""
        held = self._names[rank]
        depth = 0
        while depth < len(names) and names[depth] in held:
            depth += 1
        return depth

    def choose(self, names: Sequence[bytes], loads: Sequence[int], default: int) -> int:
        """The rank to send a request with `names` to, given each rank's requests in flight and the
        assignment's own choice `default`: among the ranks within `slack` of the least-loaded one,
        the one holding the longest run of its names (fewest in flight among equals); `default`
        where none holds any."""
        if not names:
            return default
        eligible = [r for r in range(len(self._names)) if loads[r] <= min(loads) + self.slack]
        depths = {r: self.depth(r, names) for r in eligible}
        best = max(eligible, key=lambda r: (depths[r], -loads[r], r == default))
        return best if depths[best] else default

    def record(self, rank: int, names: Sequence[bytes]) -> None:
        """`rank` was sent a request with `names`: it will hold them once it has computed them."""
        held = self._names[rank]
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.max_names:
            held.popitem(last=False)

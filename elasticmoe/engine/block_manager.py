"""Fixed-size KV blocks: free lists, reference counts and the prefix cache over the pool's block ids."""

from __future__ import annotations

from collections import OrderedDict

from elasticmoe.engine.prefix_hash import extend_block_hashes
from elasticmoe.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Hands out block ids of a pool of `num_blocks` blocks of `block_size` tokens.

    An allocation that does not fit changes nothing and returns False; the
    caller preempts and retries (or waits).

    The most recently freed block goes out first (the free list is a stack; block 0 first on a
    fresh pool). A pool's pages take memory on first touch (`kv_cache.LocalKVProvider`, the HMM's
    mappings), so reusing the blocks just freed keeps a server's resident memory at the KV it
    has used at once. Handed out oldest-freed first, the blocks cycled through the whole pool:
    the server's memory grew with every request (~10-20 KB each on the tiny model) until the
    whole KV budget was resident, which looks like a leak. Recent blocks are also still in cache.

    With `prefix_caching` a full block whose KV has been computed keeps its name
    (`prefix_hash`) after its requests free it: a later request whose tokens (and adapter) agree
    up to that block takes it instead of computing it again (`match_prefix`), as vLLM's and
    SGLang's automatic prefix caching do. Freed named blocks wait in a second free list, least
    recently freed first, and are taken for new KV only when no unnamed block is free; so the
    cache lives in the pool's otherwise idle blocks, and a server's resident KV memory grows
    toward the pool's budget as distinct prefixes arrive (that is the cache's memory). A shared
    block is read only: a request writes KV only past its matched blocks.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # unnamed; pop() takes block 0 first
        self.ref_counts = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # the name of a cached block -> its id
        self._name_of: dict[int, bytes] = {}  # ... and back
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # named, ref 0: least recently freed first
        self._in_flight: set[bytes] = set()  # names of the blocks the step being scheduled computes
        self.prefix_queries = 0  # prompt tokens looked up in the cache (metrics: the hit rate's denominator)
        self.prefix_hits = 0  # ... found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a named prefix, in use or free."""
        return len(self._name_of)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def stats(self) -> dict[str, int | float | bool]:
        """The pool and its prefix cache (`/admin/status`, `/metrics`); any thread may read it."""
        queries, hits = self.prefix_queries, self.prefix_hits
        return {"blocks": self.num_blocks, "block_size": self.block_size, "free_blocks": self.num_free_blocks,
                "usage": round(self.usage(), 4),
                "prefix_caching": self.prefix_caching, "cached_blocks": self.num_cached_blocks,
                "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0}

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        total = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total, self.block_size) - len(request.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request.block_ids` to hold `num_new_tokens` more tokens; False if the pool is short."""
        needed = self.num_blocks_needed(request, num_new_tokens)
        if not self.can_allocate(needed):
            return False
        for _ in range(needed):
            block_id = self._take_free()
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def _take_free(self) -> int:
        if self.free_block_ids:
            return self.free_block_ids.pop()
        block_id, _ = self._cached_free.popitem(last=False)  # the cached block freed longest ago
        del self._block_of[self._name_of.pop(block_id)]
        return block_id

    # ---- the prefix cache --------------------------------------------------------------------

    def match_prefix(self, request: Request) -> int:
        """Give a request without KV the cached blocks that hold its first tokens' KV: its
        `block_ids` start with them and `num_computed_tokens` counts their tokens, which is
        returned. At least its last token is left to compute (its logits sample the next one)."""
        if not self.prefix_caching or request.block_ids or request.num_computed_tokens:
            return 0
        salt = request.binding.cache_salt
        if salt is None:
            return 0
        extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens - 1, self.block_size, salt)
        for name in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block_id = self._block_of.get(name)
            if block_id is None:
                break
            if self.ref_counts[block_id] == 0:
                del self._cached_free[block_id]
            self.ref_counts[block_id] += 1
            request.block_ids.append(block_id)
        hit = len(request.block_ids) * self.block_size
        request.num_named_blocks_seen = len(request.block_ids)
        request.num_computed_tokens = hit
        return hit

    def begin_step(self) -> None:
        """A new step is being scheduled: no block is being computed yet."""
        self._in_flight.clear()

    def computing(self, request: Request, num_new_tokens: int) -> None:
        """The step computes `num_new_tokens` more of `request`'s tokens: the blocks they fill are
        in flight (their KV is written by this step, and named after it)."""
        end = (request.num_computed_tokens + num_new_tokens) // self.block_size
        salt = request.binding.cache_salt
        if not self.prefix_caching or salt is None or end <= request.num_computed_tokens // self.block_size:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, end * self.block_size, self.block_size, salt)
        self._in_flight.update(request.block_hashes[request.num_computed_tokens // self.block_size : end])

    def num_in_flight_tokens(self, request: Request) -> int:
        """Tokens of a matched request (`match_prefix`) just past its match that the step being
        scheduled computes for another request: it would find them cached one step later."""
        if not self._in_flight or request.binding.cache_salt is None:
            return 0
        first = len(request.block_ids)
        num_full = (request.num_tokens - 1) // self.block_size
        extend_block_hashes(request.block_hashes, request.token_ids, num_full * self.block_size, self.block_size,
                            request.binding.cache_salt)
        count = 0
        while first + count < num_full and request.block_hashes[first + count] in self._in_flight:
            count += 1
        return count * self.block_size

    def count_lookup(self, request: Request) -> None:
        """A request `match_prefix` saw was admitted: count its prompt's lookup (a request that did
        not fit is matched again at its next try, and counted once, when it starts)."""
        if self.prefix_caching and request.binding.cache_salt is not None:
            self.prefix_queries += request.num_prompt_tokens
            self.prefix_hits += min(request.num_computed_tokens, request.num_prompt_tokens)

    def cache_full_blocks(self, request: Request) -> None:
        """Name the request's blocks that its computed tokens have filled since the last call
        (after a forward wrote their KV). A block whose name another block already has stays
        unnamed (two requests computed the same prefix in one step)."""
        salt = request.binding.cache_salt
        num_full = request.num_computed_tokens // self.block_size
        if not self.prefix_caching or salt is None or num_full <= request.num_named_blocks_seen:
            return
        extend_block_hashes(request.block_hashes, request.token_ids, num_full * self.block_size, self.block_size, salt)
        for i in range(request.num_named_blocks_seen, num_full):
            name, block_id = request.block_hashes[i], request.block_ids[i]
            if name not in self._block_of and block_id not in self._name_of:
                self._block_of[name] = block_id
                self._name_of[block_id] = name
        request.num_named_blocks_seen = num_full

    def forget_cached(self) -> None:
        """Drop every name (the pool is shared with another engine from now on: a handover). The
        cached free blocks become plain free blocks."""
        self.free_block_ids.extend(self._cached_free)
        self._cached_free.clear()
        self._block_of.clear()
        self._name_of.clear()

    # ---- ownership -------------------------------------------------------------------------

    def claim(self, block_ids: list[int]) -> None:
        """Take specific free blocks (a fence, a handed-over block table); all or nothing."""
        self.claim_tables([block_ids])

    def claim_tables(self, tables: list[list[int]]) -> None:
        """Take the free blocks of handed-over block tables, one reference per table that holds
        a block (tables of one prefix share its cached blocks; a table never holds a block
        twice). All or nothing: a block in use here already is refused."""
        if any(len(set(table)) != len(table) for table in tables):
            raise ValueError("claim: a block table holds a block twice")
        wanted = {b for table in tables for b in table}
        if any(not 0 <= b < self.num_blocks or self.ref_counts[b] for b in wanted):
            raise ValueError("claim: blocks must be free")
        self.free_block_ids = [b for b in self.free_block_ids if b not in wanted]
        for b in wanted & self._cached_free.keys():  # its new holder may write it: the name goes
            del self._cached_free[b]
            del self._block_of[self._name_of.pop(b)]
        for table in tables:
            for b in table:
                self.ref_counts[b] += 1

    def free(self, request: Request) -> None:
        """Drop the request's blocks: it has no KV here any more (its computed tokens are 0)."""
        self.release(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = request.num_named_blocks_seen = 0

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (a request's table, a fence, a handed-out table)."""
        # Free in reverse so the tail blocks (least likely shared) return first.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self._name_of:
                    self._cached_free[block_id] = None
                else:
                    self.free_block_ids.append(block_id)

    def check_integrity(self, requests: list[Request]) -> None:
        """Every block is either free (ref 0) or held; held counts match the requests' tables;
        the cache's names and free lists agree."""
        held: dict[int, int] = {}
        for r in requests:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        free = set(self.free_block_ids) | set(self._cached_free)
        assert len(free) == self.num_free_blocks, "duplicate block in the free lists"
        assert all(b in self._name_of for b in self._cached_free), "an unnamed block in the cached free list"
        assert not set(self.free_block_ids) & set(self._name_of), "a named block in the unnamed free list"
        assert {self._block_of[n]: n for n in self._block_of} == self._name_of, "names and blocks disagree"
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == held.get(b, 0), f"block {b}: ref {self.ref_counts[b]} != held {held.get(b, 0)}"
            assert (b in free) == (self.ref_counts[b] == 0), f"block {b}: free-list membership disagrees with ref count"

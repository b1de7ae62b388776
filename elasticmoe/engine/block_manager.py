"""Fixed-size KV blocks: a free list and reference counts over the pool's block ids."""

from __future__ import annotations

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
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes block 0 first
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

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
            block_id = self.free_block_ids.pop()
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        return True

    def claim(self, block_ids: list[int]) -> None:
        """Take specific free blocks (a handed-over block table); all or nothing."""
        wanted = set(block_ids)
        if len(wanted) != len(block_ids) or any(self.ref_counts[b] for b in wanted):
            raise ValueError("claim: blocks must be distinct and free")
        self.free_block_ids = [b for b in self.free_block_ids if b not in wanted]
        for b in block_ids:
            self.ref_counts[b] = 1

    def free(self, request: Request) -> None:
        self.release(request.block_ids)
        request.block_ids = []

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block (a request's table, a fence, a handed-out table)."""
        # Free in reverse so the tail blocks (least likely shared) return first.
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)

    def check_integrity(self, requests: list[Request]) -> None:
        """Every block is either free (ref 0) or held; held counts match the requests' tables."""
        held: dict[int, int] = {}
        for r in requests:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "duplicate block in free list"
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == held.get(b, 0), f"block {b}: ref {self.ref_counts[b]} != held {held.get(b, 0)}"
            assert (b in free) == (self.ref_counts[b] == 0), f"block {b}: free-list membership disagrees with ref count"

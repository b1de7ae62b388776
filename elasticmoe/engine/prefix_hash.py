"""The names of full KV blocks for automatic prefix caching.

A block's KV depends on every token up to its end and on the weights that computed it (the
base model, or an adapter on it). So a block is named by a hash chained over the blocks
before it: `hash(parent's hash, salt, the block's tokens)`, where the salt names the weights
(`AdapterBinding.cache_salt`). Two requests whose names agree up to block i hold the same KV
in blocks 0..i, whatever follows.

BLAKE2b with 16-byte digests (the standard library's, ~1 us per block of 16 tokens): a
collision would hand one request another's KV, so no 64-bit hash of Python's own (vLLM moved
to SHA-256 for the same reason).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT = b"elasticmoe-prefix-v1"  # the parent of every request's first block


def block_hash(parent: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
    digest = blake2b(parent, digest_size=16)
    digest.update(len(salt).to_bytes(4, "little"))
    digest.update(salt)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], num_tokens: int, block_size: int,
                        salt: bytes) -> None:
    """Append to `hashes` (the names of the first blocks of `token_ids`, already computed) the
    names of the further blocks that `num_tokens` tokens fill completely."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else ROOT
        hashes.append(block_hash(parent, salt, token_ids[i * block_size : (i + 1) * block_size]))

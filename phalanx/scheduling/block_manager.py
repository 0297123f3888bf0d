"""The KV cache's blocks as plain data: a free list, reference counts, and the prefix cache.

The cache is a pool of `num_blocks` blocks of `block_size` positions each (the tensors are in
`paged_cache.py`; this file only hands out block ids). A sequence's block table lists the ids
of its blocks in position order, allocated as it grows, so at most one block per sequence is
partly filled.

Prefix caching: a block whose every position is computed gets a hash of (its parent block's
hash, its token ids), which names the whole prefix up to its end. A later sequence whose
prompt starts with the same tokens finds those hashes and shares the blocks (reference
counted) instead of computing them again. A shared block is always full, so nobody writes to
it again. When its last user lets go, a hashed block stays findable among the free blocks and
is evicted, least recently freed first, only when a fresh block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """The prefix up to this block's end: sha256 over the parent's hash and the block's ids
    (a digest, not Python's hash: two different prefixes must never share a block)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class NoFreeBlock(Exception):
    """The pool has no free block left (the scheduler preempts before this can happen)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.fresh: list[int] = list(range(num_blocks - 1, -1, -1))  # free, unhashed; pop() takes block 0 first
        self.cached_free: OrderedDict[bytes, int] = OrderedDict()  # free but findable, oldest first
        self.by_hash: dict[bytes, int] = {}  # every hashed block, used or free

    @property
    def num_free(self) -> int:
        return len(self.fresh) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """A block for new positions (reference count 1): a fresh one, else the prefix cache's
        least recently freed block, whose hash is forgotten."""
        if self.fresh:
            block = self.fresh.pop()
        elif self.cached_free:
            old_hash, block = self.cached_free.popitem(last=False)
            del self.by_hash[old_hash]
            self.hash_of[block] = None
        else:
            raise NoFreeBlock
        self.ref_count[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] > 0:
            return
        if self.hash_of[block] is not None:
            self.cached_free[self.hash_of[block]] = block  # newest at the end
        else:
            self.fresh.append(block)

    def find_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest run of these full-block hashes from the start."""
        if not self.prefix_caching:
            return []
        found = []
        for digest in hashes:
            block = self.by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def free_after_taking(self, blocks: list[int]) -> int:
        """How many blocks would be free once `blocks` (found by `find_prefix`) are taken."""
        return self.num_free - sum(1 for block in blocks if self.ref_count[block] == 0)

    def take(self, block: int) -> None:
        """Share a block found by `find_prefix`."""
        if self.ref_count[block] == 0:
            del self.cached_free[self.hash_of[block]]
        self.ref_count[block] += 1

    def register(self, block: int, digest: bytes) -> None:
        """Block `block` is now full with the prefix `digest`. If another block already holds
        that prefix (two sequences computed it at once), this one stays unshared."""
        if self.prefix_caching and self.hash_of[block] is None and digest not in self.by_hash:
            self.hash_of[block] = digest
            self.by_hash[digest] = block

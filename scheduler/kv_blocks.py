"""KV cache blocks: the pool every request's block table comes from, and the prefix cache.

The runner's KV storage is one pool of `num_blocks` blocks of `block_size`
token positions. A request holds a block table (`Request.block_ids`): position
p of its sequence lives in block `block_ids[p // block_size]`. Blocks are
reference-counted, so requests that share a prefix share its blocks.

Prefix caching: once a block is full of computed tokens it gets a key, a hash
chained over (parent key, the block's tokens), rooted in the model's identity
and the request's tenant, so one tenant's prompts never reach another's cache.
A new request looks its prompt up block by block and takes the longest run of
keys found. A block whose last reader leaves keeps its key and goes to the
back of the free queue: it is reused as a cache hit until allocation, which
takes from the front (least recently freed), evicts it.

Keys are blake2b digests, not Python's `hash`: a tenant must not be able to
craft a collision that reads another tenant's KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

BlockKey = bytes


def block_key(parent: BlockKey, token_ids: list[int]) -> BlockKey:
    """The key of a full block holding `token_ids`, after the block keyed `parent`."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def root_key(identity: str, tenant: str) -> BlockKey:
    """The chain's start: keys differ across models and across tenants."""
    return hashlib.blake2b(f"{identity}\0{tenant}".encode(), digest_size=16).digest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class BlockStored:
    """A full block entered the prefix cache: its key, its parent's (None at a chain's root) and its tokens."""

    key: BlockKey
    parent: BlockKey | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """A cached block was evicted (reallocated for other tokens)."""

    key: BlockKey


BlockEvent = BlockStored | BlockRemoved


@dataclass
class PrefixCacheStats:
    """Tokens looked up in the prefix cache and tokens found, since start (as vLLM counts them)."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, identity: str = ""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.identity = identity
        self.ref_count = [0] * num_blocks
        self.key_of: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}
        # Blocks no request holds, least recently freed first; cached ones among them are evictable hits.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.stats = PrefixCacheStats()
        # What entered and left the cache since the last `drain_events`, for KV-event publishing
        # (`server.kv_events`); None: nobody listens, nothing is kept.
        self.events: list[BlockEvent] | None = None

    def drain_events(self) -> list[BlockEvent]:
        """The events since the last call (none when nobody listens)."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    # -- state --
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free, cached or not)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def root(self, tenant: str) -> BlockKey:
        return root_key(self.identity, tenant)

    # -- prefix lookup --
    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The blocks of the longest cached run of `keys` from the start (no references taken)."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def num_needed(self, hits: list[int], num_new: int) -> int:
        """Free blocks that taking `hits` and allocating `num_new` more would use up."""
        return num_new + sum(1 for b in hits if self.ref_count[b] == 0)

    # -- references --
    def take(self, blocks: list[int]) -> None:
        """Share cached blocks: a free one leaves the free queue, so no allocation evicts it."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, evicting the least recently freed cached ones; the caller checked `num_free`."""
        if n > len(self.free):
            raise RuntimeError(f"KV pool exhausted: {n} blocks asked, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.key_of[block]
            if key is not None:
                del self.cached[key]
                self.key_of[block] = None
                if self.events is not None:
                    self.events.append(BlockRemoved(key))
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of a request's blocks. The tail is queued
        first, so a sequence's later blocks are evicted before its prefix."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released more often than taken"
            if self.ref_count[block] == 0:
                self.free[block] = None

    def cache(
        self, block: int, key: BlockKey, parent: BlockKey | None = None, token_ids: list[int] | None = None
    ) -> None:
        """A full block of computed tokens becomes a cache entry (the first block with a key wins);
        `parent` (None for a sequence's first block) and `token_ids` describe it to KV-event listeners."""
        if not self.enable_caching or self.key_of[block] is not None or key in self.cached:
            return
        self.key_of[block] = key
        self.cached[key] = block
        if self.events is not None and token_ids is not None:
            self.events.append(BlockStored(key, parent, tuple(token_ids)))

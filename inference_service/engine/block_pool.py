"""KV block accounting: every block is free, cached (unheld, reusable) or held, never two of these.

Held blocks have a reference count (one per request table holding them; prefix-cache hits share
them). A held block may carry a content hash (`engine.prefix_cache`); when its last holder drops it
a hashed block stays cached, reusable by a later hit, until its memory is needed: allocation takes
the free list first, then evicts cached blocks least recently released first. Blocks without a
hash go straight back to the free list. Pure bookkeeping (no tensors): `KVCache` owns the memory.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.caching = caching
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its content hash (held or cached)
        self._by_hash: dict[bytes, int] = {}  # content hash -> the one block holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # unheld hashed blocks, LRU first
        self.evictions = 0

    # ---- counts (the gauges) ----

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take now: the free list and the cached blocks nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_held(self) -> int:
        """Blocks some request holds (a leak check counts these: cached blocks are not a leak)."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks with a content hash that no request holds (reusable until evicted)."""
        return len(self._cached)

    @property
    def num_hashed(self) -> int:
        """Blocks with a content hash, held or not."""
        return len(self._hash_of)

    # ---- hits ----

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of a hash chain (not taken yet: see `can_take`)."""
        blocks = []
        if self.caching:
            for block_hash in hashes:
                block = self._by_hash.get(block_hash)
                if block is None:
                    break
                blocks.append(block)
        return blocks

    def can_take(self, hits: list[int], num_new: int) -> bool:
        """Whether `hits` (from `lookup`) can be held and `num_new` blocks allocated beside them:
        a hit on an unheld cached block takes it out of what allocation may use."""
        unheld_hits = sum(1 for b in hits if self._refs[b] == 0)
        return num_new <= self.num_free - unheld_hits

    def take(self, hits: list[int]) -> None:
        """Hold each hit block once more (a cached one leaves the LRU)."""
        for block in hits:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1

    # ---- allocation and release ----

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, held once each (callers check `num_free` first): the free list first,
        then the least recently released cached blocks, whose hashes are forgotten."""
        if n > self.num_free:
            raise RuntimeError(f"{n} blocks asked, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._by_hash[self._hash_of.pop(block)]
                self.evictions += 1
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block (a table's, in table order). Released tail first, so
        a chain's last blocks are evicted before its first ones (a prefix stays useful longest)."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"block {block} released more often than it was held")
            self._refs[block] = refs
            if refs == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Record a held, fully written block's content hash. A hash some other block already has
        (two requests computed the same block at once) stays with that one: this block is then
        freed, not cached, when released."""
        if not self.caching or block in self._hash_of or block_hash in self._by_hash:
            return
        assert self._refs[block] > 0, f"block {block} cached while nobody holds it"
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block

    def refs(self, block: int) -> int:
        return self._refs[block]

    def check(self) -> None:
        """The invariants (tests): each block exactly one of free, cached, held; maps consistent."""
        free, cached = set(self._free), set(self._cached)
        held = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & cached) and not (free & held) and not (cached & held)
        assert free | cached | held == set(range(self.num_blocks))
        assert all(self._refs[b] == 0 for b in free | cached)
        assert cached <= set(self._hash_of) and not (free & set(self._hash_of))
        assert {b: h for h, b in self._by_hash.items()} == self._hash_of

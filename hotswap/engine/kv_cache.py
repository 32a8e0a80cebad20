"""Paged KV-cache bookkeeping: a reference-counted block pool with prefix caching.

Blocks hold `block_size` tokens. A full block whose tokens are known gets a chained hash
(parent hash + its tokens), so equal prefixes map to equal hashes and can share blocks.
Unreferenced blocks sit in an LRU free queue; a cached one stays reusable until allocation
evicts it. Allocation is check-then-act: callers ask `can_allocate` first, and `allocate`
never half-succeeds.

Retention (a request's `kv_retention_s`: an agent's next turn comes after a tool call): a
finished request's blocks wait in a retained queue until their deadline instead of the
free queue. Allocation takes free blocks first and retained ones only when no free block
is left (oldest retention first), so a hint never makes a request wait or be preempted;
expired blocks join the free queue (still cached), and a weight commit or a prefix-cache
reset releases them all (their KV is of old weights, or no longer shareable).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from hotswap.engine.request import Request


def root_hash(
    weight_version: int, cache_salt: str | None = None, adapter_uid: int | None = None
) -> bytes:
    """Chains start from the weight version, the request's salt and its LoRA adapter's
    loaded version (`AdapterWeights.uid`, new on every load or reload): KV computed with
    other weights, under another salt or another adapter never matches."""
    root = b"hotswap-kv-v%d" % weight_version
    if cache_salt is not None:
        root += b"|salt|" + hashlib.blake2b(cache_salt.encode(), digest_size=16).digest()
    if adapter_uid is not None:
        root += b"|lora|%d" % adapter_uid
    return root


def hash_block(
    parent: bytes | None,
    token_ids: Sequence[int],
    weight_version: int = 0,
    cache_salt: str | None = None,
    adapter_uid: int | None = None,
    extra: bytes = b"",
) -> bytes:
    """`extra`: what else the block's KV depends on (the images its tokens stand for)."""
    root = parent or root_hash(weight_version, cache_salt, adapter_uid)
    digest = hashlib.blake2b(root, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if extra:
        digest.update(b"|mm|" + extra)
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Insertion order = eviction order: least recently freed first.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # Unreferenced blocks kept for a finished request's next turn: block -> deadline
        # (time.monotonic()), in the order they were retained (taken in that order).
        self.retained: OrderedDict[int, float] = OrderedDict()
        self.next_expiry = float("inf")  # the earliest deadline (expire scans only then)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (retained ones included: retention is soft)."""
        return len(self.free_queue) + len(self.retained)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(
                f"KV cache: asked for {num_blocks} blocks, {self.num_free_blocks} free"
            )
        block_ids = []
        for _ in range(num_blocks):
            queue = self.free_queue if self.free_queue else self.retained
            block_id, _ = queue.popitem(last=False)
            self._evict(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks found by lookup (maybe currently free)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                queue = self.free_queue if block_id in self.free_queue else self.retained
                del queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int], retain_until: float | None = None) -> None:
        """Drop a reference to each block; an unreferenced one joins the free queue, or
        with `retain_until`, if cached, the retained queue until then."""
        # Callers pass blocks tail first, so a request's last blocks are evicted first.
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV cache: double free of block {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] > 0:
                continue
            if retain_until is not None and self.block_hash[block_id] is not None:
                self.retained[block_id] = retain_until
                self.next_expiry = min(self.next_expiry, retain_until)
            else:
                self.free_queue[block_id] = None

    def expire(self, now: float) -> None:
        """Retained blocks past their deadline join the free queue (still cached)."""
        if now < self.next_expiry:
            return
        for block_id, deadline in list(self.retained.items()):
            if deadline <= now:
                del self.retained[block_id]
                self.free_queue[block_id] = None
        self.next_expiry = min(self.retained.values(), default=float("inf"))

    def release_retained(self) -> None:
        self.expire(float("inf"))

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash in self.cached:  # an identical block exists; keep the first one
            return
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Forget these blocks' hashes (their KV will not be written after all)."""
        for block_id in block_ids:
            self._evict(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every hash; blocks in use stay allocated but are no longer shareable."""
        self.release_retained()  # no longer shareable: nothing to keep them for
        dropped = len(self.cached)
        for block_id in self.cached.values():
            self.block_hash[block_id] = None
        self.cached.clear()
        return dropped

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None


class KVCacheManager:
    """Maps requests onto blocks of the pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.weight_version = 0  # salts block hashes; set by the engine on each commit
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of which served from it

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's known tokens, in whole blocks. At least
        one token is always left to compute so the step yields logits to sample from.
        A request that still needs prompt logprobs computes its whole prompt."""
        if not self.enable_caching or request.needs_prompt_logprobs:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        return self.pool.can_allocate(
            self._num_new_blocks(request, num_new_tokens, computed_blocks)
        )

    def allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> None:
        """Give the request room for `num_new_tokens` more computed tokens (after the
        `computed_blocks` prefix hit, if any) and register its newly full blocks."""
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            raise RuntimeError(
                f"KV cache: no room for {num_new_tokens} tokens of {request.request_id!r}"
            )
        num_new = self._num_fresh_blocks(request, num_new_tokens, computed_blocks)
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
        request.block_ids.extend(self.pool.allocate(num_new))
        num_tokens_after = request.num_computed_tokens + len(computed_blocks) * self.block_size
        self._cache_full_blocks(request, num_tokens_after + num_new_tokens)

    def free(self, request: Request, retain_until: float | None = None) -> None:
        self.pool.free(request.block_ids[::-1], retain_until)
        request.block_ids = []

    def set_weight_version(self, version: int) -> None:
        """New weights: new hashes from now on, and retained blocks (of the old weights'
        KV, which no later request can hit) released."""
        self.weight_version = version
        self.pool.release_retained()

    def unschedule(self, request: Request, num_computed: int) -> None:
        """Its chunk from `num_computed` on will not run after all (taken back by a
        preemption): the blocks `allocate` registered for it as full hold no KV, so they
        must not be shared. Blocks below `num_computed // block_size` were full and
        computed in earlier steps; no other request can have hit the later ones yet (a
        prefix lookup happens only at admission, after every running request is placed)."""
        self.pool.uncache(request.block_ids[num_computed // self.block_size :])

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]
    ) -> int:
        """Blocks the free queue must give up: fresh ones, plus cached hits that are
        currently unreferenced (touching them takes them out of the free queue too)."""
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        return self._num_fresh_blocks(request, num_new_tokens, computed_blocks) + num_revived

    def _num_fresh_blocks(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]
    ) -> int:
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        return max(needed - len(request.block_ids) - len(computed_blocks), 0)

    def _update_block_hashes(self, request: Request) -> None:
        size = self.block_size
        if request.block_hashes_version != self.weight_version:
            request.block_hashes = []
            request.block_hashes_version = self.weight_version
        hashes = request.block_hashes
        while (len(hashes) + 1) * size <= request.num_tokens:
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            tokens = request.all_token_ids[start : start + size]
            adapter = request.lora.uid if request.lora is not None else None
            images = b"" if request.images is None else request.images.keys(start, start + size)
            hashes.append(hash_block(parent, tokens, self.weight_version, request.cache_salt,
                                     adapter, images))  # fmt: skip

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Blocks whose tokens will all be computed after this step can be shared now: the
        runner writes every layer's new KV before any attention reads it."""
        if not self.enable_caching or request.kv_version != self.weight_version:
            return  # KV computed with older weights (kept by clear_cache=False) is not shared
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(num_full):
            self.pool.cache_block(request.block_ids[index], request.block_hashes[index])

from __future__ import annotations

import pytest

from hotswap.engine.kv_cache import BlockPool, KVCacheManager, hash_block
from hotswap.engine.request import Request
from hotswap.sampling_params import SamplingParams


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


class TestBlockPool:
    def test_allocate_and_free_refcounts(self) -> None:
        pool = BlockPool(4)
        blocks = pool.allocate(3)
        assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
        assert all(pool.ref_counts[b] == 1 for b in blocks)
        pool.touch([blocks[0]])
        assert pool.ref_counts[blocks[0]] == 2
        pool.free(blocks)
        assert pool.num_free_blocks == 3  # blocks[0] still referenced once
        pool.free([blocks[0]])
        assert pool.num_free_blocks == 4

    def test_allocate_more_than_free_raises_and_changes_nothing(self) -> None:
        pool = BlockPool(2)
        pool.allocate(1)
        assert not pool.can_allocate(2)
        with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
            pool.allocate(2)
        assert pool.num_free_blocks == 1

    def test_double_free_is_detected(self) -> None:
        pool = BlockPool(2)
        [block] = pool.allocate(1)
        pool.free([block])
        with pytest.raises(RuntimeError, match="double free"):
            pool.free([block])

    def test_cached_block_survives_free_until_evicted_lru(self) -> None:
        pool = BlockPool(3)
        a, b, c = pool.allocate(3)
        pool.cache_block(a, b"ha")
        pool.cache_block(b, b"hb")
        pool.free([b, a, c])  # freed in that order: b is the least recently freed
        assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b
        [first] = pool.allocate(1)
        assert first == b and pool.lookup(b"hb") is None  # evicted
        assert pool.lookup(b"ha") == a

    def test_touch_revives_a_free_cached_block(self) -> None:
        pool = BlockPool(2)
        [a] = pool.allocate(1)
        pool.cache_block(a, b"h")
        pool.free([a])
        pool.touch([a])
        assert pool.num_free_blocks == 1 and pool.ref_counts[a] == 1
        assert pool.lookup(b"h") == a

    def test_reset_prefix_cache_forgets_hashes(self) -> None:
        pool = BlockPool(2)
        [a] = pool.allocate(1)
        pool.cache_block(a, b"h")
        assert pool.reset_prefix_cache() == 1
        assert pool.lookup(b"h") is None and pool.ref_counts[a] == 1

    def test_caching_disabled_never_registers(self) -> None:
        pool = BlockPool(2, enable_caching=False)
        [a] = pool.allocate(1)
        pool.cache_block(a, b"h")
        assert pool.lookup(b"h") is None


def test_block_hashes_chain_on_parent() -> None:
    h1 = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) == h1
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])


class TestKVCacheManager:
    def test_prefix_hit_shares_blocks_and_leaves_one_token(self) -> None:
        kv = KVCacheManager(num_blocks=10, block_size=4)
        first = make_request(list(range(10)), "a")
        kv.allocate(first, 10)
        assert len(first.block_ids) == 3
        second = make_request(list(range(10)) + [99], "b")
        blocks, num_cached = kv.get_computed_blocks(second)
        assert num_cached == 8 and blocks == first.block_ids[:2]
        # A prompt equal to cached full blocks still recomputes its last token.
        exact = make_request(list(range(8)), "c")
        assert kv.get_computed_blocks(exact)[1] == 4

    def test_different_prefix_misses(self) -> None:
        kv = KVCacheManager(num_blocks=10, block_size=4)
        kv.allocate(make_request([1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
        other = make_request([1, 2, 3, 5, 5, 6, 7, 8, 9])
        assert kv.get_computed_blocks(other) == ([], 0)

    def test_allocation_counts_revived_cached_blocks(self) -> None:
        kv = KVCacheManager(num_blocks=3, block_size=4)
        first = make_request(list(range(9)), "a")
        kv.allocate(first, 9)
        kv.free(first)
        assert kv.num_free_blocks == 3
        second = make_request(list(range(8)) + [50, 51, 52, 53, 54], "b")
        blocks, num_cached = kv.get_computed_blocks(second)
        assert num_cached == 8
        # 2 revived cached blocks + 2 new ones (tokens 8..12) > 3 blocks in the pool.
        assert not kv.can_allocate(second, 5, blocks)
        assert kv.can_allocate(second, 4, blocks)
        kv.allocate(second, 4, blocks)
        assert second.block_ids[:2] == blocks and kv.num_free_blocks == 0

    def test_free_returns_everything(self) -> None:
        kv = KVCacheManager(num_blocks=8, block_size=4)
        reqs = [make_request(list(range(i, i + 13)), str(i)) for i in range(2)]
        for r in reqs:
            kv.allocate(r, 13)
        for r in reqs:
            kv.free(r)
        assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_cache_salt_separates_prefixes_and_prompt_logprobs_skip_the_cache() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(10))
    salted = Request("s1", prompt, SamplingParams(), cache_salt="v1")
    kv.allocate(salted, 10)
    assert kv.get_computed_blocks(Request("s2", prompt, SamplingParams(), cache_salt="v1"))[1] == 8
    assert kv.get_computed_blocks(Request("s3", prompt, SamplingParams(), cache_salt="v2"))[1] == 0
    assert kv.get_computed_blocks(Request("plain", prompt, SamplingParams()))[1] == 0
    scored = Request("p", prompt, SamplingParams(prompt_logprobs=0), cache_salt="v1")
    assert kv.get_computed_blocks(scored) == ([], 0)  # its prompt must be computed to score it
    scored.prompt_logprobs = [None] * 9  # once every prompt token is scored, hits are fine
    assert kv.get_computed_blocks(scored)[1] == 8

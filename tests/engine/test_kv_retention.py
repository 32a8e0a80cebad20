"""KV retention (`kv_retention_s`, hotswap/engine/kv_cache.py): a finished request's cached
blocks wait out its session's tool call in a retained queue, taken only when no free block
is left, released at their deadline, by a weight commit or by a prefix-cache reset."""

from __future__ import annotations

import asyncio

import pytest

from hotswap import AsyncLLM, SamplingParams
from hotswap.engine.kv_cache import BlockPool
from hotswap.errors import InvalidArgument

H = [b"h%d" % i for i in range(8)]


def pool_with(retained: list[int], free: list[int], deadline: float = 10.0) -> BlockPool:
    """6 blocks: `retained` cached and retained until `deadline`, `free` freed after them."""
    pool = BlockPool(6)
    taken = pool.allocate(6)
    for block in taken:
        pool.cache_block(block, H[block])
    pool.free(retained, retain_until=deadline)
    pool.free(free)
    return pool


def test_retained_blocks_are_taken_last_and_a_hit_revives_them() -> None:
    pool = pool_with(retained=[0, 1], free=[2, 3])
    assert pool.num_free_blocks == 4 and list(pool.retained) == [0, 1]
    assert pool.allocate(2) == [2, 3]  # the free ones first, though freed later
    assert pool.lookup(H[0]) == 0 and pool.lookup(H[1]) == 1  # still cached
    pool.touch([1])  # a next turn hits it: out of the retained queue
    assert list(pool.retained) == [0]
    assert pool.allocate(1) == [0] and pool.lookup(H[0]) is None  # last resort: evicted
    assert not pool.can_allocate(1)


def test_retention_ends_at_the_deadline_on_a_commit_and_on_a_reset() -> None:
    pool = pool_with(retained=[0, 1], free=[])
    pool.expire(9.9)
    assert list(pool.retained) == [0, 1]
    pool.expire(10.0)  # due: free, still cached
    assert not pool.retained and list(pool.free_queue)[-2:] == [0, 1]
    assert pool.lookup(H[0]) == 0
    pool = pool_with(retained=[0, 1], free=[])
    pool.release_retained()  # what a weight commit does (KVCacheManager.set_weight_version)
    assert not pool.retained and pool.num_free_blocks == 2
    pool = pool_with(retained=[0], free=[])
    pool.reset_prefix_cache()
    assert not pool.retained and pool.lookup(H[0]) is None
    uncached = BlockPool(2)
    uncached.free(uncached.allocate(1), retain_until=10.0)  # holds no shareable KV
    assert not uncached.retained


CONTEXT = list(range(10, 34))  # 24 tokens: 6 whole blocks of 4
OTHER = list(range(40, 64))
LARGE = list(range(70, 106))  # 36 tokens: with its output, 10 of the 16 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def _next_turn_hit(llm: AsyncLLM, retention: float) -> int:
    """A turn with `retention`; another session's turn and a large request churn the
    cache meanwhile; returns how many tokens of the first turn's context the next hits."""

    async def run(prompt: list[int], rid: str, **hints: float) -> object:
        return [o async for o in llm.generate(prompt, GREEDY, rid, **hints)][-1]

    first = await run(CONTEXT, f"a-{retention}", kv_retention_s=retention)
    await run(OTHER, f"c-{retention}")  # freed after the first: later in the LRU order
    await run(LARGE, f"b-{retention}")  # needs the blocks of one of them
    turn = CONTEXT + list(first.outputs[0].token_ids) + [7, 7, 7]
    return (await run(turn, f"a2-{retention}", kv_retention_s=retention)).num_cached_tokens


def test_a_retained_session_survives_another_sessions_churn(tiny_llama) -> None:
    async def scenario() -> tuple[int, int, dict]:
        llm = AsyncLLM(str(tiny_llama), progress=False, dtype="float32", block_size=4,
                       num_kv_blocks=16, max_model_len=64)  # fmt: skip
        try:
            without = await _next_turn_hit(llm, 0.0)
            await llm.reset_prefix_cache()
            kept = await _next_turn_hit(llm, 600.0)
            retained = (await llm.get_stats())["num_retained_blocks"]
            await llm.update_weight_version("next")  # a commit releases them
            after_commit = (await llm.get_stats())["num_retained_blocks"]
            with pytest.raises(InvalidArgument) as e:
                await _next_turn_hit(llm, -1.0)
            assert e.value.field == "kv_retention_s"
            return without, kept, {"retained": retained, "after_commit": after_commit}
        finally:
            llm.shutdown()

    without, kept, counts = asyncio.run(scenario())
    assert kept >= 24 and without < 24, (without, kept)
    assert counts["retained"] > 0 and counts["after_commit"] == 0, counts

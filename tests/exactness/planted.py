"""Planted bugs: each breaks one piece of hotswap in this process, for as long as its
context lasts, to show the checker finds it (`--plant NAME`, and the tests). Nothing here
touches a file; every patch is undone on exit. Engines in other processes (the HTTP
server) are not affected: plants run through the Python API.

- `clear-cache-keeps-a-block`: after a pause with clear_cache, a frozen request resumes
  with its first KV block as it was (computed under the old weights) instead of
  recomputing it, and its tokens are not marked stale.
- `wrong-version-label`: the output processor labels the first token after a weight
  commit with the previous version.
- `prefix-across-versions`: prefix-cache keys leave out the weight version, so a prompt
  cached under old weights is served to requests running on new ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import msgspec

from hotswap.engine import kv_cache, output_processor, scheduler


def _clear_cache_keeps_a_block() -> tuple[object, str, Callable]:
    kept: dict[str, int] = {}
    original_lookup = kv_cache.KVCacheManager.get_computed_blocks

    def drop_running_kv(original: Callable) -> Callable:
        def patched(self: scheduler.Scheduler) -> int:
            for request in self.running:
                if request.num_computed_tokens >= self.kv.block_size and request.block_ids:
                    block = request.block_ids[0]
                    self.kv.pool.touch([block])  # held past the free below
                    kept[request.request_id] = block
            return original(self)

        return patched

    def get_computed_blocks(self: kv_cache.KVCacheManager, request):  # noqa: ANN001, ANN202
        block = kept.pop(request.request_id, None)
        if block is None or request.num_tokens <= self.block_size:
            if block is not None:
                self.pool.free([block])
            return original_lookup(self, request)
        self.pool.free([block])  # allocate() takes it back as a cache hit
        return [block], self.block_size

    kv_cache.KVCacheManager.get_computed_blocks = get_computed_blocks
    return scheduler.Scheduler, "drop_running_kv", drop_running_kv


def _wrong_version_label() -> tuple[object, str, Callable]:
    def record_provenance(original: Callable) -> Callable:
        def patched(self: output_processor.ChoiceState, out) -> None:  # noqa: ANN001
            last = self.spans[-1] if self.spans else None
            if last is not None and out.new_token_ids and out.weight_version != last.version:
                out = msgspec.structs.replace(
                    out, weight_version=last.version, weight_label=last.label, stale=last.stale
                )
            original(self, out)

        return patched

    return output_processor.ChoiceState, "record_provenance", record_provenance


def _prefix_across_versions() -> tuple[object, str, Callable]:
    def root_hash(original: Callable) -> Callable:
        def patched(weight_version: int, *args: object) -> bytes:
            return original(0, *args)

        return patched

    return kv_cache, "root_hash", root_hash


PLANTS: dict[str, Callable[[], tuple[object, str, Callable]]] = {
    "clear-cache-keeps-a-block": _clear_cache_keeps_a_block,
    "wrong-version-label": _wrong_version_label,
    "prefix-across-versions": _prefix_across_versions,
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[None]:
    """Break hotswap as plant `name` says, until the context exits."""
    lookup = kv_cache.KVCacheManager.get_computed_blocks
    target, attribute, wrap = PLANTS[name]()
    original = getattr(target, attribute)
    setattr(target, attribute, wrap(original))
    try:
        yield
    finally:
        setattr(target, attribute, original)
        kv_cache.KVCacheManager.get_computed_blocks = lookup
